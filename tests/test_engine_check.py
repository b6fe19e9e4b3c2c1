"""`python -m mtp_train.export.engine_check`: our engine beside vLLM on an export. vLLM itself runs only in
`make test-serving`; here a stand-in for vLLM's Python (it decodes with our engine, as vLLM's greedy output
would be, and reports the acceptance counts it is told to) checks what the command does with what vLLM
says: the side-by-side figures, the exit code, the model card's section and when it is dropped."""

import json
import os
import shutil
import stat
import sys

from pathlib import Path

import pytest
import torch
from runs import untrained_head_run

from mtp_train.config import compose
from mtp_train.export.run import run as export
from mtp_train.export.engine_check import BEGIN, main

FAKE = """#!{python}
import argparse, json, os, sys
if os.environ.get("STANDIN_CRASH"):  # dies before writing anything, as a vLLM that cannot import would
    raise SystemExit(3)
ap = argparse.ArgumentParser()
ap.add_argument("script"); ap.add_argument("target"); ap.add_argument("prompts"); ap.add_argument("out")
ap.add_argument("spec", nargs="*"); ap.add_argument("--max-tokens", type=int); ap.add_argument("--dtype")
ap.add_argument("--max-model-len", type=int)
a = ap.parse_args()
assert a.dtype == "float32" and a.max_model_len >= 1024, (a.dtype, a.max_model_len)
from mtp_train.inference.runner import load_runner
from mtp_train.inference.speculative import generate
from mtp_train.model.target import TargetConfig
runner = load_runner(a.target, TargetConfig(path=a.target, device="cpu"))
tokens = generate(runner, json.load(open(a.prompts)), max_new_tokens=a.max_tokens, stop_tokens=set()).tokens
result = {{"spec": a.spec or None, "vllm_version": "0.0-standin", "seconds": 1.0, "tokens": tokens, "metrics": {{}}}}
if a.spec:
    result.update(json.loads(os.environ["STANDIN_COUNTS"]))
json.dump(result, open(a.out, "w"))
"""


@pytest.fixture(scope="module")
def eagle_run(trained_run, tiny_dir, tmp_path_factory):
    """A run on the tiny target holding a random eagle1 head, exported as eagle-vllm, with trained_run's
    prepared val split (the held-out prompts)."""
    run_dir = tmp_path_factory.mktemp("engine_check")
    shutil.copytree(trained_run / "data", run_dir / "data")
    untrained_head_run(run_dir, tiny_dir / "target", "eagle1")
    overrides = [f"run_dir={run_dir}", "target.device=cpu", "target.draft_path=null", "export.dtype=fp32",
                 "export.format=eagle"]
    export(compose("tiny", overrides))
    fake = run_dir / "vllm-python"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return run_dir, overrides, fake


def check(eagle_run, counts: dict, monkeypatch) -> tuple[int, dict]:
    run_dir, overrides, fake = eagle_run
    monkeypatch.setenv("STANDIN_COUNTS", json.dumps(counts))
    code = main(["--vllm-python", str(fake), "--k", "2", "--prompts", "2", "--new-tokens", "8", "recipe=tiny",
                 *[o for o in overrides if not o.startswith("export.")]])
    return code, json.loads((run_dir / "export" / "eagle-vllm" / "engine_check.json").read_text())


