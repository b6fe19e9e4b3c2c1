import json
import subprocess
import sys
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("stage", [s for s, st in STAGES.items() if st.entry is None])
def test_unbuilt_stage_says_so_and_writes_nothing(stage, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([stage, "recipe=tiny", f"run_dir={run_dir}"]) == EXIT_NOT_BUILT
    assert f"stage {stage!r} is not built yet" in capsys.readouterr().err
    assert not run_dir.exists()


def test_pipeline_stops_at_the_first_unbuilt_stage(tmp_path, capsys):
    first_missing = next(s for s in PIPELINE if STAGES[s].entry is None)
    small = ["data.sources.0.limit=2", "data.sources.1.limit=8", "data.sources.2.limit=1", "data.sources.3.limit=4",
             "train.steps=2", "train.micro_batch=2", "train.eval_every=0"]
    assert main(["pipeline", f"run_dir={tmp_path}", *small]) == EXIT_NOT_BUILT
    assert f"stage {first_missing!r} is not built yet" in capsys.readouterr().err
    assert (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "data" / "manifest.json").is_file() == (first_missing != "prepare")


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
