import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import yaml

from mtp_train.cli import EXIT_NOT_BUILT, EXIT_USAGE, PIPELINE, STAGES, main


def test_help_lists_every_stage(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in (*PIPELINE, "pipeline", "info"):
        assert f"\n  {name} " in out
    assert "tiny" in out and "llama3.1-70b" in out


def test_no_arguments_prints_usage_and_fails(capsys):
    assert main([]) == EXIT_USAGE
    assert "usage: mtp-train <stage>" in capsys.readouterr().out


def test_unknown_stage_and_option(capsys):
    assert main(["fly"]) == EXIT_USAGE
    assert "unknown stage 'fly'" in capsys.readouterr().err
    assert main(["info", "--fast"]) == EXIT_USAGE
    assert "unknown option '--fast'" in capsys.readouterr().err


def unbuilt(monkeypatch, name: str) -> None:
    """Every stage is built now; the 'not built yet' path is exercised on a stage marked unbuilt."""
    monkeypatch.setitem(STAGES, name, dataclasses.replace(STAGES[name], entry=None))


def test_unbuilt_stage_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    unbuilt(monkeypatch, "export")
    run_dir = tmp_path / "run"
    assert main(["export", "recipe=tiny", f"run_dir={run_dir}"]) == EXIT_NOT_BUILT
    assert "stage 'export' is not built yet" in capsys.readouterr().err
    assert not run_dir.exists()
    assert main(["--help"]) == 0 and "[not built yet]" in capsys.readouterr().out


def test_pipeline_stops_at_the_first_unbuilt_stage(tmp_path, capsys, monkeypatch):
    unbuilt(monkeypatch, "precompute")
    small = ["data.sources.0.limit=2", "data.sources.1.limit=8", "data.sources.2.limit=1", "data.sources.3.limit=4"]
    assert main(["pipeline", f"run_dir={tmp_path}", *small]) == EXIT_NOT_BUILT
    assert "stage 'precompute' is not built yet" in capsys.readouterr().err
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "data" / "manifest.json").is_file()
    assert not (tmp_path / "store").exists()


def test_pipeline_runs_every_stage_and_ends_with_the_validation_table(tmp_path, capsys):
    small = ["data.sources.0.limit=2", "data.sources.1.limit=8", "data.sources.2.limit=1", "data.sources.3.limit=4",
             "train.steps=2", "train.micro_batch=2", "train.eval_every=0",
             "validate.num_prompts=1", "validate.max_new_tokens=4", "validate.max_k=1", "validate.temperatures=[0]"]
    assert main(["pipeline", f"run_dir={tmp_path}", *small]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("== ")] == [f"== {s}" for s in PIPELINE]
    for name in ("hf-mtp", "hf-mtp-stitched", "vllm-mtp"):
        assert (tmp_path / "export" / name / "README.md").is_file()
    tail = out[out.rindex("export: wrote"):]
    # the validation table comes last: the decoding rows, the trees, then the predicted serving table (b = 64 last)
    assert "validation of" in tail and any(line.startswith("  head ") for line in tail.splitlines())
    assert "predicted speed-up serving on" in tail and tail.rstrip().splitlines()[-1].split()[0] == "64"


def test_generate_takes_bare_keys_and_a_prompt_as_typed(tmp_path, capsys):
    """`prompt=` needs no Hydra quoting (spaces, commas, quotes, brackets, '='), and the generate keys may be
    given without their `generate.` prefix."""
    prompt = "Write `f(a, b=1)`: it's \"quoted\", [bracketed], {braced}"
    assert main(["generate", f"run_dir={tmp_path}", f"prompt={prompt}", "k=2", "speculative=none",
                 "generate.temperature=0.7", "top_p=0.9", "--cfg"]) == 0
    g = yaml.safe_load(capsys.readouterr().out)["generate"]
    assert (g["prompt"], g["k"], g["speculative"], g["temperature"], g["top_p"]) == (prompt, 2, "none", 0.7, 0.9)
    assert not any(tmp_path.iterdir())


def test_export_takes_bare_keys(tmp_path, capsys):
    assert main(["export", f"run_dir={tmp_path}", "format=eagle", "dtype=bf16", "overwrite=true",
                 f"checkpoint={tmp_path}/checkpoints/step-000100", "--cfg"]) == 0
    e = yaml.safe_load(capsys.readouterr().out)["export"]
    assert e == {"format": "eagle", "checkpoint": f"{tmp_path}/checkpoints/step-000100", "dtype": "bf16",
                 "overwrite": True}
    assert main(["export", f"run_dir={tmp_path}", "format=safetensors"]) == EXIT_USAGE
    assert "export.format='safetensors': expected one of auto, hf-mtp, vllm-mtp, eagle, eagle3, deepseek-nextn" in capsys.readouterr().err


