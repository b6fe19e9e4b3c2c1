"""vLLM's judgement of one exported EAGLE-3 head of any trainer on prompt sets, prompt by prompt (the peers protocol,
`protocol.py`): the head served in float32 with its weights rounded through bfloat16 first (as the peers ship
theirs), greedy, a chain of k drafts; τ(k), acceptance by position and the τ(1..k) it implies, from vLLM's counters
per prompt (`vllm_run.py --per-prompt`: vLLM's per-request metrics, the prompts decoded 16 at a time); its output compared with vLLM's target alone, a prompt where they differ
checked against the near-tie rule of the test report (`mtp_train/validate/testset.py`: NEAR_TIE, `mismatch`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

# 16 requests at a time: on 2 cores (Intel Xeon) 4.3x the decoding speed of one at a time, with every output token and
# every prompt's counters the same on the 104 dev prompts of ours-recipe-s0 (225 s against 962 s; 64 at a time 214 s)
VLLM_OPTIONS = ("--max-num-seqs", "16")
VLLM_TIMEOUT = 7200  # seconds for one vLLM start (the test sets are 270 prompts)


def round_through_bf16(src: Path, dst: Path) -> Path:
    """A copy of the export `src` in `dst` whose floating-point weights are rounded to bfloat16 and stored as float32
    (what a head shipped in bfloat16 holds, served in float32); other files are copied as they are, optimizer and
    scheduler states (`*.pt`, `*.bin`) left out. Rounding is idempotent: a peer's bfloat16 weights keep their values.
    Done again only when `src`'s weights changed."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mtp_train.files import sha256_file

    src, dst = Path(src), Path(dst)
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{src}: no *.safetensors weights to serve (an export directory: config.json and "
                                "model.safetensors)")
    stamp = {"source": str(src.resolve()), "sha256": {w.name: sha256_file(w) for w in weights}}
    if (dst / "rounded.json").is_file() and json.loads((dst / "rounded.json").read_text()) == stamp:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".pt", ".bin"):
            shutil.copy(f, dst / f.name)
    for w in weights:
        with safe_open(str(w), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file({k: t.to(torch.bfloat16).to(torch.float32) if t.is_floating_point() else t
                   for k, t in tensors.items()}, str(dst / w.name), metadata=meta)
    (dst / "rounded.json").write_text(json.dumps(stamp, indent=1) + "\n")
    return dst


def target_alone(python: str, target: str, prompts: list[list[int]], folder: Path, new_tokens: int) -> list[list[int]]:
    """vLLM's greedy output of the target alone in float32, kept in `folder` under a name of its inputs (the same for
    every head judged on these prompts)."""
    from mtp_train.inference.vllm_engine import run_vllm

    key = hashlib.sha256(json.dumps([target, python, new_tokens, VLLM_OPTIONS, prompts]).encode()).hexdigest()[:16]
    out = folder / f"target-{key}.json"
    if out.is_file() and "tokens" in (done := json.loads(out.read_text())):
        return done["tokens"]
    result = run_vllm(python, target, prompts, out, new_tokens, "float32", None, VLLM_OPTIONS, VLLM_TIMEOUT)
    if "error" in result:
        raise RuntimeError(f"vLLM could not decode the target alone: {result['error']} "
                           f"(log: {out.with_suffix('.log')})")
    return result["tokens"]


def judge(export: Path, sets: list, out: Path, python: str, target: str, k: int, new_tokens: int,
          baseline: Path) -> dict:
    """The head exported in `export` (vLLM method eagle3) on the prompt sets `sets` (PromptSets, all in one vLLM
    start): {"sets": {name: figures}, "settings": ...}; vLLM's files go to `out`, the target alone's to `baseline`."""
    from mtp_train.inference.vllm_engine import run_vllm

    served = round_through_bf16(export, out / "served")
    prompts = [p for s in sets for p in s.prompts]
    alone = target_alone(python, target, prompts, baseline, new_tokens)
    result = run_vllm(python, target, prompts, out / f"head-k{k}.json", new_tokens, "float32",
                      ("eagle3", str(served.resolve()), k), (*VLLM_OPTIONS, "--per-prompt"), VLLM_TIMEOUT)
    if "error" in result:
        raise RuntimeError(f"vLLM could not serve {export}: {result['error']} (log: {out / f'head-k{k}.log'})")
    figures, start = {}, 0
    for s in sets:
        end = start + len(s.prompts)
        figures[s.name] = set_figures(result["per_prompt"][start:end], result["tokens"][start:end],
                                      alone[start:end], k)
        figures[s.name]["line"] = s.line
        start = end
    return {"sets": figures, "settings": {
        "engine": f"vLLM {result.get('vllm_version')}", "k": k, "new_tokens": new_tokens, "dtype": "float32",
        "weights": "rounded through bfloat16", "served": str(served), "options": [*VLLM_OPTIONS, "--per-prompt"]}}


def set_figures(per_prompt: list[dict], tokens: list[list[int]], alone: list[list[int]], k: int) -> dict:
    """One set's figures from vLLM's per-prompt counters: τ(k), acceptance by position, the τ(1..k) it implies,
    greedy identity, and each prompt's own counters (the bootstrap's input); prompts whose output differs from
    the target alone's are listed in `mismatched` (checked by `near_ties`)."""
    steps = sum(p["steps"] for p in per_prompt)
    accepted = [sum(p["accepted_per_position"][j] for p in per_prompt) for j in range(k)]
    rate = [a / steps if steps else 0.0 for a in accepted]
    return {"num_prompts": len(per_prompt), "tau": 1 + sum(rate), "acceptance_by_position": rate,
            "implied_tau": [1 + sum(rate[:j]) for j in range(1, k + 1)],
            "greedy_identical_prompts": sum(a == b for a, b in zip(tokens, alone)),
            "mismatched": [{"prompt": i, "head": a, "target": b} for i, (a, b) in enumerate(zip(tokens, alone))
                           if a != b],
            "per_prompt": [{"steps": p["steps"], "accepted": p["accepted_per_position"]} for p in per_prompt]}


def near_ties(figures: dict, sets: list, cfg) -> list[str]:
    """Check every prompt whose greedy output left the target alone's against the near-tie rule (the target's top-2
    logit gap there, from our runner in float32): each entry of `mismatched` gets the test report's `mismatch`
    fields; -> the problems that are no near-tie (named by set and prompt)."""
    if not any(f["mismatched"] for f in figures.values()):
        return []
    from mtp_train.inference.runner import load_runner
    from mtp_train.validate.testset import mismatch

    runner = load_runner(cfg.target.path, cfg.target)
    problems = []
    for s in sets:
        for m in figures[s.name]["mismatched"]:
            m.update(mismatch(runner, s.prompts[m["prompt"]], m["target"], m["head"], m["prompt"], "k5"))
            if not m["near_tie"]:
                problems.append(f"{s.name} prompt {m['prompt']}: position {m['position']}, top-2 gap "
                                f"{m['top2_gap']:.3g}" + ("" if m["runner_up"] else ", not the runner-up"))
    return problems
