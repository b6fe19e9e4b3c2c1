"""`mtp-train precompute` on the tiny target, measured side by side in one process against:

* a naive loop: `model(input_ids, output_hidden_states=True)` one sample at a time, under `no_grad`, with the
  whole causal LM (logits computed) and its default KV cache;
* the stage with one sample per batch (`store.batch_tokens=1`): what batching adds on top of running the
  decoder alone;
* a measured fp32 GEMM peak on the same machine (achieved GFLOP/s of the decoder's useful work against it);
* a plain sequential read of the shard file (the reader's GB/s against it, in data order and shuffled);

and the bytes per token and reconstruction error of each storage dtype on the tiny target's states.

    .venv/bin/python benchmarks/precompute.py [--threads 2] [--docs 24] [--chats 480] [--repeats 3]

--docs / --chats limit the tiny recipe's two training sources (documents in 256-token chunks, and
function-writing conversations). Throughputs are medians over --repeats alternating runs (the model load is
not timed). Prints tables and writes benchmarks/results/precompute.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mtp_train.config import compose
from mtp_train.data.prepare import run as prepare
from mtp_train.model.target import TargetArch
from mtp_train.store import format as fmt
from mtp_train.store.precompute import run as precompute
from mtp_train.store.reader import StoreReader

OUT = Path(__file__).resolve().parent / "results" / "precompute.json"


def decoder_flops(arch: TargetArch, lengths: list[int]) -> float:
    """Useful forward FLOPs of the decoder: 2 per multiply-add of every projection, plus causal attention
    (QKᵀ and AV over the T(T+1)/2 visible pairs); embeddings and norms are left out."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_token = 2 * arch.num_hidden_layers * (arch.hidden_size * (2 * q + 2 * kv) + 3 * arch.hidden_size
                                              * arch.intermediate_size)
    attention = sum(arch.num_hidden_layers * 2 * q * t * (t + 1) for t in lengths)
    return per_token * sum(lengths) + attention


def gemm_peak(repeats: int = 5) -> float:
    """fp32 matmul GFLOP/s, the best of a few square sizes."""
    best = 0.0
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * n**3 / statistics.median(times) / 1e9)
    return best


