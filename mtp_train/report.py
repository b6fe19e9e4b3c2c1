"""A validation report (`run_dir/validation/report.json`) as text: the table `mtp-train validate` prints, the model
card quotes and `mtp-train export` prints. Shared by validate (which writes the report) and export (which reads its
file); plain formatting, no torch.
"""

from __future__ import annotations

from mtp_train.inference.config import tree_label


def _fmt(x, spec: str, none: str = "-") -> str:
    """x formatted, or `none` right-aligned to the spec's width."""
    if x is None:
        width = spec.split(".")[0].lstrip("<>^")
        return none.rjust(int(width)) if width.isdigit() else none
    return format(x, spec)


def format_table(report: dict) -> str:
    h = report["head"]
    lines = [f"validation of {h['checkpoint']} ({h['variant']}, trained at depth {h['depth']}, step {h['step']})"]
    if report.get("val_loss") is not None:
        terms = report["loss_terms_by_depth"]
        lines.append(f"teacher-forced on the val store ({report['val_samples']:,} samples, {terms[0]['positions']:,} "
                     f"positions at depth 1): val_loss {report['val_loss']:.4f}")
        lines.append(f"  {'depth':<6}{'acc':>8}{'accept':>8}{'feat':>9}{'ce':>9}")
        for t, acc, acc_p in zip(terms, report["accuracy_by_depth"], report["expected_acceptance_by_depth"]):
            lines.append(f"  {t['depth']:<6}{_fmt(acc, '8.3f')}{_fmt(acc_p, '8.3f')}{_fmt(t['feat'], '9.4f')}"
                         f"{_fmt(t['ce'], '9.4f')}")
    for section in [report, *(report.get("prompt_sets") or [])[1:]]:  # the first set's figures are the top level's
        lines += _format_decoding(section)
    return "\n".join(lines)


def _format_decoding(report: dict) -> list[str]:
    """The decoding table of one prompt set (its rows, trees, categories and prediction)."""
    lines = []
    dec = report.get("decoding") or []
    if dec:
        s = report["decoding_settings"]
        name = f"prompt set {report['name']!r}: " if report.get("name") else ""
        lines.append(f"speculative decoding, {name}{dec[0]['num_prompts']} held-out prompts, up to "
                     f"{s['max_new_tokens']} new tokens, batch {s['batch_size']}, {s['device']}"
                     + (f" ({s['processor']})" if s.get("processor") else ""))
        if s.get("prompts"):
            lines.append(f"  {s['prompts']}")
        if s.get("engine") == "vllm":
            lines.append(f"  decoded by vLLM {s['vllm_version']} ({s['layout']} export, method {s['method']}, "
                         f"tensor_parallel_size {s['tensor_parallel_size']}); teacher-forced figures are ours")
        lines.append(f"  {'drafter':<8}{'T':>4}{'k':>3}{'tau':>7}  {'acceptance by position':<30}{'tok/s':>8}"
                     f"{'speed-up':>10}  greedy = target")
        for b in report["target_only"]:
            spread = f"  (rounds {' '.join(f'{r:.1f}' for r in b['rounds'])}: spread {b['spread']:.0%})" \
                if len(b.get("rounds", [])) > 1 else ""
            lines.append(f"  {'none':<8}{b['temperature']:>4g}{'-':>3}{1.0:>7.2f}  {'':<30}{b['tokens_per_s']:>8.1f}"
                         f"{1.0:>9.2f}x{spread}")
        for e in dec:
            acc = " ".join(f"{a:.2f}" for a in e["acceptance_by_position"])
            lines.append(f"  {e['drafter']:<8}{e['temperature']:>4g}{e['k']:>3}{e['tau']:>7.2f}  {acc:<30}"
                         f"{e['tokens_per_s']:>8.1f}{e['speedup']:>9.2f}x{_flag(e)} {_identical(e)}")
    trees = report.get("tree_decoding") or []
    if trees:
        chain = {(e["drafter"], e["temperature"], e["k"]): e["tau"] for e in dec}
        lines.append("draft trees (SGLang's steps/topk/num_draft_tokens) beside the chain verifying as many tokens "
                     "(k = num_draft_tokens - 1):")
        lines.append(f"  {'tree':<10}{'drafter':<8}{'T':>4}{'tau':>7}{'chain':>7}  {'acceptance by depth':<30}"
                     f"{'tok/s':>8}{'speed-up':>10}  greedy = target")
        for e in trees:
            acc = " ".join(f"{a:.2f}" for a in e["acceptance_by_depth"])
            setting = tree_label(e["tree"]).removeprefix("tree ")
            c = chain.get((e["drafter"], e["temperature"], e["tree"][2] - 1))
            lines.append(f"  {setting:<10}{e['drafter']:<8}{e['temperature']:>4g}{e['tau']:>7.2f}{_fmt(c, '7.2f')}  "
                         f"{acc:<30}{e['tokens_per_s']:>8.1f}{e['speedup']:>9.2f}x{_flag(e)} {_identical(e)}")
    lines += _format_categories(dec)
    if any(e.get("speedup_above_tau") for e in dec + trees):
        lines.append("  ! speed-up above tau: not possible when a draft step costs anything; the machine's load "
                     "changed during the run, rerun on an idle machine")
    for e in dec + trees:
        if e.get("suspect"):
            what = tree_label(e["tree"]) if e.get("tree") else f"k={e['k']}"
            lines.append(f"  ? {e['drafter']} T={e['temperature']:g} {what} stays suspect: {e['suspect_reason']}")
    if report.get("prediction"):
        lines.append(format_prediction(report["prediction"]))
    return lines


