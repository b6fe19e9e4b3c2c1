"""`mtp-train validate ... validate.engine=vllm` without vLLM: a fake vLLM Python stands in for
`vllm_run.py` (its command line logged, canned counters and timings written), so what validate makes of vLLM's
results is checked by hand: the head's export it serves, τ and acceptance from the counters, greedy identity,
speed-ups over the target-only rounds, the report's schema, and the errors. vLLM itself serves it in
`make test-serving` (tests/serving)."""

import json
import sys
import textwrap

import pytest

from mtp_train.cli import main

ACCEPTED = [6, 3, 1]  # the fake's drafts kept at positions 1..3, out of STEPS verification steps
STEPS = 10

FAKE = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, os, sys
    args = sys.argv[1:]
    log = {{"argv": args}}
    vllm_run, target, prompts, out = args[:4]
    rest = args[4:]
    spec = rest[:3] if rest and not rest[0].startswith("--") else []
    opts = rest[len(spec):]
    temps = [0.0]
    if "--temperatures" in opts:
        after = opts[opts.index("--temperatures") + 1:]
        temps = [float(t) for t in after[:next((i for i, t in enumerate(after) if t.startswith("--")), len(after))]]
    prompts = json.load(open(prompts))
    new = int(opts[opts.index("--max-tokens") + 1])
    with open(out + ".argv", "w") as f:
        json.dump(log, f)
    if os.environ.get("FAKE_VLLM_FAIL") and spec:
        json.dump({{"error": "ValueError: the fake cannot"}}, open(out, "w"))
        sys.exit(1)
    runs = []
    for t in temps:
        tokens = [[(i + j) % 7 + 2 for j in range(new)] for i in range(len(prompts))]
        if spec and t > 0:
            tokens[0] = [99] * new  # sampled: another output
        run = {{"temperature": t, "tokens": tokens, "seconds": 0.8 if spec else 1.0}}
        if spec:
            k = int(spec[2])
            run["steps"], run["accepted_per_position"] = {STEPS}, {ACCEPTED}[:k]
        runs.append(run)
    result = {{"vllm_version": "0.0-fake", "device": "cpu", **{{k: v for k, v in runs[0].items()}}, "runs": runs}}
    json.dump(result, open(out, "w"))
