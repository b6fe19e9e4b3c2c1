"""What speculators' default optimizer costs on this CPU: torch.optim.Muon (speculators 0.9.0's default,
speculators/train/optimizers.py) orthogonalises each update by Newton-Schulz iterations in bfloat16, which a CPU
without native bf16 matrix units (no AMX: the AMD EPYC machines) runs far slower than fp32. Times one optimizer step
on the 2-D weights Muon takes in the one-layer EAGLE-3 draft of SmolLM2-135M (hidden 576, 9 query and 3 KV heads of
64, MLP 1,536, 3 aux layers; the attention reads the token and feature halves, 2 x 576): Muon as torch ships it;
the same Muon with its bf16 iterations' products computed by fp32 GEMMs and rounded to bf16 (`newton_schulz`, the
run-time adjustment run_speculators.py --muon-fp32-gemms makes on a CPU without AMX); the same 5 iterations in fp32
throughout (the textbook quintic, written here); and AdamW: interleaved rounds, median and range. It also gives how
far apart their updates are: torch's bf16 iterations against the adjusted ones, and against fp32 ones.

    .venv/bin/python benchmarks/peers/muon_cpu.py [--rounds 5]

Writes benchmarks/results/peers-muon_cpu-<processor kind>.json and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

H, HEADS, KV, HEAD_DIM, MLP, AUX = 576, 9, 3, 64, 1536, 3
SHAPES = {"fc": (H, AUX * H), "q_proj": (HEADS * HEAD_DIM, 2 * H), "k_proj": (KV * HEAD_DIM, 2 * H),
          "v_proj": (KV * HEAD_DIM, 2 * H), "o_proj": (H, HEADS * HEAD_DIM), "gate_proj": (MLP, H),
          "up_proj": (MLP, H), "down_proj": (H, MLP)}
# the attribute run_speculators.py --muon-fp32-gemms replaces by `newton_schulz` (its record's adjustment's name)
MUON_ADJUSTMENT = "torch.optim._muon:_zeropower_via_newtonschulz"
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's coefficients (Jordan et al., "Muon", 2024)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=NS_COEFFICIENTS,
                  between: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthogonalised update of one 2-D gradient by `steps` quintic Newton-Schulz iterations, every matrix
    product computed by fp32 GEMMs. `between`: the dtype each value is rounded to between products. float32, the
    iterations in fp32; bfloat16, the values torch.optim.Muon's bf16 iterations hold (torch/optim/_muon.py): the
    gradient normalised in bf16, then per iteration three products, s = x x^T, u = b s + c s s, x = a x + u x,
    each rounded to bf16 once, as a CPU with bf16 matrix units accumulates in fp32 and rounds each result."""
    a, b, c = coefficients
    x = g.to(between)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        f = x.float()
        s = (f @ f.T).to(between).float()
        u = torch.addmm(s, s, s, beta=b, alpha=c).to(between).float()
        x = torch.addmm(f, u, f, beta=a).to(between)
    return x.T if tall else x


def params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES.values():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        out.append(p)
    return out


@contextlib.contextmanager
def fp32_gemms():
    """torch.optim.Muon with its Newton-Schulz iterations replaced by `newton_schulz(..., between=bfloat16)`."""
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = lambda g, coefficients, steps, eps: newton_schulz(
        g, steps, eps, coefficients, between=torch.bfloat16)
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def time_step(name: str, ps: list[torch.nn.Parameter], opt) -> float:
    t0 = time.perf_counter()
    if name == "muon_ns_fp32":
        with torch.no_grad():
            for p in ps:
                p.add_(newton_schulz(p.grad), alpha=-1e-3)
    elif name == "muon_bf16_fp32_gemms":
        with fp32_gemms():
            opt.step()
    else:
        opt.step()
    return time.perf_counter() - t0