def naive_loop(target: Path, samples: list[list[int]]) -> float:
    """Seconds for the naive loop over `samples` (hidden_states[-1] kept, as a naive precompute would)."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    kept = []
    t0 = time.perf_counter()
    for ids in samples:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        kept.append(out.hidden_states[-1][0].clone())
    return time.perf_counter() - t0


def stage(run_dir: Path, overrides: list[str]) -> dict:
    """One precompute run into a fresh store; its train manifest."""
    shutil.rmtree(run_dir / "store", ignore_errors=True)
    return precompute(compose("tiny", [f"run_dir={run_dir}", *overrides]))["train"]


def read_rates(split_dir: Path, repeats: int) -> dict:
    """GB/s of a plain sequential read of the shard files, and of the reader in data order and shuffled
    (bytes of the stored tokens returned), all from the page cache."""
    reader = StoreReader(split_dir)
    stored = sum(s["bytes"] for s in reader.manifest["shards"])
    payload = int(reader.lengths.sum()) * reader.manifest["bytes_per_token"]

    def plain() -> float:
        buf = bytearray(1 << 24)
        t0 = time.perf_counter()
        for s in reader.manifest["shards"]:
            with open(split_dir / s["file"], "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        return stored / (time.perf_counter() - t0) / 1e9

    def through_reader(order: list[int]) -> float:
        t0 = time.perf_counter()
        for i in order:
            reader[i]
        return payload / (time.perf_counter() - t0) / 1e9

    order = list(range(len(reader)))
    shuffled = random.Random(0).sample(order, len(order))
    plain()  # warm the page cache
    return {"plain_sequential_GBps": statistics.median(plain() for _ in range(repeats)),
            "reader_in_order_GBps": statistics.median(through_reader(order) for _ in range(repeats)),
            "reader_shuffled_GBps": statistics.median(through_reader(shuffled) for _ in range(repeats)),
            "shard_bytes": stored}


def dtype_rows(split_dir: Path, tmp: Path) -> dict:
    """Each storage dtype: bytes per token on disk and the relative error of the tiny target's states."""
    reader = StoreReader(split_dir)
    samples = [{k: v for k, v in reader[i].items() if k != "layers"} for i in range(len(reader))]
    x = torch.cat([s["hidden"] for s in samples])  # [N, H] fp32 reference
    tokens = x.shape[0]
    rows = {}
    for dtype in ("float32", "bfloat16", "float8_e4m3"):
        out = tmp / f"store_{dtype}"
        m = fmt.write_split(out, samples, identity=reader.manifest, dtype=dtype)
        back = torch.cat([r["hidden"] for r in StoreReader(out)])
        per_token = (back - x).norm(dim=1) / x.norm(dim=1)
        rows[dtype] = {"bytes_per_token": m["totals"]["bytes"] / tokens,
                       "formula_bytes_per_token": fmt.bytes_per_token(dtype, reader.hidden_size),
                       "rel_error_frobenius": float((back - x).norm() / x.norm()),
                       "rel_error_per_token_mean": float(per_token.mean()),
                       "rel_error_per_token_max": float(per_token.max()),
                       "llama70b_bytes_per_token": fmt.bytes_per_token(dtype, 8192)}
        shutil.rmtree(out)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--chats", type=int, default=480)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        limits = [f"data.sources.0.limit={args.docs}", f"data.sources.1.limit={args.chats}",
                  "data.sources.2.limit=2", "data.sources.3.limit=8", "store.dtype=float32"]
        cfg = compose("tiny", [f"run_dir={run_dir}", *limits])
        prepare(cfg)
        import datasets

        train = [list(r) for r in datasets.load_from_disk(str(run_dir / "data" / "train"))["input_ids"]]
        lengths = [len(r) for r in train]
        arch = TargetArch.from_pretrained(cfg.target.path)
        flops = decoder_flops(arch, lengths)
        runs = {"precompute": [], "precompute, one sample per batch": [], "naive loop": []}
        manifest = None
        for _ in range(args.repeats):  # alternate, so drifting load on the machine hits every row alike
            manifest = stage(run_dir, limits)
            runs["precompute"].append(manifest["run"]["seconds"])
            runs["precompute, one sample per batch"].append(
                stage(run_dir, [*limits, "store.batch_tokens=1"])["run"]["seconds"])
            runs["naive loop"].append(naive_loop(Path(cfg.target.path), train))
        stage(run_dir, limits)  # leave the default store for the read and dtype measurements
        peak = gemm_peak()
        tokens = sum(lengths)
        rows = {}
        for name, seconds in runs.items():
            s = statistics.median(seconds)
            rows[name] = {"seconds": s, "seconds_all": seconds, "tokens_per_s": tokens / s,
                          "GFLOP_per_s": flops / s / 1e9, "of_gemm_peak": flops / s / 1e9 / peak}
        base = rows["naive loop"]["tokens_per_s"]
        for r in rows.values():
            r["speedup_vs_naive"] = r["tokens_per_s"] / base
        reads = read_rates(run_dir / "store" / "train", args.repeats)
        dtypes = dtype_rows(run_dir / "store" / "train", Path(tmp))
    print(f"tiny target, {len(lengths):,} train samples, {tokens:,} tokens (mean length {tokens / len(lengths):.0f}), "
          f"{platform.machine()}, {args.threads} threads, torch {torch.__version__}; padding "
          f"{manifest['run']['padding']:.1%}, batch_tokens {manifest['run']['batch_tokens']}")
    print(f"fp32 GEMM peak: {peak:.1f} GFLOP/s; decoder work: {flops / tokens / 1e6:.1f} MFLOP/token\n")
    print("| run | seconds | tokens/s | × naive | GFLOP/s | of GEMM peak |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | {r['speedup_vs_naive']:.2f}× | "
              f"{r['GFLOP_per_s']:.1f} | {r['of_gemm_peak']:.0%} |")
    print(f"\n| read | GB/s |\n|---|---|\n| plain sequential file read | {reads['plain_sequential_GBps']:.2f} |\n"
          f"| StoreReader, data order | {reads['reader_in_order_GBps']:.2f} |\n"
          f"| StoreReader, shuffled | {reads['reader_shuffled_GBps']:.2f} |")
    print("\n| dtype | bytes/token (tiny, H=256) | Llama-3.1-70B (H=8192) | rel. error (Frobenius) | "
          "per-token mean | per-token max |")
    print("|---|---|---|---|---|---|")
    for name, d in dtypes.items():
        print(f"| {name} | {d['bytes_per_token']:.1f} | {d['llama70b_bytes_per_token']:,} | "
              f"{d['rel_error_frobenius']:.2e} | {d['rel_error_per_token_mean']:.2e} | "
              f"{d['rel_error_per_token_max']:.2e} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": date.today().isoformat(), "machine": f"{platform.machine()}, "
                               f"{args.threads} threads", "torch": torch.__version__, "args": vars(args),
                               "samples": len(lengths), "tokens": tokens, "padding": manifest["run"]["padding"],
                               "gemm_peak_GFLOP_per_s": peak, "decoder_flops": flops, "rows": rows,
                               "reads": reads, "dtypes": dtypes}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
