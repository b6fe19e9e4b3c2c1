"""`mtp-train validate ... validate.engine=vllm`: the decoding half of validation run by vLLM, for targets our
engine cannot hold on one device (a 70B target on 80 GB cards): vLLM serves the head's own export with
`tensor_parallel_size = validate.tensor_parallel_size`, and the report has the same schema as our engine's.

For each prompt set: the head is exported (the layout vLLM reads for it: `vllm-mtp` through our plugin for `mtp`
heads on Llama / Qwen targets, `deepseek-eagle` for them on DeepSeek targets, `eagle-vllm` for `eagle1`,
`eagle3` for `eagle3`) under
`run_dir/validation/export`; vLLM decodes the prompts with the target alone, then at each k = 1..max_k with the
head, then the target alone again (the rounds either side of the speeds), every temperature in the same vLLM
start (`inference/vllm_run.py --temperatures`), `validate.batch_size` requests at a time (`max_num_seqs`). From vLLM's
spec-decode counters: τ = 1 + accepted drafts / verification steps, acceptance by position; greedy identity
against vLLM's own target-only output; tokens/s and the speed-up over the target-only rounds. Sampled rows use
`draft_sample_method: probabilistic` (drafts sampled from the head, kept with min(1, p/q), as our engine does).

Not from vLLM: draft trees, the draft-LM baseline, per-category figures (vLLM's counters are per engine, not
per request) and the speed predictor (it models our engine); rows are flagged as our engine's are (a speed-up
above τ, target-only rounds spreading more than 15%) but not timed again (that would be another vLLM start).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mtp_train.export.formats import export_head
from mtp_train.inference.speculative import DecodeStats
from mtp_train.inference.vllm_engine import METHODS, VLLM_PYTHON_ENV, find_vllm_python, run_vllm
from mtp_train.validate.config import ValidateConfig
from mtp_train.validate.decoding import decoding_row, decoding_settings, outlier, speeds, target_only_summary

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

REPO = Path(__file__).resolve().parents[2]
# head variant -> (export format, the directory it writes that vLLM serves)
LAYOUTS = {"mtp": ("vllm-mtp", "vllm-mtp"), "eagle1": ("eagle", "eagle-vllm"), "eagle3": ("eagle3", "eagle3")}


class VllmFailed(OSError):
    """vLLM (another process) did not decode: its error and where its log is."""


def vllm_python(configured: str) -> str:
    """The Python of the venv with vLLM: validate.vllm_python, else $MTP_TRAIN_VLLM_PYTHON, else the
    repository's .venv-vllm (`make test-serving` builds it); an error naming all three when none exists."""
    if configured:
        if not Path(configured).is_file():
            raise FileNotFoundError(f"validate.vllm_python={configured}: no such file (the Python of a venv with "
                                    "vLLM and, for mtp heads, our plugin: pip install --no-deps ./serving/vllm_plugin)")
        return configured
    found = find_vllm_python()
    if found:
        return found
    raise FileNotFoundError(f"validate.engine=vllm needs vLLM's Python: set validate.vllm_python=/path/to/venv/bin/"
                            f"python or ${VLLM_PYTHON_ENV}, or build {REPO / '.venv-vllm'} (make test-serving)")


def layout_for(variant: str, model_type: str) -> tuple[str, str]:
    """(export format, export directory) vLLM serves this head from."""
    if variant == "mtp" and model_type == "deepseek_v2":
        return "deepseek-nextn", "deepseek-eagle"
    return LAYOUTS[variant]


def export_for_vllm(cfg: "RunConfig", variant: str, model_type: str) -> tuple[Path, str]:
    """The head exported under run_dir/validation/export in the layout vLLM reads -> (its directory, vLLM's
    method for it). Written again only when the head, target or exporter changed."""
    fmt, name = layout_for(variant, model_type)
    root = Path(cfg.run_dir) / "validation" / "export"
    export_head(replace(cfg, export=replace(cfg.export, format=fmt, overwrite=True, checkpoint=None)), root)
    return root / name, METHODS[name]


def _options(v: ValidateConfig, seed: int, temperatures: list[float], sampled: bool) -> tuple[str, ...]:
    return ("--temperatures", *map(str, temperatures), "--seed", str(seed), "--max-num-seqs",
            str(v.batch_size), "--tensor-parallel-size", str(v.tensor_parallel_size),
            *(("--draft-sample-method", "probabilistic") if sampled else ()), *v.vllm_args)


def _checked(result: dict, what: str, out: Path) -> dict:
    if "error" in result:
        raise VllmFailed(f"validate.engine=vllm: vLLM could not decode {what}: {result['error']} (log: "
                         f"{out.with_suffix('.log')})")
    return result