""")


@pytest.fixture()
def fake_python(tmp_path):
    path = tmp_path / "fake-vllm-python"
    path.write_text(FAKE)
    path.chmod(0o755)
    return path


def validate(run_dir, *overrides) -> int:
    from tests.conftest import RUN_OVERRIDES

    return main(["validate", "recipe=tiny", f"run_dir={run_dir}", *RUN_OVERRIDES, "validate.teacher_forced=false",
                 "validate.trees=[]", "validate.max_k=3", *overrides])


def test_validate_through_vllm_reports_its_counters_in_our_schema(trained_run, tmp_path, fake_python, capsys):
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(trained_run, run_dir, symlinks=True)
    shutil.rmtree(run_dir / "validation", ignore_errors=True)  # another test may have validated trained_run
    assert validate(run_dir, "validate.engine=vllm", f"validate.vllm_python={fake_python}",
                    "validate.tensor_parallel_size=2", "validate.temperatures=[0.0,1.0]") == 0
    out = capsys.readouterr().out
    report = json.loads((run_dir / "validation" / "report.json").read_text())
    export = run_dir / "validation" / "export" / "vllm-mtp"
    assert (export / "config.json").is_file() and (export / "export.json").is_file()  # what vLLM served
    assert json.loads((export / "config.json").read_text())["architectures"] == ["EagleMtpHeadForCausalLM"]
    s = report["decoding_settings"]
    assert (s["engine"], s["tensor_parallel_size"], s["layout"], s["method"]) == ("vllm", 2, "vllm-mtp", "eagle")
    assert s["vllm_version"] == "0.0-fake" and s["draft_sample_method"] == "probabilistic"
    rows = {(e["k"], e["temperature"]): e for e in report["decoding"]}
    assert set(rows) == {(k, t) for k in (1, 2, 3) for t in (0.0, 1.0)}
    for (k, t), e in rows.items():
        assert e["engine"] == "vllm" and e["drafter"] == "head"
        assert e["tau"] == pytest.approx(1 + sum(ACCEPTED[:k]) / STEPS)
        assert e["acceptance_by_position"] == pytest.approx([a / STEPS for a in ACCEPTED[:k]])
        assert e["speedup"] == pytest.approx(1.25)  # 0.8 s against the target alone's 1.0 s, same tokens
        assert e["greedy_identical"] is (True if t == 0 else None)
        assert e["suspect"] is False and e["predicted_speedup"] is None
    base = {b["temperature"]: b for b in report["target_only"]}
    assert base[0.0]["rounds"] == [20.0, 20.0] and base[0.0]["spread"] == 0  # 2 prompts x 10 tokens in 1 s
    assert report["tree_decoding"] == [] and report["prompt_sets"][0]["name"] == "recipe"
    # every vLLM start got the settings: TP, one request at a time, both temperatures, probabilistic drafting
    # for the head's runs only
    work = run_dir / "validation" / "vllm" / "recipe"
    starts = {p.name.removesuffix(".json.argv"): json.loads(p.read_text())["argv"] for p in work.glob("*.argv")}
    assert set(starts) == {"target-before", "target-after", "head-k1", "head-k2", "head-k3"}
    for name, argv in starts.items():
        joined = " ".join(argv)
        assert "--tensor-parallel-size 2" in joined and "--max-num-seqs 1" in joined
        assert "--temperatures 0.0 1.0" in joined
        assert ("--draft-sample-method probabilistic" in joined) == name.startswith("head")
    assert starts["head-k2"][4:7] == ["eagle", str(export.resolve()), "2"]
    assert "decoded by vLLM 0.0-fake" in out and "tensor_parallel_size 2" in out


def test_validate_through_vllm_errors_name_what_to_do(trained_run, tmp_path, fake_python, monkeypatch, capsys):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir, symlinks=True)
    shutil.rmtree(run_dir / "validation", ignore_errors=True)  # another test may have validated trained_run
    monkeypatch.delenv("MTP_TRAIN_VLLM_PYTHON", raising=False)
    assert validate(run_dir, "validate.engine=vllm", f"validate.vllm_python={tmp_path / 'nope'}") == 1
    assert "validate.vllm_python=" in capsys.readouterr().err
    assert not (run_dir / "validation" / "report.json").exists()
    assert validate(run_dir, "validate.engine=gpu") == 2
    assert "validate.engine='gpu': expected one of ours, vllm" in capsys.readouterr().err
    # vLLM failing on the head names the error and the log, and no report is written
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    assert validate(run_dir, "validate.engine=vllm", f"validate.vllm_python={fake_python}") == 1
    err = capsys.readouterr().err
    assert "vLLM could not decode head-k1: ValueError: the fake cannot" in err and "head-k1.log" in err
    assert not (run_dir / "validation" / "report.json").exists()


def test_vllm_runs_per_request_histogram_gives_each_prompts_acceptance_by_position():
    """vllm_run.py --per-prompt reads vLLM's per-request spec-decode metrics: a histogram over verification steps of
    the drafts accepted a step; position j counts every step that accepted j or more (a chain)."""
    from types import SimpleNamespace

    from mtp_train.inference.vllm_run import per_request

    got = per_request(SimpleNamespace(histogram=[3, 2, 0, 1]), 3)  # 6 steps: 3 kept none, 2 kept one, 1 kept three
    assert got == {"steps": 6, "accepted_per_position": [3, 1, 1]}
    assert per_request(SimpleNamespace(histogram=[2, 1]), 3)["accepted_per_position"] == [1, 0, 0]
    assert per_request(None, 2) == {"steps": 0, "accepted_per_position": [0, 0]}  # ended before any step
