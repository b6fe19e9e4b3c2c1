"""The validation report: `run_dir/validation/report.json`, the plots beside it and the printed table
(`mtp_train/report.py` formats it; the model card quotes the same table).
"""

from __future__ import annotations

import json
from pathlib import Path

from mtp_train.inference.config import tree_label
from mtp_train.report import format_table, label, series


def draw_acceptance(ax, report: dict) -> None:
    """P(drafts 1..j all kept) against j, at the largest k of each drafter and temperature."""
    for name, t, es in series(report):
        e = es[-1]
        ax.plot(range(1, e["k"] + 1), e["acceptance_by_position"], "-" if t == 0 else "--", marker="o",
                label=f"{label(name, t)}, k={e['k']}")
    ax.set(xlabel="draft position j", ylabel="P(drafts 1..j all accepted)", ylim=(0, 1.02),
           title="Acceptance by position (real speculative decoding)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()


def draw_tau(ax_tau, ax_speed, report: dict) -> None:
    """τ and the speed-up over the target alone against k, one curve per drafter and temperature."""
    for name, t, es in series(report):
        ks, style = [e["k"] for e in es], "-" if t == 0 else "--"
        ax_tau.plot(ks, [e["tau"] for e in es], style, marker="o", label=label(name, t))
        ax_speed.plot(ks, [e["speedup"] for e in es], style, marker="o", label=label(name, t))
    for e in report.get("tree_decoding") or []:  # a tree at the chain's x that verifies as many tokens
        name = f"{label(e['drafter'], e['temperature'])}, {tree_label(e['tree'])}"
        x = e["tree"][2] - 1
        ax_tau.plot([x], [e["tau"]], linestyle="none", marker="*", markersize=10, label=name)
        ax_speed.plot([x], [e["speedup"]], linestyle="none", marker="*", markersize=10, label=name)
    for ax, what in ((ax_tau, "τ: tokens per target forward"), (ax_speed, "tokens/s ÷ target-only tokens/s")):
        ax.axhline(1.0, color="grey", lw=1, label="target only")
        ax.set(xlabel="k (drafted tokens per target forward; a tree ★ at num_draft_tokens - 1)", ylabel=what)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    ax_tau.set_title("τ against k")
    ax_speed.set_title(f"speed-up ({(report.get('decoding_settings') or {}).get('device', '')})")
    ax_tau.legend()


def plot(report: dict, out_dir: Path) -> list[Path]:
    """acceptance_by_position.png and tau_vs_k.png (τ and speed-up against k, head vs draft LM)."""
    from matplotlib.figure import Figure  # no pyplot: a library leaves the global backend alone; matplotlib is heavy

    if not report.get("decoding"):
        return []
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    draw_acceptance(fig.add_subplot(), report)
    paths = [out_dir / "acceptance_by_position.png"]
    fig.savefig(paths[-1], dpi=120)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    draw_tau(*fig.subplots(1, 2), report)
    paths.append(out_dir / "tau_vs_k.png")
    fig.savefig(paths[-1], dpi=120)
    return paths


def write_report(report: dict, out_dir: Path, plots: bool = True) -> Path:
    """`out_dir/report.json` (written whole or not at all), the plots beside it, and the table printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    written = plot(report, out_dir) if plots else []
    print(format_table(report))
    print(f"wrote {path}" + "".join(f", {p.name}" for p in written) + f" ({report['seconds']:.0f} s)")
    return path
