"""The output projection of decoding, `h @ W.T` for a few rows h [M, H] and a wide W [V, H], two ways on this
CPU: `F.linear(h, W)` (what `nn.Linear` does) and `(W @ h.T).T` (what `mtp_train.model.frozen.project`
does on CPUs). A verification forward projects k + 1 rows, batched regeneration 16; at SmolLM2's shape
(V 49,152, H 576: 113 MB in fp32) the first form packs W before multiplying.

    .venv/bin/python benchmarks/lm_head_rows.py [--vocab 49152] [--hidden 576] [--rows 1 2 3 4 5 8 16]
        [--threads 2] [--repeats 15]

Prints a table (median ms) and writes benchmarks/results/lm_head_rows.json.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch
from timing import command, machine, median_seconds

OUT = Path(__file__).resolve().parent / "results" / "lm_head_rows.json"


def median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    W = torch.randn(args.vocab, args.hidden)
    rows = []
    for m in args.rows:
        h = torch.randn(m, args.hidden)
        torch.testing.assert_close((W @ h.T).T, torch.nn.functional.linear(h, W), rtol=1e-4, atol=1e-3)
        linear = median_ms(lambda: torch.nn.functional.linear(h, W), args.repeats)
        streamed = median_ms(lambda: (W @ h.T).T, args.repeats)
        rows.append({"rows": m, "linear_ms": linear, "weight_major_ms": streamed, "ratio": linear / streamed})
    result = {"date": date.today().isoformat(),
              "machine": machine(args.threads), "command": command("lm_head_rows.py", args),
              "vocab": args.vocab, "hidden": args.hidden, "rows": rows}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"h [M, {args.hidden}] @ W.T, W [{args.vocab}, {args.hidden}] fp32, {args.threads} threads, "
          f"median of {args.repeats} (ms)")
    print("| rows M | F.linear(h, W) | (W @ h.T).T | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['linear_ms']:.1f} | {r['weight_major_ms']:.1f} | {r['ratio']:.2f}× |")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
