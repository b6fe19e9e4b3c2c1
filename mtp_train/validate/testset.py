"""`mtp-train test`: the test report. The figures a run quotes, on prompt sets nothing was chosen on
(`validate.test_prompts`: MT-bench's 72 test questions, the ShareGPT test draw, the function-writing test draw),
at the one setting chosen on the dev sets (`validate.test_k` or `validate.test_tree`, greedy, batch 1).

Per set, prompt by prompt: the target alone and the head, timed back to back (the order alternating), so the
speed-up is the ratio of the two total times with a load change hitting both sides; then the head once more at
k = 5, untimed, for the acceptance by position and the τ it implies at k = 1..5. 95% intervals come from a
bootstrap over prompts. Greedy output must be the target's own: a prompt where it is not is reported with the
first differing position and the target's top-2 logit gap there; a gap below NEAR_TIE is an fp32 near-tie between
the batched verification forward and the single-token one and is named so, any other mismatch fails the run
(the report is written first).

With `validate.engine=vllm`, vLLM then judges the same sets too: the head's export served greedy at k = 1..5, τ
and acceptance from vLLM's counters beside ours, its output checked against vLLM's target alone (a mismatch fails
the run).

Before any decoding, the dev and test prompts are checked against the training data and each other
(disjoint.py). The report names the git commit the choice was made at; every run is appended to
`run_dir/validation/test_runs.jsonl` beside `test.json`, so a head's every test run is on record.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtp_train.data.prompt_sets import PromptSet
from mtp_train.files import data_cache_dir, sha256_file, write_json
from mtp_train.inference.config import SamplingConfig, tree_label
from mtp_train.inference.load import check_drafter, load_head, stop_tokens
from mtp_train.inference.runner import CausalLMRunner, load_runner
from mtp_train.model.target import load_tokenizer
from mtp_train.validate.decoding import decode_all, processor_name
from mtp_train.validate import vllm
from mtp_train.validate.disjoint import check_disjoint
from mtp_train.validate.run import prompt_sets

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

NEAR_TIE = 1e-4  # a top-2 logit gap below this at a greedy mismatch: an fp32 near-tie, not a bug
ACCEPTANCE_K = 5  # the untimed pass that measures acceptance by position
BOOTSTRAP = 2000  # resamples of the prompts for each 95% interval


class GreedyMismatch(RuntimeError):
    """Greedy output that differs from the target's own where the target's top two logits are not tied."""


def run(cfg: "RunConfig") -> dict:
    v = cfg.validate
    t0 = time.perf_counter()
    check_drafter(cfg, "head")
    tokenizer = load_tokenizer(cfg.target.path)
    data_dir = Path(cfg.run_dir) / "data"
    test = prompt_sets(v, data_dir, tokenizer, "test")
    dev = prompt_sets(replace(v, num_prompts=0), data_dir, tokenizer, "dev", whole=True)  # every dev prompt
    disjoint = check_disjoint(data_dir, tokenizer, dev, test)
    print(f"test: {disjoint['test_prompts']} test and {disjoint['dev_prompts']} dev prompts checked against "
          f"{disjoint['train_rows']} training rows and each other: no overlap")
    target = load_runner(cfg.target.path, cfg.target)
    drafter, meta = load_head(cfg, target)
    stop = stop_tokens(tokenizer, target)
    tree = v.tree_for_test()
    setting = tree_label(tree) if tree else f"k={v.test_k}"
    report = {"head": {"checkpoint": meta["checkpoint"], "variant": meta["variant"], "step": meta["step"],
                       "sha256": sha256_file(Path(meta["checkpoint"]) / "head.safetensors")},
              "setting": setting, "choice": choice_record(Path(cfg.run_dir)), "disjoint": disjoint,
              "settings": {"max_new_tokens": v.max_new_tokens, "batch_size": 1, "temperature": 0.0,
                           "dtype": cfg.target.dtype, "device": str(target.device), "processor": processor_name(),
                           "torch_threads": torch.get_num_threads(), "seed": cfg.seed},
              "sets": []}
    failures = []
    for s in test:
        print(f"test: prompt set {s.name}: {s.line}")
        section = test_set(cfg, target, drafter, s, stop, tree)
        report["sets"].append(section)
        failures += set_failures(section)
    if v.engine == "vllm":  # vLLM judges the same test sets: its export served, greedy, against its target alone
        report["vllm"] = vllm_judge(cfg, meta["variant"], test)
        failures += [f"vLLM {x['name']} k={x['k']}: greedy output differs from vLLM's target alone on "
                     f"{x['num_prompts'] - x['greedy_identical_prompts']} prompts"
                     for x in report["vllm"] if not x["greedy_identical"]]
    report["config"] = asdict(v)
    report["failures"] = failures  # what makes the command fail (after the report is written): [] when trusted
    report["seconds"] = time.perf_counter() - t0
    out = Path(cfg.run_dir) / "validation"
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "test.json", report)
    with open(out / "test_runs.jsonl", "a") as f:
        f.write(json.dumps(report) + "\n")
    print(format_test(report))
    for x in report.get("vllm") or []:
        print(f"  vLLM {x['vllm_version']}, {x['name']}, k={x['k']}: tau {x['tau']:.3f}, greedy identical "
              f"{x['greedy_identical_prompts']}/{x['num_prompts']}")
    if failures:
        raise GreedyMismatch(f"the test report cannot be trusted ({len(failures)} problems): greedy output that differs "
                             f"from the target's own beyond an fp32 near-tie (top-2 logit gap >= {NEAR_TIE:g}, the "
                             "head's token the runner-up), or a speed-up above tau: "
                             + "; ".join(map(str, failures[:3])) + f" (report: {out / 'test.json'})")
    return report


def set_failures(section: dict) -> list[str]:
    """What makes a test set's figures untrustworthy: greedy output beyond an fp32 near-tie, a speed-up above τ."""
    out = [f"{section['name']}: {m}" for m in section.get("greedy_mismatches") or [] if not m["near_tie"]]
    if section.get("speedup") and section["speedup"]["value"] > section["tau"]["value"]:
        out.append(f"{section['name']}: speed-up {section['speedup']['value']:.3f}x above tau "
                   f"{section['tau']['value']:.3f}: a timing error (a busy machine?)")
    return out


