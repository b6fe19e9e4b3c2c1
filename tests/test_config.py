from pathlib import Path

import pytest
import yaml

from mtp_train.config import RECIPES_DIR, ConfigError, RunConfig, available_recipes, compose, write_resolved
from mtp_train.model.target import TargetConfig

PLACEHOLDERS = ["llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "deepseek-v2-lite"]


def test_recipes_dir_is_the_top_level_folder():
    assert RECIPES_DIR.resolve() == (Path(__file__).resolve().parents[1] / "recipes").resolve()
    assert set(available_recipes()) >= {"tiny", *PLACEHOLDERS}


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipe_composes(recipe, tmp_path):
    text = (RECIPES_DIR / f"{recipe}.yaml").read_text()
    assert text.startswith("# Run: mtp-train ") and f"recipe={recipe}" in text.splitlines()[0]
    overrides = [f"run_dir={tmp_path}"]
    if recipe != "tiny":
        overrides.append(f"target.path={tmp_path}")
    cfg = compose(recipe, overrides)
    assert isinstance(cfg, RunConfig) and isinstance(cfg.target, TargetConfig)
    assert cfg.recipe == recipe and cfg.run_dir == str(tmp_path)
    assert cfg.target.dtype in ("float32", "bfloat16")


def test_tiny_recipe_points_at_the_packaged_assets(tiny_dir):
    cfg = compose("tiny", ["run_dir=runs/x"])
    assert Path(cfg.target.path) == tiny_dir / "target"
    assert Path(cfg.target.draft_path) == tiny_dir / "draft"
    assert cfg.target.dtype == "float32"


def test_overrides_are_typed():
    cfg = compose("tiny", ["run_dir=r", "seed=7", "info.max_new_tokens=5", "target.dtype=bfloat16"])
    assert cfg.seed == 7 and cfg.info.max_new_tokens == 5 and cfg.target.dtype == "bfloat16"


@pytest.mark.parametrize("override, expected", [
    ("foo=1", "unknown config key 'foo' (from the command line)"),
    ("target.pth=x", "unknown config key 'target.pth' (from the command line). Did you mean 'target.path'?"),
    ("seed=abc", "bad value for 'seed'"),
    ("target.dtype=float8", "target.dtype='float8'; expected one of float32, bfloat16, float16"),
    ("noequals", "bad argument 'noequals': expected key=value"),
    ("+target.lr=3", "bad argument '+target.lr=3': keys cannot be added or removed"),
    ("~seed", "bad argument '~seed': keys cannot be added or removed"),
    ("++seed=3", "keys cannot be added or removed"),
    ("target.device=gpu", "target.device='gpu'; expected auto, cpu, cuda or cuda:N"),
    ("target.path=/models/Llama (ft)", "cannot parse the override 'target.path=/models/Llama (ft)'"),
    ("target.path=a,b", "the value of 'target.path' has a comma: quote it"),
    ("data.sources=[{path: x.jsonl, fmt: openai}]", "unknown key 'fmt' in the value of 'data.sources' (from the "
     "command line); SourceConfig has: path, format, split, weight, limit"),
    ("data.sources=[{path: x.jsonl, format: csv}]", "format='csv'; expected one of auto, sharegpt"),
    ("data.on_bad_line=maybe", "data.on_bad_line='maybe'; expected error or skip"),
])
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        compose("tiny", ["run_dir=r", override])
    assert expected in str(e.value)


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(ConfigError) as e:
        compose("tinyy", ["run_dir=r"])
    msg = str(e.value)
    assert "unknown recipe 'tinyy'" in msg and "Did you mean 'tiny'?" in msg and "llama3.1-70b" in msg


def test_placeholder_recipes_ask_for_the_target_path():
    with pytest.raises(ConfigError, match=r"recipe 'llama3.1-70b' needs 'target.path': pass target.path="):
        compose("llama3.1-70b", ["run_dir=r"])


def test_recipe_file_by_path_and_unknown_key_in_a_file(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("defaults:\n  - run_schema\n  - _self_\ntarget:\n  path: /models/x\n  dtype: bfloat16\n")
    cfg = compose(str(good), ["run_dir=r"])
    assert cfg.target.path == "/models/x" and cfg.recipe == str(good)

    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  - run_schema\n  - _self_\ntarget:\n  path: /models/x\n  lr: 3\n")
    with pytest.raises(ConfigError) as e:
        compose(str(bad), ["run_dir=r"])
    assert "unknown config key 'target.lr'" in str(e.value) and str(bad) in str(e.value)

    with pytest.raises(ConfigError, match="recipe file not found"):
        compose(str(tmp_path / "absent.yaml"), ["run_dir=r"])


def test_recipe_without_the_schema_is_named(tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text("target:\n  path: /models/x\n")
    with pytest.raises(ConfigError) as e:
        compose(str(plain))
    assert f"recipe file {plain} is not built on the schema" in str(e.value)
    assert "defaults: [run_schema, _self_]" in str(e.value)


def test_yml_recipes_are_refused_with_a_reason(tmp_path):
    with pytest.raises(ConfigError, match="recipe files must end in .yaml"):
        compose(str(tmp_path / "mine.yml"))


def test_run_dir_defaults_to_the_recipe_name(tmp_path):
    assert compose("llama3.1-70b", [f"target.path={tmp_path}"]).run_dir == "runs/llama3.1-70b"
    mine = tmp_path / "mine.yaml"
    mine.write_text("defaults:\n  - run_schema\n  - _self_\ntarget:\n  path: /x\n")
    assert compose(str(mine)).run_dir == "runs/mine"


def test_write_resolved_keeps_a_different_earlier_config(tmp_path):
    a = compose("tiny", [f"run_dir={tmp_path}", "seed=1"])
    b = compose("tiny", [f"run_dir={tmp_path}", "seed=2"])
    write_resolved(a, tmp_path)
    write_resolved(a, tmp_path)  # identical: nothing to keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    write_resolved(b, tmp_path)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["seed"] == 2
    assert yaml.safe_load((tmp_path / "config.1.yaml").read_text())["seed"] == 1