def agreement(ps: list[torch.nn.Parameter]) -> dict:
    """Per weight, the relative distance (Frobenius) between the orthogonalised updates of its gradient: torch's
    bf16 iterations against the same with fp32 GEMMs, and against fp32 iterations."""
    from torch.optim._muon import DEFAULT_NS_STEPS, _zeropower_via_newtonschulz

    out = {}
    for name, p in zip(SHAPES, ps):
        torch_bf16 = _zeropower_via_newtonschulz(p.grad, NS_COEFFICIENTS, DEFAULT_NS_STEPS, 1e-7).float()
        gemms = newton_schulz(p.grad, DEFAULT_NS_STEPS, between=torch.bfloat16).float()
        fp32 = newton_schulz(p.grad, DEFAULT_NS_STEPS)
        out[name] = {"bf16_fp32_gemms": float((gemms - torch_bf16).norm() / torch_bf16.norm()),
                     "ns_fp32": float((fp32 - torch_bf16).norm() / torch_bf16.norm())}
    return out


def main(argv: list[str] | None = None) -> int:
    for path in (ROOT, HERE, HERE.parent):  # here, not at import: run_speculators.py imports this in the peer's venv
        sys.path.insert(0, str(path))
    from mtp_train.data.regen_engines import cpu_flags, has_amx, read_cpuinfo
    from mtp_train.validate.decoding import processor_name
    from protocol import processor_kind
    from timing import machine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ps = params(0)
    opts = {"muon_torch_bf16": torch.optim.Muon(ps, lr=1e-3), "muon_bf16_fp32_gemms": torch.optim.Muon(ps, lr=1e-3),
            "muon_ns_fp32": None,
            "adamw": torch.optim.AdamW(ps, lr=1e-3)}
    for name, opt in opts.items():  # warm-up: the optimizers' state, the kernels
        time_step(name, ps, opt)
    times = {name: [] for name in opts}
    for _ in range(args.rounds):
        for name, opt in opts.items():
            times[name].append(time_step(name, ps, opt))
    med = {n: statistics.median(t) for n, t in times.items()}
    cpuinfo = read_cpuinfo()
    flags = cpu_flags(cpuinfo)
    rec = {"processor": processor_name(), "amx": has_amx(cpuinfo), "machine": machine(args.threads),
           "bf16_flags": sorted(f for f in flags if "bf16" in f or f.startswith("amx")),
           "torch": torch.__version__, "shapes": SHAPES, "rounds": args.rounds,
           "seconds": {n: {"median": med[n], "min": min(t), "max": max(t)} for n, t in times.items()},
           "bf16_over_fp32": med["muon_torch_bf16"] / med["muon_ns_fp32"],
           "bf16_over_fp32_gemms": med["muon_torch_bf16"] / med["muon_bf16_fp32_gemms"],
           "update_distance_from_torch_bf16": agreement(ps),
           "date": time.strftime("%Y-%m-%d %H:%M")}
    out = ROOT / "benchmarks" / "results" / f"peers-muon_cpu-{processor_kind(rec['processor'])}.json"
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"one optimizer step on the draft's 2-D weights ({sum(a * b for a, b in SHAPES.values()):,} values), "
          f"{rec['processor']} (AMX: {rec['amx']}), {args.threads} threads, {args.rounds} interleaved rounds")
    print(f"{'optimizer':<36}{'median s':>10}{'range':>20}")
    for n, s in rec["seconds"].items():
        spread = f"[{s['min']:.3f}, {s['max']:.3f}]"
        print(f"{n:<36}{s['median']:>10.3f}{spread:>20}")
    print(f"Muon's bf16 Newton-Schulz over the same with fp32 GEMMs: {rec['bf16_over_fp32_gemms']:.1f}x, over "
          f"fp32 iterations: {rec['bf16_over_fp32']:.1f}x")
    print(f"{'weight':<12}{'update distance from torch bf16: fp32 GEMMs':>46}{'fp32 iterations':>18}")
    for n, d in rec["update_distance_from_torch_bf16"].items():
        print(f"{n:<12}{d['bf16_fp32_gemms']:>46.4f}{d['ns_fp32']:>18.4f}")
    print(f"({out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