def vllm_judge(cfg: "RunConfig", variant: str, sets: list[PromptSet]) -> list[dict]:
    """The head's export served by vLLM (`validate.engine=vllm`) on the test sets, greedy, k = 1 .. max(5,
    test_k): τ and acceptance by position from vLLM's own counters, greedy identity against vLLM's target alone."""
    v = replace(cfg.validate, temperatures=[0.0], max_k=max(ACCEPTANCE_K, cfg.validate.test_k))
    judged = replace(cfg, validate=v)
    python = vllm.python_for(v, ["head"])
    out = []
    for section in vllm.decode_sets(judged, variant, sets, python):
        for e in section["decoding"]:
            out.append({"name": section["name"], "k": e["k"], "tau": e["tau"],
                        "acceptance_by_position": e["acceptance_by_position"], "num_prompts": e["num_prompts"],
                        "greedy_identical": e["greedy_identical"],
                        "greedy_identical_prompts": e["greedy_identical_prompts"],
                        "vllm_version": section["decoding_settings"].get("vllm_version")})
    return out


def choice_record(run_dir: Path) -> dict:
    """The git commit the run's code and recipes are at, whether the tree was clean (the dev choice must be
    committed before the test run that reports it) and the dev report it was chosen on (its sha256), if any."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    dev = run_dir / "validation" / "report.json"
    return {"commit": commit, "dirty": None if dirty is None else bool(dirty),
            "dev_report_sha256": sha256_file(dev) if dev.is_file() else None}


def test_set(cfg: "RunConfig", target: CausalLMRunner, drafter, s: PromptSet, stop: set[int], tree) -> dict:
    """One test set: the timed pairs, the k = 5 pass, the intervals and the greedy mismatches."""
    v = cfg.validate
    greedy = SamplingConfig()
    k = tree.steps if tree else v.test_k

    def one(d, kk, prompt, t=None):
        tokens, stats = decode_all(target, d, [prompt], kk, greedy, v.max_new_tokens, stop, 1, cfg.seed, t)
        return tokens[0], stats

    if not v.test_speed:
        bases = target_greedy(cfg, target, s, stop, lambda p: one(None, 0, p)[0])
        done = [one(drafter, k, p, tree) for p in s.prompts]
        mismatches = [mismatch(target, p, base, mine, i, "mine")
                      for i, (p, base, (mine, _)) in enumerate(zip(s.prompts, bases, done)) if mine != base]
        return untimed_set(s, [stats for _, stats in done], cfg.seed, mismatches)
    for p in s.prompts[:2]:  # warm-up: first calls allocate
        one(None, 0, p), one(drafter, k, p, tree)
    rows = []
    for i, p in enumerate(s.prompts):
        pair = [("target", None, 0, None), ("head", drafter, k, tree)]
        done = {name: one(d, kk, p, t) for name, d, kk, t in (pair if i % 2 == 0 else pair[::-1])}
        (base, bs), (mine, hs) = done["target"], done["head"]
        rows.append({"target_seconds": bs.seconds, "head_seconds": hs.seconds, "new_tokens": len(base),
                     "steps": hs.steps, "emitted": hs.emitted, "identical": mine == base, "base": base, "mine": mine})
    total = None
    for i, (p, r) in enumerate(zip(s.prompts, rows)):
        tokens, stats = one(drafter, ACCEPTANCE_K, p)
        total = stats if total is None else total.add(stats)
        r["identical_k5"] = tokens == r["base"]
        r["mine_k5"] = tokens
    mismatches = [mismatch(target, p, r["base"], r[key], i, key)
                  for i, (p, r) in enumerate(zip(s.prompts, rows))
                  for key in ("mine", "mine_k5") if r[key] != r["base"]]
    accept = total.acceptance_by_position
    speedup = ratio_interval([r["target_seconds"] for r in rows], [r["head_seconds"] for r in rows], cfg.seed)
    tau = ratio_interval([r["emitted"] for r in rows], [r["steps"] for r in rows], cfg.seed)
    return {"name": s.name, "line": s.line, "num_prompts": len(rows), "timed": True,
            "mean_prompt_tokens": sum(map(len, s.prompts)) / len(s.prompts),
            "new_tokens": sum(r["new_tokens"] for r in rows),
            "tau": tau, "speedup": speedup,
            "target_tokens_per_s": sum(r["new_tokens"] for r in rows) / sum(r["target_seconds"] for r in rows),
            "head_tokens_per_s": sum(r["new_tokens"] for r in rows) / sum(r["head_seconds"] for r in rows),
            f"acceptance_by_position_k{ACCEPTANCE_K}": accept,
            "implied_tau": [1 + sum(accept[:j]) for j in range(1, ACCEPTANCE_K + 1)],
            f"tau_k{ACCEPTANCE_K}": total.tau,
            "greedy_identical_prompts": sum(r["identical"] and r["identical_k5"] for r in rows),
            "greedy_mismatches": mismatches,
            "per_prompt": [{k_: r[k_] for k_ in ("target_seconds", "head_seconds", "new_tokens", "steps", "emitted",
                                                 "identical", "identical_k5")} for r in rows]}


TARGET_CACHE = "target-greedy"  # under the data cache ($MTP_TRAIN_DATA): the target alone's greedy outputs


def target_greedy(cfg: "RunConfig", target: CausalLMRunner, s: PromptSet, stop: set[int], decode) -> list[list[int]]:
    """The target alone's greedy output on each prompt of `s` (`decode(prompt) -> tokens`): the reference the
    untimed pass checks greedy identity against. Kept in $MTP_TRAIN_DATA/target-greedy by what shapes it (the
    prompts' token ids, the target's weight files' names, sizes and dates, dtype, device, processor, torch,
    max_new_tokens, the stop tokens), so the sizes of the data-scaling curve decode the target once."""
    weights = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                     for f in Path(cfg.target.path).glob("*.safetensors"))
    key = hashlib.sha256(json.dumps({
        "prompts": s.prompts, "target": str(Path(cfg.target.path).resolve()), "weights": weights,
        "dtype": cfg.target.dtype, "device": str(target.device), "processor": processor_name(),
        "torch": torch.__version__, "max_new_tokens": cfg.validate.max_new_tokens, "stop": sorted(stop)},
        sort_keys=True).encode()).hexdigest()
    path = data_cache_dir() / TARGET_CACHE / f"{key}.json"
    try:
        tokens = json.loads(path.read_text())["tokens"]
        if len(tokens) == len(s.prompts):
            return tokens
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: decode again
        pass
    tokens = [decode(p) for p in s.prompts]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"set": s.name, "tokens": tokens})
    except OSError as e:  # the report does not depend on the cache
        print(f"test: could not keep the target's outputs in {path.parent} ({e}); the report is not affected")
    return tokens


def untimed_set(s: PromptSet, stats: list, seed: int, mismatches: list[dict]) -> dict:
    """`validate.test_speed=false`: the head's pass at the chosen setting only: τ and acceptance by position, and
    its output checked against the target alone's (`target_greedy`)."""
    total = stats[0]
    for x in stats[1:]:
        total = total.add(x)
    return {"name": s.name, "line": s.line, "num_prompts": len(stats), "timed": False,
            "mean_prompt_tokens": sum(map(len, s.prompts)) / len(s.prompts), "new_tokens": total.new_tokens,
            "tau": ratio_interval([x.emitted for x in stats], [x.steps for x in stats], seed),
            "acceptance_by_position": total.acceptance_by_position,
            "greedy_identical_prompts": len(stats) - len({m["prompt"] for m in mismatches}),
            "greedy_mismatches": mismatches,
            "per_prompt": [{"steps": x.steps, "emitted": x.emitted, "new_tokens": x.new_tokens} for x in stats]}


