"""Speculative decoding on the tiny target, side by side in one process: the target alone, the draft LM
and the trained head, at k = 1..K, batch 1, greedy (and optionally sampled), on held-out prompts.

    .venv/bin/python benchmarks/speculative.py [--run-dir runs/demo] [--prompts 16] [--new-tokens 64]
        [--max-k 4] [--repeats 3] [--threads 2] [--temperatures 0]

--run-dir names a trained run (its `checkpoints/latest`, `data/val` and recipe `config.yaml`); without
it a head is trained first with the library (prepare, precompute, train on a reduced tiny recipe, a few
minutes). Each repeat decodes every prompt once per configuration, the configurations in a rotated
order; tokens/s are medians over repeats (τ does not vary between repeats when greedy). Prints a table
and writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

from mtp_train.config import compose
from mtp_train.generate import load_draft, load_head, stop_tokens
from mtp_train.inference import SamplingConfig, load_runner
from mtp_train.model.target import load_tokenizer
from mtp_train.validate import decode_all, held_out_prompts

OUT = Path(__file__).resolve().parent / "results" / "speculative.json"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    if run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="speculative-bench-")
        run_dir = train_quickly(Path(tmp.name))
    cfg = compose("tiny", [f"run_dir={run_dir}", "target.device=cpu"])
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_runner(cfg.target.path, cfg.target)
    head, meta = load_head(cfg, target)
    drafters = {"none": None, "draft": load_draft(cfg, target, tokenizer), "head": head}
    prompts, source = held_out_prompts(Path(run_dir) / "data", args.prompts, 512)
    stop = stop_tokens(tokenizer, target)
    embed = target.model.get_input_embeddings().weight
    target_w = weights_per_token(target.model, skip=(embed,) if embed is not target.lm_head.weight else ())
    draft_model = drafters["draft"].runner.model
    draft_embed = draft_model.get_input_embeddings().weight
    cost = {"target_weights_per_token": target_w,
            "head_weights_per_draft": weights_per_token(head.head, target.lm_head.weight),
            "draft_lm_weights_per_draft": weights_per_token(
                draft_model, skip=(draft_embed,) if draft_embed is not draft_model.get_output_embeddings().weight
                else ())}
    cost["head_draft_over_target_forward"] = cost["head_weights_per_draft"] / target_w
    cost["draft_lm_draft_over_target_forward"] = cost["draft_lm_weights_per_draft"] / target_w
    configs = [(name, t, k) for t in args.temperatures for name in drafters
               for k in ([0] if name == "none" else range(1, args.max_k + 1))]
    decode_all(target, None, prompts[:2], 0, SamplingConfig(), 8, stop, 1, 0)  # warm-up

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
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "threads": args.threads,
                    "load_average_1min": load},
        "command": "benchmarks/speculative.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v is not None),
        "run_dir": str(run_dir) if args.run_dir else "(trained by the benchmark)",
        "head": {k: meta[k] for k in ("variant", "step", "depth") if k in meta},
        "prompts": source, "num_prompts": len(prompts), "max_new_tokens": args.new_tokens, "batch_size": 1,
        "cost_per_token": cost, "rows": rows,
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(prompts)} prompts ({source}), up to {args.new_tokens} new tokens, batch 1, "
          f"{args.threads} threads, medians of {args.repeats}")
    print(f"| drafter | T | k | τ | acceptance by position | tokens/s | speed-up | greedy = target |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        acc = " ".join(f"{a:.2f}" for a in row["acceptance_by_position"]) or "-"
        same = {True: "yes", False: "NO", None: ""}[row["greedy_identical"]]
        print(f"| {row['drafter']} | {row['temperature']:g} | {row['k'] or '-'} | {row['tau']:.2f} | {acc} | "
              f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {same} |")
    print(f"weights read per one-token forward: target {target_w / 1e6:.2f} M; a head draft "
          f"{cost['head_weights_per_draft'] / 1e6:.2f} M ({cost['head_draft_over_target_forward']:.2f} of a target "
          f"forward, lm_head included); a draft-LM draft {cost['draft_lm_weights_per_draft'] / 1e6:.2f} M "
          f"({cost['draft_lm_draft_over_target_forward']:.2f})")
    print(f"load average (1 min) before / after each repeat: {' '.join(f'{x:.2f}' for x in load)}")
    print(f"wrote {OUT}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
