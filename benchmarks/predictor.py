"""How far the serving-speed predictor (`mtp_train/inference/predict.py`) is from what was measured, three ways:

1. `gpu`: one forward of the Llama-3.1-8B-shaped target and of its one-layer cut on the H200, over the grid
   `benchmarks/gpu_forward_time.py` measured (b x c x n, results/gpu_forward_time.json), against the model on the
   `H200-eager` profile (datasheet bandwidth and GEMM rate times the fractions the probes reached; the eager
   runner's fixed and per-layer costs);
2. `cpu_forward` (with `--cpu-config`): the same grid measured here and now through our runner on the CPU, against
   the model on the `cpu` profile measured by its probes just before (`predict.measure_cpu`);
3. `speedups`: every check row of the given `mtp-train validate` reports (`report.json`: each measured chain and
   tree of the head, with the speed-up the model predicted on the profile validation measured when it ran):
   measured against predicted, and the largest error per report. Goal (issue 15): within +-20 % for every k on
   the real target.

    python benchmarks/predictor.py --reports runs/tiny-v/validation/report.json runs/smol-a/validation/report.json \
        --cpu-config tests/fixtures/configs/tiny-llama

Run it on an idle machine: the cpu profile and the forward grid are timings. Prints the tables and writes
benchmarks/results/predictor.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results" / "predictor.json"


def _cost_of_rows(cost, profile, rows, bytes_per_param: float) -> list[dict]:
    from mtp_train.inference.predict import forward_ms

    out = []
    for r in rows:
        p = forward_ms(cost, profile, r["batch"], r["new"], r["context"], bytes_per_param)
        out.append({**r, "predicted_ms": round(p, 3), "error": p / r["ms"] - 1})
    return out


def _one_layer_cost(config):
    """The one-layer cut `gpu_forward_time.py` times: embedding, one decoder layer, norm, the full lm_head."""
    from mtp_train.inference.predict import target_cost

    cut = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 1})
    return target_cost(cut)


def _print_forward(title: str, rows: list[dict]) -> None:
    print(title)
    print(f"  {'model':<10}{'b':>4}{'c':>6}{'n':>4}{'measured ms':>13}{'predicted':>11}{'error':>8}")
    for r in rows:
        print(f"  {r['model']:<10}{r['batch']:>4}{r['context']:>6}{r['new']:>4}{r['ms']:>13.2f}"
              f"{r['predicted_ms']:>11.2f}{r['error']:>+8.0%}")


def _summary(rows: list[dict], key=lambda r: r["batch"]) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r["error"])
    return {str(g): {"min": min(e), "max": max(e), "max_abs": max(map(abs, e))} for g, e in groups.items()}


def gpu_section(path: Path) -> dict | None:
    from transformers import AutoConfig

    from mtp_train.inference.predict import PROFILES, target_cost

    if not path.exists():
        print(f"gpu: {path} not found (benchmarks/gpu_forward_time.py on a GPU writes it); skipped")
        return None
    data = json.loads(path.read_text())
    config = AutoConfig.from_pretrained(ROOT / data["config"])
    profile = PROFILES["H200-eager"]
    rows = [{"model": "target", **r} for r in _cost_of_rows(target_cost(config), profile, data["target"]["rows"], 2)]
    rows += [{"model": "one layer", **r}
             for r in _cost_of_rows(_one_layer_cost(config), profile, data["one_layer"]["rows"], 2)]
    _print_forward(f"gpu: {data['device']}, {data['config']} in {data['dtype']}, our eager runner, against the "
                   f"H200-eager profile", rows)
    summary = _summary(rows, key=lambda r: f"{r['model']} b={r['batch']} c={r['context']}")
    for g, s in summary.items():
        print(f"  {g:<28} error {s['min']:+.0%} .. {s['max']:+.0%}")
    return {"source": str(path.relative_to(ROOT)), "device": data["device"], "profile": profile.name,
            "rows": rows, "summary": summary}


def cpu_forward_section(config_dir: Path, batches, contexts, news) -> dict:
    from dataclasses import asdict

    from transformers import AutoConfig

    from gpu_forward_time import build, grid
    from mtp_train.inference.predict import measure_cpu, target_cost

    profile = measure_cpu(torch.float32)
    print(f"cpu profile (measured now): {profile.bandwidth_gb_s:.1f} GB/s, {profile.tflops:.3f} TFLOP/s, "
          f"{profile.fixed_ms:.2f} ms + {profile.per_layer_ms:.3f} ms/layer per forward")
    config = AutoConfig.from_pretrained(config_dir)
    out_rows = []
    for model_name, layers, cost in (("target", config.num_hidden_layers, target_cost(config)),
                                     ("one layer", 1, _one_layer_cost(config))):
        model = build(config, layers, torch.device("cpu"), torch.float32)
        rows = grid(model, batches, contexts, news, torch.device("cpu"), lambda: None, 2, 7)
        out_rows += [{"model": model_name, **r} for r in _cost_of_rows(cost, profile, rows, 4)]
        del model
    _print_forward(f"cpu_forward: {config_dir.name} in fp32, our runner, against the cpu profile", out_rows)
    return {"config": str(config_dir), "profile": asdict(profile), "rows": out_rows,
            "summary": _summary(out_rows, key=lambda r: r["model"])}


def speedup_section(paths: list[Path]) -> list[dict]:
    from mtp_train.inference.config import tree_label

    out = []
    for path in paths:
        if not path.exists():
            print(f"speedups: {path} not found (run `mtp-train validate` for it); skipped")
            continue
        report = json.loads(path.read_text())
        pred = report.get("prediction") or {}
        checks = pred.get("checks") or []
        if not checks:
            print(f"speedups: {path} has no prediction checks (validate.predict=false, or no head rows); skipped")
            continue
        d = pred["device"]
        print(f"speedups: {path} ({report['head']['variant']} head; profile {d['name']}: {d['bandwidth_gb_s']:.1f} "
              f"GB/s, {d['tflops']:.3f} TFLOP/s, {d['fixed_ms']:.2f} + {d['per_layer_ms']:.3f} ms/layer; context "
              f"{pred['context']})")
        print(f"  {'setting':<14}{'T':>4}{'tau':>7}{'measured':>10}{'predicted':>11}{'error':>8}")
        rows = []
        for c in checks:
            setting = tree_label(c["tree"]) if c.get("tree") else f"k={c['k']}"
            rows.append({"setting": setting, **c})
            print(f"  {setting:<14}{c['temperature']:>4g}{c['tau']:>7.2f}{c['measured']:>9.2f}x{c['predicted']:>10.2f}x"
                  f"{c['error']:>+8.0%}")
        chains = [r for r in rows if not r.get("tree")]
        worst = max(rows, key=lambda r: abs(r["error"]))
        worst_chain = max(chains, key=lambda r: abs(r["error"])) if chains else None
        within = all(abs(r["error"]) <= 0.2 for r in chains)
        print(f"  largest error {worst['error']:+.0%} ({worst['setting']}, T={worst['temperature']:g}); every chain "
              f"within +-20 %: {'yes' if within else 'NO'}")
        spread = [b.get("spread") for b in report.get("target_only", []) if b.get("spread") is not None]
        out.append({"report": str(path), "variant": report["head"]["variant"], "profile": d, "context": pred["context"],
                    "rows": rows, "largest_error": worst["error"],
                    "largest_chain_error": worst_chain["error"] if worst_chain else None,
                    "chains_within_20pct": within, "target_only_spread": spread})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", nargs="*", type=Path, default=[], help="validate report.json files")
    ap.add_argument("--gpu-json", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_forward_time.json")
    ap.add_argument("--cpu-config", type=Path, help="a config dir: time its forward here against the cpu profile")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--news", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    result = {"machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
              "command": "python benchmarks/predictor.py " + " ".join(sys.argv[1:]),
              "gpu": gpu_section(args.gpu_json)}
    if args.cpu_config:
        result["cpu_forward"] = cpu_forward_section(args.cpu_config, args.batches, args.contexts, args.news)
    result["speedups"] = speedup_section(args.reports)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