def test_engine_check_reports_both_engines_and_fails_on_a_gap(eagle_run, monkeypatch):
    run_dir, overrides, _ = eagle_run
    out = run_dir / "export" / "eagle-vllm"
    # vLLM reporting far more accepted drafts than our engine saw: a bug in one of them, exit 1
    code, result = check(eagle_run, {"steps": 10, "accepted_per_position": [9, 8]}, monkeypatch)
    assert code == 1 and result["vllm_acceptance"] == [0.9, 0.8] and result["max_gap"] > 0.03
    assert result["prompts"] == 2 and result["vllm_greedy_identical"] == 2 and result["vllm_target_equals_ours"] == 2
    assert result["ours_steps"] > 0 and len(result["ours_accepted_per_position"]) == 2
    # the same counts as ours: exit 0, and the card's section is replaced, not added a second time
    same = {"steps": result["ours_steps"], "accepted_per_position": result["ours_accepted_per_position"]}
    code, result = check(eagle_run, same, monkeypatch)
    assert code == 0 and result["max_gap"] == 0
    card = (out / "README.md").read_text()
    assert card.count(BEGIN) == 1 and "| 1 |" in card and "0.0-standin" in card
    assert card.index("EagleLlamaForCausalLM") < card.index(BEGIN)  # the export's own card is kept above it

    # a vLLM that dies before writing: exit 1 naming its log, never the earlier run's figures
    monkeypatch.setenv("STANDIN_CRASH", "1")
    code, _ = check(eagle_run, same, monkeypatch)
    assert code == 1 and not (run_dir / "engine_check" / "vllm-target.json").exists()
    monkeypatch.delenv("STANDIN_CRASH")

    # an export that is up to date keeps the section; a new export (other weights) drops it
    export(compose("tiny", overrides))
    assert (out / "README.md").read_text().count(BEGIN) == 1
    export(compose("tiny", [*overrides, "export.dtype=bf16", "export.overwrite=true"]))
    assert BEGIN not in (out / "README.md").read_text() and not (out / "engine_check.json").exists()


def test_our_side_drafts_with_the_exported_weights_not_the_latest_checkpoint(eagle_run, tmp_path):
    """Training on after the export: the engine check still compares the head the export holds."""
    from mtp_train.export.engine_check import exported_head
    from mtp_train.inference.runner import load_runner
    from mtp_train.model.checkpoint import read_head

    run_dir, overrides, _ = eagle_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    cfg = compose("tiny", [f"run_dir={copy}", *overrides[1:]])
    exported_from, _ = read_head(cfg)  # step 1, the export's checkpoint
    untrained_head_run(copy, Path(cfg.target.path), "eagle1", seed=5, step=2)  # now the latest
    assert not torch.equal(read_head(cfg)[0].fc.weight, exported_from.fc.weight)
    target = load_runner(cfg.target.path, cfg.target)
    out = copy / "export" / "eagle-vllm"
    dtype = getattr(torch, json.loads((out / "export.json").read_text())["dtype"])  # bf16 after the test above
    drafter = exported_head(cfg, out, target)
    assert torch.equal(drafter.head.fc.weight, exported_from.fc.weight.to(dtype).float())


def test_engine_check_refuses_what_it_cannot_check(eagle_run, tmp_path, capsys):
    run_dir, overrides, fake = eagle_run
    base = [o for o in overrides if not o.startswith("export.")]
    with pytest.raises(SystemExit):
        main(["--vllm-python", str(tmp_path / "nope"), "recipe=tiny", *base])
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--vllm-python", str(fake), "--layout", "hf-mtp", "recipe=tiny", *base])
    assert "vLLM serves vllm-mtp, eagle-vllm, eagle3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--vllm-python", str(fake), "--layout", "eagle3", "recipe=tiny", *base])
    assert "has no export" in capsys.readouterr().err


def test_our_side_also_samples_when_asked(eagle_run):
    """`ours(..., temperature=1)` (make test-serving's T = 1 case) adds a seeded sampled run: the same counts
    twice, at most one acceptance per position per step, the greedy figures unchanged."""
    from mtp_train.export.engine_check import ours

    run_dir, overrides, _ = eagle_run
    cfg = compose("tiny", [o for o in overrides if not o.startswith("export.")])
    prompts, out = [[5, 300, 17, 2048], [99, 7, 1200]], run_dir / "export" / "eagle-vllm"
    greedy = ours(cfg, prompts, 2, 8, out)
    sampled = ours(cfg, prompts, 2, 8, out, temperature=1.0)
    assert "sampled" not in greedy and {k: v for k, v in sampled.items() if k != "sampled"} == greedy
    s = sampled["sampled"]
    assert s["temperature"] == 1.0 and 2 * 8 // 3 <= s["steps"] <= 2 * 8
    assert all(0 <= a <= s["steps"] for a in s["accepted_per_position"])
    assert ours(cfg, prompts, 2, 8, out, temperature=1.0)["sampled"] == s
