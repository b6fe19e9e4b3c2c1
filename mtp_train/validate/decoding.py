"""Validation's second half: real speculative decoding (`mtp_train.inference`) on held-out prompt sets, for
k = 1..K, greedy and sampled, with the head and with the draft LM when `target.draft_path` is set: τ (tokens per
target forward), acceptance by position, tokens/s against the target alone at the same settings, and whether greedy
output is token for token the target's own greedy output; and the draft trees of `validate.trees` (SGLang's
steps / topk / num_draft_tokens) beside the chain that verifies as many tokens per target forward.

Speeds are measured in rounds: the target alone is timed before the first drafter and again after each
(drafter, temperature) block, and each row's speed-up divides by the mean of the target-only rounds on either
side of its block, so a load change on the machine shows as a spread, not as a speed-up. A speed-up above τ
cannot be real (a draft step costs something) and is flagged. A row outside 0.5..1.5x of its prediction (the
speed model plus this engine's per-step overhead, timed before decoding), above τ, or between rounds that
spread more than 15% is timed again (`validate.retimes`), and flagged `suspect` when it stays so.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtp_train.data import prompt_sets
from mtp_train.data.held_out import held_out_prompts
from mtp_train.data.prompt_sets import PromptSet
from mtp_train.inference import predict
from mtp_train.inference.config import SamplingConfig, TreeConfig, tree_label
from mtp_train.inference.drafters import Drafter
from mtp_train.inference.runner import CausalLMRunner
from mtp_train.inference.speculative import generate
from mtp_train.validate.config import ValidateConfig

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def load_prompts(spec: str, data_dir: Path, tokenizer, n: int, max_tokens: int, role: str = "dev") -> PromptSet:
    """One `validate.prompts` (role dev) or `validate.test_prompts` (role test) entry, rendered for the target."""
    if spec == "recipe":
        prompts, line = held_out_prompts(data_dir, n, max_tokens)
        return PromptSet(spec, role, prompts, None, line, [""] * len(prompts), [line] * len(prompts))
    return prompt_sets.load_set(spec, role, tokenizer, n, max_tokens)


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


def speeds(e: dict, tokens_per_s: float, before: float, after: float) -> None:
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


def decoding_settings(v: ValidateConfig, dtype: str, source: str, prompts: list[list[int]]) -> dict:
    """What a prompt set was decoded with (the target in `dtype`), whichever engine decodes it."""
    return {"prompts": source, "num_prompts": len(prompts), "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "max_new_tokens": v.max_new_tokens, "batch_size": v.batch_size, "temperatures": list(v.temperatures),
            "dtype": dtype, "machine": platform.machine(), "processor": processor_name()}


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
                speeds(e, e["tokens_per_s"], before, after)
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
                    speeds(e, s.tokens_per_s, b, target_alone(t))
                    e["retimed"] += 1
                e["suspect"] = reason is not None
                if reason:
                    e["suspect_reason"] = reason + (f" (timed {e['retimed'] + 1} times)" if e["retimed"] else "")
    out = [target_only_summary(b["temperature"], b["rounds"], b["new_tokens"]) for b in baselines.values()]
    return entries, tree_entries, out


def processor_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), which `platform.processor()` often leaves empty."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class SpeedModel:
    """The speed model (`inference/predict.py`) on this machine's profile (the `cpu` one measured now; on a
    GPU, its datasheet with our eager runner's overheads) plus this engine's per-step overhead, timed now on
    `probe` (one batch of prompts): each head row's predicted speed-up, and the report's prediction section."""

    def __init__(self, cfg: "RunConfig", target: CausalLMRunner, head: Drafter, probe: list[list[int]]):
        self.cfg, self.target = cfg, target
        self.profile = predict.runner_profile(target.device, target.dtype)
        self.costs = predict.target_cost(target.model.config), predict.head_cost(target.model.config, cfg.head)
        v = cfg.validate  # every k validate decodes is timed, and every tree's verification size
        widest = max([v.max_k, *(tree.num_draft_tokens - 1 for tree in v.trees)])
        self.overhead = (predict.measure_overhead(target, head, probe, *self.costs, self.profile, target.dtype.itemsize,
                                                  max_k=widest) if self.profile is not None else None)

    def row(self, e: dict, context: float) -> float | None:
        if e["drafter"] != "head":
            return None
        return predict.predict_speedup(*self.costs, self.profile, self.cfg.validate.batch_size, e["k"], e["tau"], int(context),
                               self.target.dtype.itemsize, tuple(e["tree"]) if e.get("tree") else None,
                               self.overhead)["speedup"]

    def report(self, entries: list[dict], context: float) -> dict:
        v = self.cfg.validate
        return predict.validation_prediction(self.target.model.config, self.cfg.head, entries, context, self.profile,
                                             self.target.dtype.itemsize, v.batch_size, v.serving_profile,
                                             self.overhead)