def ratio_interval(num: list[float], den: list[float], seed: int, n: int = BOOTSTRAP) -> dict:
    """sum(num) / sum(den) with its 95% bootstrap interval over the prompts (resampled with replacement): the
    two-level interval of one seed."""
    return seeds_interval([num], [den], seed, n)


def seeds_interval(num: list[list[float]], den: list[list[float]], seed: int, n: int = BOOTSTRAP,
                   stream: str = "") -> dict:
    """Σnum / Σden over seeds s and prompts p (num[s][p]: the same prompts for every seed) with its 95% interval
    from a two-level bootstrap (`ratio_draws`); one seed gives the one-level interval over the prompts."""
    if not sum(map(sum, den)):
        raise ValueError("nothing to measure: every prompt stopped before its first verification step")
    return interval(sum(map(sum, num)) / sum(map(sum, den)), ratio_draws(num, den, seed, n, stream))


def ratio_draws(num: list[list[float]], den: list[list[float]], seed: int, n: int = BOOTSTRAP,
                stream: str = "") -> list[float | None]:
    """n bootstrap resamples of Σnum / Σden: each draws the seeds with replacement, then the prompts with
    replacement. The prompts are the same items under every seed, so one prompt draw serves every seed of a
    resample (drawn from `random.Random(seed)` alone: two heads judged on the same prompts get the same prompt
    draws, so the ratio of their draws is paired by prompt); the seed draws come from a stream of their own
    (`stream` names it), so one seed gives exactly the one-level draws. None where a resample never took a step."""
    prompts, seeds = random.Random(seed), random.Random(f"{seed}:seeds:{stream}")
    m, k = len(num[0]), len(num)
    if any(len(row) != m for row in num + den):
        raise ValueError(f"every seed needs the same {m} prompts: got {[len(r) for r in num]} numerators and "
                         f"{[len(r) for r in den]} denominators")
    out = []
    for _ in range(n):
        s_idx = [seeds.randrange(k) for _ in range(k)]
        p_idx = [prompts.randrange(m) for _ in range(m)]
        d = sum(den[s][i] for s in s_idx for i in p_idx)
        out.append(sum(num[s][i] for s in s_idx for i in p_idx) / d if d else None)
    return out


