"""Speculative decoding side by side in one process: the target alone, the draft LM (when the recipe has
one) and the trained head, at k = 1..K, batch 1, greedy (and optionally sampled), on held-out prompts.

    .venv/bin/python benchmarks/speculative.py [--recipe tiny] [--run-dir runs/demo] [--prompts 16]
        [--new-tokens 64] [--max-k 4] [--repeats 3] [--threads 2] [--temperatures 0] [--out NAME]

--recipe is the run's recipe (`tiny`, `smollm2-135m`, a YAML path); --run-dir names a trained run of it
(its `checkpoints/latest`, `data/val`); without --run-dir (tiny only) a head is trained first with the
library (prepare, precompute, train on a reduced tiny recipe, a few minutes). Each repeat decodes every
prompt once per configuration, the configurations in a rotated order; tokens/s are medians over repeats
(τ does not vary between repeats when greedy). Besides the weight-count estimate of a draft's cost, the
cost c of one head draft step against one target decoding step is measured directly (median of timed
single steps at the prompts' length). Prints a table and writes benchmarks/results/<out>.json
(default speculative.json for tiny, speculative-<recipe>.json otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

from mtp_train.config import compose
from timing import command, machine, median_seconds
from mtp_train.inference.load import load_draft, load_head, stop_tokens
from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.runner import load_runner
from mtp_train.model.target import load_tokenizer
from mtp_train.data.held_out import held_out_prompts
from mtp_train.validate.decoding import decode_all

RESULTS = Path(__file__).resolve().parent / "results"


def train_quickly(root: Path) -> Path:
    """A head on a reduced tiny recipe: 600 conversations and 48 documents, 150 steps."""
    from mtp_train.data.prepare import run as prepare
    from mtp_train.store.precompute import run as precompute
    from mtp_train.train.trainer import run as train

    cfg = compose("tiny", [f"run_dir={root}", "data.sources.0.limit=48", "data.sources.1.limit=600",
                           "target.device=cpu"])
    for stage in (prepare, precompute, train):
        stage(cfg)
    return root


def weights_per_token(module: torch.nn.Module, *extra: torch.Tensor, skip: tuple = ()) -> int:
    """Parameters a one-token forward multiplies by (embedding lookups excluded): at batch 1 a decoding
    step reads every one of them, so their ratio is the cost of a draft against a target forward."""
    skipped = {id(t) for t in skip}
    own = sum(p.numel() for p in module.parameters() if id(p) not in skipped)
    return own + sum(t.numel() for t in extra)


@torch.inference_mode()
def step_costs(target, head_drafter, prompt: list[int], repeats: int = 30) -> dict:
    """Median seconds of one target decoding step (one token on a cache holding `prompt`), of one verification
    forward over 2 and 4 tokens, and of one head draft step (one chain step: the head's layer and its draft
    logits), each on a cache that is rolled back after it."""
    from mtp_train.inference.config import SamplingConfig
    from mtp_train.inference.drafters import Features
    from mtp_train.inference.runner import left_pad

    ids, valid = left_pad([prompt])
    cache = target.new_cache(1)
    _, hidden = target.forward(cache, ids, valid, logits_last=1)
    n = cache.lengths.clone()

    def timed(fn) -> float:
        return median_seconds(fn, repeats)

    def verify(t: int):
        def run():
            target.forward(cache, torch.full((1, t), int(prompt[-1])), torch.ones(1, t, dtype=torch.bool))
            cache.keep(n)
        return run

    head_drafter.start(1)
    head_drafter.propose([list(prompt) + [int(prompt[-1])]], Features(hidden, valid), 1, SamplingConfig())
    committed = head_drafter.committed.clone()

    def head_step():  # what each further draft of a chain costs: k = 2 proposes 2, the catch-up included once
        head_drafter.cache.keep(committed)
        head_drafter.committed = committed.clone()
        hidden_last = hidden[:, -1:]
        h = head_drafter._step(torch.tensor([[int(prompt[-1])]]), hidden_last, torch.ones(1, 1, dtype=torch.bool))
        head_drafter._draw(h[:, -1], SamplingConfig(), None)

    out = {"target_step_s": timed(verify(1)), "verify_2_s": timed(verify(2)), "verify_4_s": timed(verify(4)),
           "head_step_s": timed(head_step), "context_tokens": len(prompt)}
    out["c_measured"] = out["head_step_s"] / out["target_step_s"]
    return out


def profile_step(target, drafter, prompts: list[list[int]], k: int, new_tokens: int, stop) -> dict:
    """Where one greedy speculative step's time goes, at batch 1: the drafter's propose (catch-up + chain),
    the target's verification forward (its projections through `project`: every linear layer and the
    lm_head on k + 1 rows; the rest of its decoder: attention, norms, rotary, cache writes), the cache
    roll-back and the rest (verification, bookkeeping in Python). Seconds per step, over `prompts`."""
    import time

    from mtp_train.inference.speculative import SpeculativeDecoder
    from mtp_train.inference import runner as runner_module
    from mtp_train.inference.cache import SlotCache

    spent: dict[str, float] = {"propose": 0.0, "target_forward": 0.0, "projections": 0.0, "cache_keep": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    originals = (type(drafter).propose, type(target).forward, runner_module.project, SlotCache.keep)
    type(drafter).propose = timed("propose", originals[0])
    type(target).forward = timed("target_forward", originals[1])
    runner_module.project = timed("projections", originals[2])
    SlotCache.keep = timed("cache_keep", originals[3])
    steps, total, sums = 0, 0.0, dict.fromkeys(spent, 0.0)
    try:
        for prompt in prompts:
            dec = SpeculativeDecoder(target, [prompt], drafter=drafter, k=k, max_new_tokens=new_tokens,
                                     stop_tokens=stop)
            for key in spent:
                spent[key] = 0.0
            t0 = time.perf_counter()
            while not dec.done:
                dec.step()
                steps += 1
            total += time.perf_counter() - t0
            for key in spent:
                sums[key] += spent[key]
    finally:
        type(drafter).propose, type(target).forward, runner_module.project, SlotCache.keep = originals
    out = {"k": k, "steps": steps, "step_s": total / steps,
           "propose_s": sums["propose"] / steps,
           "verify_other_s": (sums["target_forward"] - sums["projections"]) / steps,
           "verify_projections_s": sums["projections"] / steps,
           "cache_keep_s": sums["cache_keep"] / steps}  # the drafter's own keeps (in propose) count there too
    out["other_s"] = out["step_s"] - out["propose_s"] - sums["target_forward"] / steps - out["cache_keep_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--out", default=None, help="result name under benchmarks/results (without .json)")
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tmp = None
    run_dir = args.run_dir
    if run_dir is None and args.recipe != "tiny":
        ap.error("--run-dir is needed for a recipe other than tiny (train it first: mtp-train pipeline recipe=...)")
    if run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="speculative-bench-")
        run_dir = train_quickly(Path(tmp.name))
    cfg = compose(args.recipe, [f"run_dir={run_dir}", "target.device=cpu"])
    out_path = RESULTS / f"{args.out or ('speculative' if args.recipe == 'tiny' else 'speculative-' + Path(args.recipe).stem)}.json"
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_runner(cfg.target.path, cfg.target)
    head, meta = load_head(cfg, target)
    drafters = {"none": None, "head": head}
    if cfg.target.draft_path:
        drafters["draft"] = load_draft(cfg, target, tokenizer)
    prompts, source = held_out_prompts(Path(run_dir) / "data", args.prompts, 512)
    stop = stop_tokens(tokenizer, target)
    embed = target.model.get_input_embeddings().weight
    target_w = weights_per_token(target.model, skip=(embed,) if embed is not target.lm_head.weight else ())
    draft_rows = head.head.draft_lm_head(target.lm_head.weight).weight  # the lm_head rows a draft multiplies by
    cost = {"target_weights_per_token": target_w,
            "head_weights_per_draft": weights_per_token(head.head, draft_rows, skip=tuple(head.head.buffers()))}
    cost["head_draft_over_target_forward"] = cost["head_weights_per_draft"] / target_w
    if "draft" in drafters:
        draft_model = drafters["draft"].runner.model
        draft_embed = draft_model.get_input_embeddings().weight
        cost["draft_lm_weights_per_draft"] = weights_per_token(
            draft_model, skip=(draft_embed,) if draft_embed is not draft_model.get_output_embeddings().weight else ())
        cost["draft_lm_draft_over_target_forward"] = cost["draft_lm_weights_per_draft"] / target_w
    configs = [(name, t, k) for t in args.temperatures for name in drafters
               for k in ([0] if name == "none" else range(1, args.max_k + 1))]
    decode_all(target, None, prompts[:2], 0, SamplingConfig(), 8, stop, 1, 0)  # warm-up
    cost.update(step_costs(target, head, prompts[0]))
    profile = profile_step(target, head, prompts[:4], args.max_k, args.new_tokens, stop)

    rates = {c: [] for c in configs}
    stats = {}
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        shift = r * len(configs) // args.repeats
        for c in configs[shift:] + configs[:shift]:  # rotated: drift in machine load spreads over all rows
            name, t, k = c
            tokens, s = decode_all(target, drafters[name], prompts, k, SamplingConfig(temperature=t),
                                   args.new_tokens, stop, 1, cfg.seed)
            rates[c].append(s.tokens_per_s)
            stats[c] = (tokens, s)
        load.append(os.getloadavg()[0])

    rows = []
    for c in configs:
        name, t, k = c
        tokens, s = stats[c]
        base = statistics.median(rates[("none", t, 0)])
        reference = stats[("none", t, 0)][0]
        rows.append({"drafter": name, "temperature": t, "k": k, "tau": 1.0 if name == "none" else s.tau,
                     "acceptance_by_position": s.acceptance_by_position,
                     "tokens_per_s": statistics.median(rates[c]), "tokens_per_s_runs": rates[c],
                     "speedup": statistics.median(rates[c]) / base, "new_tokens": s.new_tokens,
                     "greedy_identical": tokens == reference if t == 0 else None})
    result = {
        "date": date.today().isoformat(),
        "machine": machine(args.threads, load),
        "command": command("speculative.py", args),
        "run_dir": str(run_dir) if args.run_dir else "(trained by the benchmark)",
        "recipe": args.recipe,
        "head": {k: meta[k] for k in ("variant", "step", "depth") if k in meta} | {
            "draft_vocab": meta.get("head", {}).get("draft_vocab", 0)},
        "prompts": source, "num_prompts": len(prompts), "max_new_tokens": args.new_tokens, "batch_size": 1,
        "cost_per_token": cost, "step_profile": profile, "rows": rows,
    }
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(prompts)} prompts ({source}), up to {args.new_tokens} new tokens, batch 1, "
          f"{args.threads} threads, medians of {args.repeats}")
    print("| drafter | T | k | τ | acceptance by position | tokens/s | speed-up | greedy = target |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        acc = " ".join(f"{a:.2f}" for a in row["acceptance_by_position"]) or "-"
        same = {True: "yes", False: "NO", None: ""}[row["greedy_identical"]]
        print(f"| {row['drafter']} | {row['temperature']:g} | {row['k'] or '-'} | {row['tau']:.2f} | {acc} | "
              f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {same} |")
    draft_lm = (f"; a draft-LM draft {cost['draft_lm_weights_per_draft'] / 1e6:.2f} M "
                f"({cost['draft_lm_draft_over_target_forward']:.2f})" if "draft" in drafters else "")
    print(f"weights read per one-token forward: target {target_w / 1e6:.2f} M; a head draft "
          f"{cost['head_weights_per_draft'] / 1e6:.2f} M ({cost['head_draft_over_target_forward']:.2f} of a target "
          f"forward, its draft lm_head rows included){draft_lm}")
    print(f"measured at {cost['context_tokens']} tokens of context: target step {cost['target_step_s'] * 1e3:.1f} ms, "
          f"verify 2 / 4 tokens {cost['verify_2_s'] * 1e3:.1f} / {cost['verify_4_s'] * 1e3:.1f} ms, head draft step "
          f"{cost['head_step_s'] * 1e3:.1f} ms: c = {cost['c_measured']:.3f}")
    print(f"one greedy step at k={profile['k']} ({profile['steps']} steps on 4 prompts): "
          f"{profile['step_s'] * 1e3:.1f} ms = propose {profile['propose_s'] * 1e3:.1f} + target projections "
          f"{profile['verify_projections_s'] * 1e3:.1f} + the rest of its forward {profile['verify_other_s'] * 1e3:.1f}"
          f" + cache roll-back "
          f"{profile['cache_keep_s'] * 1e3:.1f} + the rest {profile['other_s'] * 1e3:.1f}")
    print(f"load average (1 min) before / after each repeat: {' '.join(f'{x:.2f}' for x in load)}")
    print(f"wrote {out_path}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
