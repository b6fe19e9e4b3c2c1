"""An exported head in vLLM beside our engine: the run's held-out prompts decoded greedily by both at the same
k; per-position acceptance from each, side by side, and whether vLLM's output is the target's own.

    python -m mtp_train.export.engine_check --vllm-python .venv-vllm/bin/python recipe=tiny run_dir=runs/demo \\
        [--layout eagle-vllm] [--k 3] [--prompts 8] [--new-tokens 48] [key=value ...]

vLLM runs in its own venv (`make test-serving` builds `.venv-vllm`), through `inference/vllm_run.py`, which imports
nothing of ours. Both sides run the same greedy math, so their acceptance by position should agree within
±0.03 (what `make test-serving` asserts); a larger gap is a bug in one of them. The figures are written to
`<export dir>/engine_check.json` and quoted in the export's model card (README.md), and the command exits 1
when vLLM's output differs from its own target-only output or the gap is larger than that.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from mtp_train.config import compose
from mtp_train.data.held_out import held_out_prompts
from mtp_train.export.write import CARD, ENGINE_CHECK, EXPORT_JSON
from mtp_train.files import write_atomic, write_json
from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.drafters import HeadDrafter
from mtp_train.inference.load import stop_tokens
from mtp_train.inference.runner import load_runner
from mtp_train.inference.speculative import generate
from mtp_train.inference.vllm_engine import METHODS, run_vllm
from mtp_train.model.checkpoint import read_head
from mtp_train.model.target import load_tokenizer

TOLERANCE = 0.03
BEGIN, END = "<!-- engine-check -->", "<!-- /engine-check -->"


def exported_head(cfg, export_dir: Path, target):
    """The drafter of the weights `export_dir` holds: the checkpoint its export.json names, rounded to the
    export's dtype (as the export's own read-back check does), computing in the target's dtype."""
    made = json.loads((export_dir / EXPORT_JSON).read_text())
    head, _ = read_head(cfg, Path(made["checkpoint"]))
    dtype = getattr(torch, made["dtype"])
    with torch.no_grad():
        for t in [*head.parameters(), *head.buffers()]:
            if t.is_floating_point():
                t.copy_(t.to(dtype).to(t.dtype))
    head = head.to(device=target.device, dtype=target.dtype)
    return HeadDrafter(head, target.model.get_input_embeddings(), target.lm_head)


def ours(cfg, prompts: list[list[int]], k: int, new_tokens: int, export_dir: Path,
         temperature: float = 0.0) -> dict:
    """Greedy decoding of `prompts` with our engine: the target alone (one batch), then with the head
    `export_dir` holds at `k`, one prompt at a time (vLLM's counters are compared per verification step).
    With `temperature` > 0, also the head's sampled run at it (seeded per prompt): `sampled`."""
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_runner(cfg.target.path, cfg.target)
    stop = stop_tokens(tokenizer, target)
    alone = generate(target, prompts, max_new_tokens=new_tokens, stop_tokens=stop)
    drafter = exported_head(cfg, export_dir, target)

    def speculative(sampling=None) -> tuple[list, int, list[int]]:
        tokens, steps, accepted = [], 0, [0] * k
        for i, p in enumerate(prompts):
            rng = torch.Generator(target.device).manual_seed(i) if sampling else None
            out = generate(target, [p], drafter=drafter, k=k, max_new_tokens=new_tokens, stop_tokens=stop,
                           sampling=sampling, generator=rng)
            tokens += out.tokens
            steps += out.stats.steps
            accepted = [a + b for a, b in zip(accepted, out.stats.accepted)]
        return tokens, steps, accepted

    tokens, steps, accepted = speculative()
    result = {"target_only_tokens": alone.tokens, "tokens": tokens, "steps": steps,
              "accepted_per_position": accepted, "stop_tokens": sorted(stop),
              "dtype": str(target.dtype).removeprefix("torch.")}
    if temperature > 0:
        _, steps, accepted = speculative(SamplingConfig(temperature=temperature))
        result["sampled"] = {"temperature": temperature, "steps": steps, "accepted_per_position": accepted}
    return result


def cut(tokens: list[int], stop: list[int]) -> list[int]:
    """vLLM's output through its first stop token, as ours ends."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


def compare(ours: dict, target_only: dict, spec: dict, k: int) -> dict:
    """The side-by-side figures: greedy identity of vLLM's speculative output with its target-only output and
    of vLLM's target-only output with ours, acceptance by position from each engine, and the largest gap."""
    theirs_rate = [a / spec["steps"] for a in spec["accepted_per_position"]] if spec["steps"] else [0.0] * k
    ours_rate = [a / ours["steps"] for a in ours["accepted_per_position"]] if ours["steps"] else [0.0] * k
    n = len(ours["tokens"])
    return {"prompts": n, "k": k,
            "vllm_greedy_identical": sum(a == b for a, b in zip(spec["tokens"], target_only["tokens"])),
            "vllm_target_equals_ours": sum(a == cut(b, ours["stop_tokens"])
                                           for a, b in zip(ours["target_only_tokens"], target_only["tokens"])),
            "vllm_steps": spec["steps"], "vllm_accepted_per_position": spec["accepted_per_position"],
            "ours_steps": ours["steps"], "ours_accepted_per_position": ours["accepted_per_position"],
            "vllm_acceptance": theirs_rate, "ours_acceptance": ours_rate,
            "max_gap": max((abs(a - b) for a, b in zip(theirs_rate, ours_rate)), default=0.0),
            "vllm_seconds": spec.get("seconds"), "vllm_target_seconds": target_only.get("seconds")}