def decode_set(cfg: "RunConfig", name: str, prompts: list[list[int]], export_dir: Path, method: str,
               python: str, say=print) -> tuple[list[dict], list[dict], dict]:
    """One prompt set through vLLM -> (chain entries per k and temperature, target-only baselines, settings)."""
    v = cfg.validate
    temps = list(v.temperatures)
    work = Path(cfg.run_dir) / "validation" / "vllm" / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    dtype = cfg.target.dtype

    def run(out: Path, spec: tuple | None = None) -> dict:
        try:
            result = run_vllm(python, cfg.target.path, prompts, out, v.max_new_tokens, dtype, spec,
                              _options(v, cfg.seed, temps, spec is not None and any(t > 0 for t in temps)))
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # no result at all: it died or hung
            raise VllmFailed(f"validate.engine=vllm: {e}") from None
        return _checked(result, out.stem, out)

    say(f"validate: vLLM, target only ({len(prompts)} prompts, T = {', '.join(f'{t:g}' for t in temps)})")
    first = run(work / "target-before.json")
    specs = {}
    for k in range(1, v.max_k + 1):
        say(f"validate: vLLM, {export_dir.name} ({method}), k={k}")
        specs[k] = run(work / f"head-k{k}.json", (method, str(export_dir.resolve()), k))
    last = run(work / "target-after.json")
    before = {r["temperature"]: r for r in first["runs"]}
    after = {r["temperature"]: r for r in last["runs"]}
    tps = lambda r: sum(map(len, r["tokens"])) / r["seconds"]  # noqa: E731
    entries = []
    for k, result in specs.items():
        for r in result["runs"]:
            t, steps, accepted = r["temperature"], r["steps"], r["accepted_per_position"]
            # vLLM's counters as our stats: every step drafted k tokens and the target verified them
            s = DecodeStats(k, steps, [steps] * k, accepted, steps + sum(accepted), sum(map(len, r["tokens"])),
                            r["seconds"], steps * k)
            e = {**decoding_row("head", k, t, s, r["tokens"], before[t]["tokens"]), "engine": "vllm"}
            speeds(e, tps(r), tps(before[t]), tps(after[t]))
            e["predicted_speedup"], e["retimed"], e["earlier_timings"] = None, 0, []
            reason = outlier(e, None)
            e["suspect"] = reason is not None
            if reason:
                e["suspect_reason"] = reason + " (not timed again: each timing is a vLLM start)"
            entries.append(e)
            say(f"validate: vLLM head T={t:g} k={k}: tau {e['tau']:.2f}, {e['tokens_per_s']:.1f} tokens/s")
    baselines = [target_only_summary(t, [tps(before[t]), tps(after[t])], sum(map(len, before[t]["tokens"])))
                 for t in temps]
    settings = {"engine": "vllm", "vllm_version": first.get("vllm_version"), "vllm_python": python,
                "tensor_parallel_size": v.tensor_parallel_size, "layout": export_dir.name, "method": method,
                "draft_sample_method": "probabilistic" if any(t > 0 for t in temps) else None,
                "device": f"vLLM ({first.get('device', '?')})", "work_dir": str(work)}
    return entries, baselines, settings


def python_for(v: ValidateConfig, drafters: list[str]) -> str:
    """vLLM's Python, found before any weights are loaded; what vLLM does not decode is said."""
    python = vllm_python(v.vllm_python)
    skipped = [what for what, on in (("draft trees (validate.trees)", v.trees), ("the draft LM", "draft" in drafters))
               if on]
    if skipped:
        print(f"validate: engine=vllm decodes the head's chains only; not decoded: {', '.join(skipped)}")
    return python


def decode_sets(cfg: "RunConfig", variant: str, sets: list, python: str) -> list[dict]:
    """The head's export served by vLLM on every prompt set: one report section each."""
    target_config = json.loads((Path(cfg.target.path) / "config.json").read_text())
    export_dir, method = export_for_vllm(cfg, variant, target_config.get("model_type"))
    sections = []
    for ps in sets:
        spec, set_prompts, source = ps.name, ps.prompts, ps.line
        print(f"validate: prompt set {spec}: {source}")
        entries, baselines, engine = decode_set(cfg, spec, set_prompts, export_dir, method, python)
        settings = {**decoding_settings(cfg.validate, cfg.target.dtype, source, set_prompts), **engine}
        sections.append({"name": spec, "decoding": entries, "tree_decoding": [], "target_only": baselines,
                         "decoding_settings": settings})
    return sections