def interval(value: float, draws: list[float | None]) -> dict:
    """A value with the 2.5th and 97.5th percentiles of its bootstrap draws (None draws left out)."""
    stats = sorted(x for x in draws if x is not None)
    k = len(stats)
    return {"value": value, "low": stats[int(0.025 * k)], "high": stats[max(0, int(0.975 * k) - 1)]}


@torch.inference_mode()
def mismatch(target: CausalLMRunner, prompt: list[int], base: list[int], mine: list[int], index: int, which: str) -> dict:
    """Where greedy output left the target's own, and the target's top-2 logit gap there (one full forward over
    the prompt and the target's tokens before that position)."""
    pos = next((j for j, (a, b) in enumerate(zip(base, mine)) if a != b), min(len(base), len(mine)))
    ids = torch.tensor([prompt + base[:pos]], device=target.device)
    logits = target.model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    theirs = mine[pos] if pos < len(mine) else None
    runner_up = theirs is not None and theirs == int(top.indices[1])  # the head's run took the target's second choice
    return {"prompt": index, "pass": "chosen setting" if which == "mine" else f"k={ACCEPTANCE_K}", "position": pos,
            "target_token": base[pos] if pos < len(base) else None, "head_run_token": theirs, "top2_gap": gap,
            "runner_up": runner_up, "near_tie": gap < NEAR_TIE and runner_up}


