"""How long one forward of a target takes on a GPU, over n new tokens per sequence at batch b and context c: the
ground truth the speed predictor (issue 15) is checked against.

A Llama-3.1-8B-shaped model (tests/fixtures/configs/llama3.1-8b, random bf16 weights: a forward costs the same
with any weights, so none are needed) runs our decoding runner (`CausalLMRunner`: transformers' eager forward, SDPA attention,
our SlotCache), as validation does: for each batch b the cache is filled to c tokens once (logits of the last position only), then
a forward over n new tokens per sequence (logits for all n, as a verification computes them) is timed and the
cache rolled back to c. Beside it the same config cut to one decoder layer (embedding, one layer, final norm,
full lm_head) stands in for one draft-head step. Two probes give the device profile the predictor assumes: a
bf16 GEMM (8192^3) and a device-to-device copy (HBM bandwidth, read + write counted).

    python benchmarks/gpu_forward_time.py                        # cuda:0, b 1 4 16 64, c 512 2048, n 1 2 4 8 16
    python benchmarks/gpu_forward_time.py --device cpu --config tests/fixtures/configs/tiny-llama --batches 1 2

Eager transformers at batch 1 is bound by kernel launches (a serving engine's CUDA graphs remove most of that);
the fixed cost per forward is part of what is measured here, and it is reported as the b = 1, n = 1 time of the
one-layer model. Writes benchmarks/results/gpu_forward_time.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_forward_time.json"


def timed(fn, sync, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() over iters runs after warmup runs."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def probes(device: torch.device, sync) -> dict:
    """Achieved bf16 GEMM FLOP/s and copy bandwidth on this device."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = timed(lambda: a @ b, sync, 3, 10)
    gemm = 2 * n ** 3 / (ms / 1e3)
    del a, b
    nbytes = (4 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), sync, 3, 10)
    bw = 2 * nbytes / (ms / 1e3)
    del src, dst
    return {"gemm_bf16_tflops" if device.type == "cuda" else "gemm_fp32_tflops": round(gemm / 1e12, 1),
            "copy_gb_per_s": round(bw / 1e9, 1)}


def build(config, layers: int, device, dtype):
    from transformers import AutoModelForCausalLM

    cfg = type(config).from_dict({**config.to_dict(), "num_hidden_layers": layers})
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


@torch.inference_mode()
def grid(model, batches, contexts, news, device, sync, warmup, iters) -> list[dict]:
    """Our decoding runner's forward (`CausalLMRunner`: SlotCache, explicit mask, decode attention backends)."""
    from mtp_train.inference.runner import CausalLMRunner

    runner = CausalLMRunner(model)
    V = model.config.vocab_size
    gen = torch.Generator(device=device.type).manual_seed(0)
    rows = []
    for b in batches:
        cmax = max(contexts)
        cache = runner.new_cache(b)
        prompt = torch.randint(0, V, (b, cmax), device=device, generator=gen)
        runner.forward(cache, prompt, torch.ones_like(prompt, dtype=torch.bool), logits_last=1)
        for c in sorted(contexts, reverse=True):
            keep = torch.full((b,), c, device=device)
            cache.keep(keep)
            for n in news:
                ids = torch.randint(0, V, (b, n), device=device, generator=gen)
                valid = torch.ones_like(ids, dtype=torch.bool)

                def fwd():
                    runner.forward(cache, ids, valid)
                    cache.keep(keep)

                ms = timed(fwd, sync, warmup, iters)
                rows.append({"batch": b, "context": c, "new": n, "ms": round(ms, 3)})
                print(f"  b {b:>3}  c {c:>5}  n {n:>3}  {ms:8.2f} ms", flush=True)
        del cache, prompt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "tests" / "fixtures" / "configs" / "llama3.1-8b"))
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--new", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_forward_time.py needs a CUDA GPU (or --device cpu for a smoke test)")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.config)
    torch.manual_seed(0)
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "config": str(Path(args.config).resolve().relative_to(ROOT)) if Path(args.config).resolve().is_relative_to(ROOT)
           else args.config, "dtype": str(dtype).removeprefix("torch."), "attention": "sdpa", "iters": args.iters}
    out["probes"] = probes(device, sync)
    print("probes:", out["probes"], flush=True)
    for name, layers in (("target", config.num_hidden_layers), ("one_layer", 1)):
        t0 = time.perf_counter()
        model = build(config, layers, device, dtype)
        params = sum(q.numel() for q in model.parameters())
        print(f"{name}: {layers} layers, {params / 1e9:.2f} B parameters, built in {time.perf_counter() - t0:.1f} s",
              flush=True)
        out[name] = {"layers": layers, "params": params,
                     "rows": grid(model, args.batches, args.contexts, args.new, device, sync, args.warmup, args.iters)}
        del model
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n{'b':>4} {'c':>6} {'n':>4} {'target ms':>10} {'1-layer ms':>11} {'ratio':>7}")
    one = {(r["batch"], r["context"], r["new"]): r["ms"] for r in out["one_layer"]["rows"]}
    for r in out["target"]["rows"]:
        o = one[(r["batch"], r["context"], r["new"])]
        print(f"{r['batch']:>4} {r['context']:>6} {r['new']:>4} {r['ms']:>10.2f} {o:>11.2f} {o / r['ms']:>7.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