def _format_categories(dec: list[dict]) -> list[str]:
    """Per category, for each drafter and temperature: tau and the first draft's acceptance at every k."""
    lines = []
    for name, t, es in series({"decoding": dec}):
        cats = list(es[0].get("by_category") or {})
        if not cats:
            continue
        lines.append(f"  by category, {label(name, t)}: tau / acceptance of the first draft")
        lines.append(f"    {'category':<12}{'prompts':>8}" + "".join(f"{'k=' + str(e['k']):>13}" for e in es))
        for c in cats:
            cells = "".join(f"{e['by_category'][c]['tau']:>8.2f} {e['by_category'][c]['acceptance_by_position'][0]:.2f}"
                            for e in es)
            lines.append(f"    {str(c):<12}{es[0]['by_category'][c]['prompts']:>8}{cells}")
    return lines


def _flag(e: dict) -> str:
    """'!' beside a speed-up above tau, '?' beside another suspect timing (the reasons are listed below)."""
    return "!" if e.get("speedup_above_tau") else "?" if e.get("suspect") else " "


def _identical(e: dict) -> str:
    """The greedy-identity cell: 'yes' when every prompt matches the target alone, else how many did."""
    if e["greedy_identical"] is None:
        return ""
    if e["greedy_identical"]:
        return "yes"
    n = e.get("greedy_identical_prompts")
    return "NO" if n is None else f"NO ({n}/{e['num_prompts']})"


def series(report: dict) -> list[tuple[str, float, list[dict]]]:
    """(drafter, temperature, its entries by k) for every curve in the report."""
    dec = report.get("decoding") or []
    keys = sorted({(e["drafter"], e["temperature"]) for e in dec}, key=lambda x: (x[0] != "head", x))
    return [(d, t, sorted((e for e in dec if (e["drafter"], e["temperature"]) == (d, t)), key=lambda e: e["k"]))
            for d, t in keys]


def label(drafter: str, t: float) -> str:
    return f"{drafter}, {'greedy' if t == 0 else f'T={t:g}'}"


def format_prediction(pred: dict) -> str:
    lines = []
    d = pred["device"]
    if d and pred["checks"]:
        lines.append(f"predicted against measured on this machine ({d['name']}: {d['bandwidth_gb_s']:.0f} GB/s, "
                     f"{d['tflops']:.2f} TFLOP/s, {d['fixed_ms']:.2f} ms + {d['per_layer_ms']:.2f} ms/layer per forward)")
        o = pred.get("overhead")
        if o:
            lines.append(f"  with the engine's per-step cost beyond the forwards, measured here ({o['steps_timed']} "
                         f"steps): target alone {o['plain_ms']:+.1f} ms, "
                         + (", ".join(f"k={k} {m:+.1f} ms" for k, m in enumerate(o["by_k"]) if k) + ", "
                            if o.get("by_k") else f"k=1 {o['step_ms']:+.1f} ms, ")
                         + f"{o['per_draft_ms']:+.1f} ms per further head step"
                         + (f"; a step takes {' / '.join(f'{m:.1f}' for m in o['measured_ms'])} ms at k = "
                            f"{' / '.join(str(k) for k in range(len(o['measured_ms'])))}" if o.get("measured_ms") else ""))
        for c in pred["checks"]:
            what = tree_label(c["tree"]) if c.get("tree") else f"k={c['k']}"
            lines.append(f"    T={c['temperature']:g} {what}: measured {c['measured']:.2f}x, predicted "
                         f"{c['predicted']:.2f}x ({c['error']:+.0%})")
    s = pred.get("serving")
    if s:
        first = s["table"][0]
        ks = sorted(first["speedup_by_k"], key=int)
        trees = list(first.get("speedup_by_tree", {}))
        lines.append(f"predicted speed-up serving on {s['profile']['name']} (bf16, {s['profile']['source']}), "
                     f"greedy τ as measured, context {pred['context']}:")
        lines.append("  " + f"{'batch':>6}{'target tok/s':>14}" + "".join(f"{'k=' + str(k):>8}" for k in ks)
                     + "".join(f"{t:>14}" for t in trees) + f"{'best':>14}")
        for r in s["table"]:
            best = r.get("best") or f"k={r['best_k']}"
            lines.append("  " + f"{r['batch']:>6}{r['target_only_tokens_per_s']:>14,.0f}"
                         + "".join(f"{r['speedup_by_k'][k]:>7.2f}x" for k in ks)
                         + "".join(f"{r['speedup_by_tree'][t]:>13.2f}x" for t in trees) + f"{best:>14}")
    return "\n".join(lines)
