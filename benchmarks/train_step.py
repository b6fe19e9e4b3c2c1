"""One training step of the head at a Llama-3 vocabulary: chunked loss vs a naive full-logits loss.

The step is the real one (the `mtp` head forward, the loss of `mtp_train.train.loss`, backward, AdamW) at
vocabulary 128256 and H = 1024; the two variants differ only in the distribution term: `distill_ce`
(chunks of `--chunk` positions, gradient formed in the forward) against the direct
`-(softmax(W h / T) * log_softmax(W ĥ)).sum(-1)` over all positions at once through autograd.

Each variant runs in its own process, so their peak memories do not mix. Peak memory is the process's
peak resident set during the timed steps (reset through /proc/self/clear_refs) minus the resident set
before them: the memory the step itself needs beyond weights and inputs.

    python benchmarks/train_step.py                 # table + benchmarks/results/train_step.json
    python benchmarks/train_step.py --depth 3 --align-topk 1 --tag T   # a deeper head, GRIFFIN's mask on;
                                                    # writes benchmarks/results/train_step-T.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "train_step.json"


def naive_ce(x, y, W, weight, temperature, chunk):
    log_q = torch.log_softmax((x @ W.T).float(), -1)
    with torch.no_grad():
        target = (y @ W.T).float()
        p = torch.softmax(target / temperature, -1)
    loss = -(weight * (p * log_q).sum(-1)).sum()
    with torch.no_grad():
        metrics = torch.stack([(log_q.argmax(-1) == target.argmax(-1)).float(),
                               torch.minimum(p, log_q.exp()).sum(-1)], -1)
    return loss, metrics


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def one(variant: str, args) -> dict:
    from transformers import LlamaConfig

    from mtp_train.model.head import DraftHead, unrolled
    from mtp_train.train.loss import LossConfig, head_loss

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=args.vocab, head_dim=args.hidden // 16)
    head = DraftHead(config)
    embed = torch.nn.Embedding(args.vocab, args.hidden).requires_grad_(False)
    W = (torch.randn(args.vocab, args.hidden) * 0.02)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    B, T = args.batch, args.seq
    hidden = torch.randn(B, T, args.hidden)
    ids = torch.randint(0, args.vocab, (B, T))
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    lengths = torch.full((B,), T)
    cfg = LossConfig(chunk_tokens=args.chunk, align_topk=args.align_topk)
    ce = naive_ce if variant == "naive" else None

    def step():
        outs = unrolled(head, embed, hidden, ids, lengths, args.depth)
        loss, _ = head_loss(outs, hidden, loss_mask, lengths, W, cfg, ce=ce)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step()  # warm-up: allocates the optimizer state
    before = rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    seconds = (time.perf_counter() - t0) / args.steps
    peak = rss_kb("VmHWM")
    positions = B * (T - 2)  # counted positions per step and depth (anchor i predicts x_{i+2} at depth 1)
    return {"variant": variant, "seconds_per_step": seconds, "tokens_per_s": B * T / seconds,
            "step_peak_mb": (peak - before) / 1024, "loss": loss, "positions": positions,
            "full_logits_mb": positions * args.vocab * 4 / 2**20}


def main() -> None:
    from mtp_train.validate.decoding import processor_name

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--depth", type=int, default=1, help="the head's training depth (unrolled steps)")
    ap.add_argument("--align-topk", type=int, default=0, help="train.loss.align_topk (GRIFFIN's mask; 0 is off)")
    ap.add_argument("--tag", default="", help="write results/train_step-TAG.json instead of train_step.json")
    ap.add_argument("--one", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args)))
        return
    rows = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--one", variant] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    n, c = rows["naive"], rows["chunked"]
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{processor_name()}, {os.cpu_count()} CPUs, "
        f"{args.threads} threads, torch {torch.__version__}", "command": "python benchmarks/train_step.py " +
        " ".join(sys.argv[1:]), "args": {k: v for k, v in vars(args).items() if k != "one"}, "rows": rows,
        "speedup": n["seconds_per_step"] / c["seconds_per_step"],
        "memory_ratio": c["step_peak_mb"] / n["step_peak_mb"],
    }
    print(f"train step, vocab {args.vocab}, H {args.hidden}, {args.batch} x {args.seq} tokens, chunk {args.chunk}, "
          f"depth {args.depth}, align_topk {args.align_topk}, {args.threads} threads")
    print(f"{'variant':<10}{'s/step':>10}{'tokens/s':>12}{'step peak MB':>15}{'loss':>10}")
    for r in rows.values():
        print(f"{r['variant']:<10}{r['seconds_per_step']:>10.2f}{r['tokens_per_s']:>12.0f}"
              f"{r['step_peak_mb']:>15.0f}{r['loss']:>10.4f}")
    print(f"chunked vs naive: {result['speedup']:.2f}x speed, {result['memory_ratio']:.3f}x memory "
          f"(one [positions x vocab] fp32 tensor is {n['full_logits_mb']:.0f} MB)")
    out = RESULTS.with_name(f"train_step-{args.tag}.json") if args.tag else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