def card_section(result: dict) -> str:
    r = result
    rows = "\n".join(f"| {i + 1} | {o:.3f} | {v:.3f} |" for i, (o, v) in
                     enumerate(zip(r["ours_acceptance"], r["vllm_acceptance"])))
    return f"""{BEGIN}
## In vLLM, beside our validation

{r['prompts']} held-out prompts ({r['prompt_source']}), greedy, k = {r['k']}, {r['new_tokens']} new tokens each;
vLLM {r.get('vllm_version', '?')} (`{r['method']}`) served this directory (`python -m mtp_train.export.engine_check`,
{r['date']}). vLLM's output with the head was its own target-only output on {r['vllm_greedy_identical']}/{r['prompts']}
prompts; its target-only output was ours on {r['vllm_target_equals_ours']}/{r['prompts']}.

| draft position | accepted, our engine ({r['ours_steps']} steps) | accepted, vLLM ({r['vllm_steps']} steps) |
|---|---|---|
{rows}

Largest gap {r['max_gap']:.3f} (the engines run the same greedy math; a gap above {TOLERANCE} would be a bug).
{END}
"""


def export_identity(out: Path) -> str | None:
    path = out / EXPORT_JSON
    return json.loads(path.read_text()).get("identity") if path.is_file() else None


def card_addendum(out: Path) -> str:
    """The card's engine-check section when `out/engine_check.json` was made from the weights `out` holds now
    (the export's identity), else nothing: a new export drops the figures of the old one."""
    path = out / ENGINE_CHECK
    if not path.is_file():
        return ""
    result = json.loads(path.read_text())
    return "\n" + card_section(result) if result.get("identity") == export_identity(out) else ""


def write(out: Path, result: dict) -> None:
    """`engine_check.json` in the export directory, and its section in the model card (replacing an older
    one); nothing else in the directory changes."""
    write_json(out / ENGINE_CHECK, {**result, "identity": export_identity(out)})
    card = out / CARD
    text = card.read_text() if card.is_file() else ""
    text = re.sub("\n*" + re.escape(BEGIN) + ".*?" + re.escape(END) + "\n?", "\n", text, flags=re.S)
    write_atomic(card, text.rstrip("\n") + "\n" + card_addendum(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp_train.export.engine_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the Python of a venv with vLLM (e.g. .venv-vllm/bin/python)")
    ap.add_argument("--layout", help=f"the export directory to serve: {', '.join(METHODS)} (default: the one exported)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("overrides", nargs="*", help="recipe=NAME run_dir=DIR [key=value ...], as for mtp-train")
    args = ap.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python {args.vllm_python}: no such file (make test-serving builds .venv-vllm)")
    recipe = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("recipe=")), None)
    if recipe is None:
        ap.error("recipe=NAME is required (the run's recipe, as for mtp-train)")
    cfg = compose(recipe, [o for o in args.overrides if not o.startswith("recipe=")])
    export = Path(cfg.run_dir) / "export"
    present = [name for name in METHODS if (export / name / "config.json").is_file()]
    layout = args.layout or (present[0] if present else None)
    if layout not in METHODS:
        ap.error(f"--layout {layout}: vLLM serves {', '.join(METHODS)}" if layout else
                 f"no export vLLM serves in {export} ({', '.join(METHODS)}): run mtp-train export first")
    out = export / layout
    if not (out / "config.json").is_file():
        ap.error(f"{out} has no export: run mtp-train export (format for {layout})")
    if not (out / EXPORT_JSON).is_file():
        ap.error(f"{out} has no {EXPORT_JSON}: it was not written by mtp-train export")
    prompts, source = held_out_prompts(Path(cfg.run_dir) / "data", args.prompts, 512)
    if not prompts:
        ap.error(f"no held-out prompts in {source}: the val split has no conversation or document to decode")
    print(f"engine check: {len(prompts)} prompts ({source}); our engine, k={args.k}", flush=True)
    mine = ours(cfg, prompts, args.k, args.new_tokens, out)
    work = Path(cfg.run_dir) / "engine_check"
    runs = [("target alone", work / "vllm-target.json", None),
            (f"{layout} ({METHODS[layout]}), k={args.k}", work / f"vllm-{layout}.json",
             (METHODS[layout], str(out.resolve()), args.k))]
    results = []
    for name, path, spec in runs:
        print(f"engine check: vLLM, {name}", flush=True)
        try:
            r = run_vllm(args.vllm_python, cfg.target.path, prompts, path, args.new_tokens, mine["dtype"], spec)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"engine check: {e}", file=sys.stderr)
            return 1
        if "error" in r:
            print(f"engine check: vLLM could not run {name}: {r['error']} (log: {path.with_suffix('.log')})",
                  file=sys.stderr)
            return 1
        results.append(r)
    alone, spec = results
    result = {**compare(mine, alone, spec, args.k), "layout": layout, "method": METHODS[layout],
              "prompt_source": source, "new_tokens": args.new_tokens, "vllm_version": spec.get("vllm_version", "?"),
              "date": time.strftime("%Y-%m-%d")}
    write(out, result)
    print(f"| position | ours | vLLM |\n|---|---|---|")
    for i, (o, v) in enumerate(zip(result["ours_acceptance"], result["vllm_acceptance"])):
        print(f"| {i + 1} | {o:.3f} | {v:.3f} |")
    print(f"greedy identical in vLLM {result['vllm_greedy_identical']}/{result['prompts']}; vLLM target = ours "
          f"{result['vllm_target_equals_ours']}/{result['prompts']}; largest gap {result['max_gap']:.3f}; "
          f"wrote {out / ENGINE_CHECK} and the card's section")
    ok = result["vllm_greedy_identical"] == result["prompts"] and result["max_gap"] <= TOLERANCE
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