def format_test(report: dict) -> str:
    s = report["settings"]
    lines = [f"test report of {report['head']['checkpoint']} ({report['head']['variant']}), setting {report['setting']} "
             f"(chosen on dev at commit {str(report['choice']['commit'])[:10]}"
             + (", tree dirty" if report["choice"]["dirty"] else "") + f"), greedy, batch 1, up to "
             f"{s['max_new_tokens']} new tokens, {s['device']} ({s['processor']})",
             f"  {'set':<16}{'prompts':>8}{'tau':>18}{'speed-up':>20}  {'implied tau k=1..5':<28}{'greedy':>8}"]
    for x in report["sets"]:
        t = x["tau"]
        if not x.get("timed", True):
            accept = " ".join(f"{a:.2f}" for a in x["acceptance_by_position"])
            lines.append(f"  {x['name']:<16}{x['num_prompts']:>8}{t['value']:>8.2f} [{t['low']:.2f}, {t['high']:.2f}]"
                         f"  untimed; acceptance by position {accept}; greedy "
                         f"{x['greedy_identical_prompts']}/{x['num_prompts']}")
            continue
        sp = x["speedup"]
        implied = " ".join(f"{v:.2f}" for v in x["implied_tau"])
        near = sum(m["near_tie"] for m in x["greedy_mismatches"] or [])
        lines.append(f"  {x['name']:<16}{x['num_prompts']:>8}{t['value']:>8.2f} [{t['low']:.2f}, {t['high']:.2f}]"
                     f"{sp['value']:>9.2f}x [{sp['low']:.2f}, {sp['high']:.2f}]  {implied:<28}"
                     f"{x['greedy_identical_prompts']:>4}/{x['num_prompts']}"
                     + (f" ({near} near-tie)" if near else ""))
    return "\n".join(lines)
