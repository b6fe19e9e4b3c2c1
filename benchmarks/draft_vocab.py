"""Acceptance lost against draft-step cost saved, by draft vocabulary size, for one trained head.

    .venv/bin/python benchmarks/draft_vocab.py --recipe smollm2-135m --run-dir runs/smollm2-135m
        [--sizes 2048 4096 8192 16384 0] [--prompts 12] [--new-tokens 64] [--max-k 3] [--threads 2]

The head of `run_dir/checkpoints/latest` drafts, in turn, over the N most frequent trained tokens of the
run's train store (`train/vocab.py`'s rule) for each N in --sizes (0 = the full vocabulary): its weights
are the same for every N (it was trained with one N; ĥ estimates the target's next hidden state, so any
subset of the lm_head's rows can read it), only the rows its draft logits use change. That isolates what
the issue asks: what a smaller draft vocabulary costs in acceptance and saves in step time. For each N:
teacher-forced top-1 agreement / expected acceptance and the share of positions whose target argmax is
inside (`in_vocab`) on the val store at depth 1; greedy speculative decoding of the held-out prompts at
k = 1..K (τ, acceptance by position, tokens/s against the target alone, interleaved: the target-only run
is repeated before each N, and the speed-ups use the mean of the runs around it); and the measured cost c
of one head draft step against one target step. Prints a table, writes benchmarks/results/draft_vocab.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import step_costs  # noqa: E402
from timing import command, machine  # noqa: E402

from mtp_train.config import compose  # noqa: E402
from mtp_train.inference.load import load_head_module, stop_tokens  # noqa: E402
from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.drafters import HeadDrafter
from mtp_train.inference.runner import load_runner  # noqa: E402
from mtp_train.model.frozen import FrozenTarget  # noqa: E402
from mtp_train.model.head import DRAFT_VOCAB_BUFFERS, DraftHead  # noqa: E402
from mtp_train.model.target import load_tokenizer  # noqa: E402
from mtp_train.store.reader import StoreReader  # noqa: E402
from mtp_train.train.vocab import most_frequent, trained_token_counts  # noqa: E402
from mtp_train.data.held_out import held_out_prompts
from mtp_train.validate.decoding import decode_all
from mtp_train.validate.teacher_forced import teacher_forced  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "draft_vocab.json"


def with_vocab(trained: DraftHead, target_config, n: int, counts: torch.Tensor) -> DraftHead:
    """The trained head's weights, drafting over the n most frequent trained tokens (0: all)."""
    head = DraftHead(target_config, replace(trained.cfg, draft_vocab=n))
    state = {k: v for k, v in trained.state_dict().items() if k not in DRAFT_VOCAB_BUFFERS}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(DRAFT_VOCAB_BUFFERS):
        raise RuntimeError(f"head weights do not fit: missing {missing}, unexpected {unexpected}")
    if n:
        head.set_draft_vocab(most_frequent(counts, n))
    return head.to(next(trained.parameters())).eval().requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = compose(args.recipe, [f"run_dir={args.run_dir}", "target.device=cpu"])
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_runner(cfg.target.path, cfg.target)
    trained, meta = load_head_module(cfg, target.device, target.dtype)
    target_config = AutoConfig.from_pretrained(cfg.target.path)
    V = target.vocab_size
    counts = trained_token_counts(StoreReader(Path(args.run_dir) / "store" / "train"), V)
    frozen = FrozenTarget.from_pretrained(cfg.target.path)
    prompts, source = held_out_prompts(Path(args.run_dir) / "data", args.prompts, 512)
    stop = stop_tokens(tokenizer, target)
    embed = target.model.get_input_embeddings()
    decode = lambda drafter, k: decode_all(target, drafter, prompts, k, SamplingConfig(), args.new_tokens,  # noqa
                                           stop, 1, cfg.seed)
    decode(None, 0)  # warm-up
    reference, first = decode(None, 0)
    baselines = [first.tokens_per_s]
    rows = []
    for n in args.sizes:
        head = with_vocab(trained, target_config, n, counts)
        tf = teacher_forced(replace(cfg, validate=replace(cfg.validate, val_samples=0)), head, frozen,
                            torch.device("cpu"), 1)
        drafter = HeadDrafter(head, embed, target.lm_head)
        cost = step_costs(target, drafter, prompts[0])
        for k in range(1, args.max_k + 1):
            tokens, s = decode(drafter, k)
            rows.append({"draft_vocab": n or V, "coverage_of_trained_positions": float(
                counts[most_frequent(counts, n)].sum() / counts.sum()) if n else 1.0,
                "k": k, "tau": s.tau, "acceptance_by_position": s.acceptance_by_position,
                "tokens_per_s": s.tokens_per_s, "greedy_identical": tokens == reference,
                "teacher_forced_d1_acc": tf["accuracy_by_depth"][0],
                "teacher_forced_d1_accept": tf["expected_acceptance_by_depth"][0],
                "c_measured": cost["c_measured"], "head_step_ms": cost["head_step_s"] * 1e3,
                "target_step_ms": cost["target_step_s"] * 1e3})
        _, again = decode(None, 0)
        baselines.append(again.tokens_per_s)
        for r in rows[-args.max_k:]:
            r["target_only_tokens_per_s"] = (baselines[-2] + baselines[-1]) / 2
            r["speedup"] = r["tokens_per_s"] / r["target_only_tokens_per_s"]
    result = {"date": date.today().isoformat(),
              "machine": machine(args.threads), "command": command("draft_vocab.py", args),
              "head": {k: meta[k] for k in ("variant", "step", "depth")} | {
                  "trained_draft_vocab": meta["head"].get("draft_vocab", 0)},
              "prompts": source, "target_only_tokens_per_s_runs": baselines, "rows": rows}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(prompts)} prompts ({source}), up to {args.new_tokens} new tokens, greedy, batch 1, "
          f"{args.threads} threads; head trained with draft_vocab {result['head']['trained_draft_vocab']}; "
          f"target alone {' / '.join(f'{b:.1f}' for b in baselines)} tokens/s")
    print("| draft vocab | coverage | d1 acc | d1 accept | c | k | τ | acceptance by position | tokens/s | speed-up |"
          " greedy = target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        print(f"| {r['draft_vocab']:,} | {r['coverage_of_trained_positions']:.4f} | {r['teacher_forced_d1_acc']:.3f} | "
              f"{r['teacher_forced_d1_accept']:.3f} | {r['c_measured']:.3f} | {r['k']} | {r['tau']:.2f} | {acc} | "
              f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {'yes' if r['greedy_identical'] else 'NO'} |")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
