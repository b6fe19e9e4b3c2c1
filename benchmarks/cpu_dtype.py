"""Why CPU runs use fp32: the tiny target's prefill, training-step and decode speed in fp32 against bf16,
side by side in one process.

    .venv/bin/python benchmarks/cpu_dtype.py [--threads 2] [--repeats 5]

Prints a table and writes benchmarks/results/cpu_dtype.json. Medians over --repeats runs, after one
warm-up run each.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mtp_train.config import ASSETS_DIR
from timing import median_seconds

OUT = Path(__file__).resolve().parent / "results" / "cpu_dtype.json"


def measure(dtype: torch.dtype, repeats: int, batch: int, seq: int, new_tokens: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(ASSETS_DIR / "tiny" / "target", dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (batch, seq), generator=g)
    def prefill_step():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    prefill = median_seconds(prefill_step, repeats)
    prompt = ids[:1, :32]

    def train_step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    train = median_seconds(train_step, repeats)
    model.zero_grad(set_to_none=True)
    decode = median_seconds(lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens), repeats)
    return {"prefill_tok_s": batch * seq / prefill, "train_step_tok_s": batch * seq / train,
            "decode_tok_s": new_tokens / decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {name: measure(dt, args.repeats, args.batch, args.seq, args.new_tokens)
            for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    ratio = {k: rows["float32"][k] / rows["bfloat16"][k] for k in ("prefill_tok_s", "train_step_tok_s", "decode_tok_s")}
    print(f"tiny target on {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}")
    print(f"| dtype | prefill tok/s ({args.batch}x{args.seq}) | forward+backward tok/s ({args.batch}x{args.seq}) "
          "| greedy decode tok/s (batch 1) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['prefill_tok_s']:,.0f} | {r['train_step_tok_s']:,.0f} | {r['decode_tok_s']:,.1f} |")
    print(f"| fp32 / bf16 | {ratio['prefill_tok_s']:.1f}x | {ratio['train_step_tok_s']:.1f}x | "
          f"{ratio['decode_tok_s']:.1f}x |")
    result = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "args": vars(args), "rows": rows, "fp32_over_bf16": ratio}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