def test_cli_rejects_unknown_key_and_recipe(tmp_path, capsys):
    assert main(["info", "recipe=tiny", f"run_dir={tmp_path}", "train.learning_rate=1"]) == EXIT_USAGE
    assert "unknown config key 'train.learning_rate' (from the command line)" in capsys.readouterr().err
    assert main(["info", "recipe=nope", f"run_dir={tmp_path}"]) == EXIT_USAGE
    assert "unknown recipe 'nope'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cfg_prints_the_resolved_config(tmp_path, capsys, tiny_dir):
    assert main(["train", f"run_dir={tmp_path}", "seed=3", "--cfg"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["seed"] == 3 and cfg["recipe"] == "tiny" and cfg["target"]["path"] == str(tiny_dir / "target")


def test_info_on_the_tiny_target(tmp_path, capsys, tiny_dir):
    assert main(["info", f"run_dir={tmp_path}", "info.max_new_tokens=8"]) == 0
    out = capsys.readouterr().out
    assert "hidden_size              256" in out and "num_key_value_heads      2" in out
    report = json.loads((tmp_path / "info.json").read_text())
    assert report["target"]["architecture"]["num_hidden_layers"] == 4
    assert report["target"]["sample"]["new_tokens"] == 8 and report["draft"]["sample"]["new_tokens"] == 8
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["info"]["max_new_tokens"] == 8 and written["target"]["path"] == str(tiny_dir / "target")


def test_info_without_generation_reads_only_config_and_tokenizer(tmp_path, capsys, tiny_dir):
    # What the 70B recipe does: no weights are loaded, so it works for targets larger than the host.
    assert main(["info", "recipe=llama3.1-70b", f"run_dir={tmp_path}", f"target.path={tiny_dir / 'target'}"]) == 0
    report = json.loads((tmp_path / "info.json").read_text())
    assert set(report) == {"target"} and "sample" not in report["target"]
    assert report["target"]["architecture"]["hidden_size"] == 256


def test_info_names_a_target_without_weights(tmp_path, capsys, tiny_dir):
    target = _copy_model(tiny_dir / "target", tmp_path / "target")
    (target / "model.safetensors").unlink()
    assert main(["info", f"run_dir={tmp_path / 'run'}", f"target.path={target}", "target.draft_path=null"]) == 1
    assert f"target at {target} could not be loaded" in capsys.readouterr().err


def test_info_names_a_bad_target_path(tmp_path, capsys):
    assert main(["info", "recipe=llama3.1-8b", f"run_dir={tmp_path}", f"target.path={tmp_path / 'nope'}"]) == 1
    assert f"target directory not found: {tmp_path / 'nope'}" in capsys.readouterr().err


def test_module_and_console_script_entry_points():
    out = subprocess.run([sys.executable, "-m", "mtp_train", "--help"], capture_output=True, text=True, check=True)
    assert "usage: mtp-train" in out.stdout
    script = Path(sys.executable).parent / "mtp-train"
    assert script.exists(), "the console script is missing: install the package (make setup)"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == __import__("mtp_train").__version__


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_info_rejects_a_tokenizer_that_does_not_fit(tmp_path, capsys, tiny_dir):
    target = _copy_model(tiny_dir / "target", tmp_path / "target")
    cfg = json.loads((target / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (target / "config.json").write_text(json.dumps(cfg))
    assert main(["info", f"run_dir={tmp_path / 'run'}", f"target.path={target}", "target.draft_path=null",
                 "info.generate=false"]) == 1
    assert "has 8192 tokens but the model's vocab_size is 1000" in capsys.readouterr().err


def test_info_rejects_a_draft_with_another_tokenizer(tmp_path, capsys, tiny_dir):
    from transformers import AutoTokenizer

    draft = _copy_model(tiny_dir / "draft", tmp_path / "draft")
    tok = AutoTokenizer.from_pretrained(draft)
    tok.add_tokens(["<|extra|>"])
    tok.save_pretrained(draft)
    assert main(["info", f"run_dir={tmp_path / 'run'}", f"target.draft_path={draft}", "info.generate=false"]) == 1
    assert f"draft tokenizer at {draft} differs from the target's" in capsys.readouterr().err


def test_one_writer_per_run_dir(tmp_path, capsys):
    """A stage started while another process writes the same run_dir is refused naming the holder; once that
    holder is killed (SIGKILL: no clean-up), its left-over lock is recognised and taken over."""
    import os
    import signal
    import socket

    from mtp_train.cli import EXIT_FAILED

    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom mtp_train.files import run_lock\n"
         f"with run_lock({str(run_dir)!r}, 'train'):\n    print('locked', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["export", f"run_dir={run_dir}"]) == EXIT_FAILED
        err = capsys.readouterr().err
        assert f"{run_dir} is in use by `mtp-train train` (pid {holder.pid} on host {socket.gethostname()}, since" in err
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert main(["export", f"run_dir={run_dir}"]) == EXIT_FAILED  # no checkpoint to export: the lock is not the error
    out, err = capsys.readouterr()
    assert f"was left by `mtp-train train` (pid {holder.pid}" in out and "taking it over" in out
    assert "in use" not in err and "checkpoint" in err
    assert (run_dir / ".lock").read_text() == ""  # released on the way out
