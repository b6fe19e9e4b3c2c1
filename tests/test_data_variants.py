"""benchmarks/data_variants.py: the dev experiments that choose how the broad recipe's data is made. Their runs
take hours on SmolLM2; here the parts that decide: every variant of the committed yaml composes into a valid run
config, the cut to the reference's tokens, and the paired comparison the rule reads."""

import sys
from pathlib import Path

import datasets
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import data_variants as dv  # noqa: E402
from data_scaling import permutation, rows_for_tokens  # noqa: E402

from mtp_train.config import compose  # noqa: E402


def test_every_variant_of_the_committed_grid_composes_into_the_recipe():
    grid = yaml.safe_load(dv.GRID.read_text())
    assert grid["reference"] in [v["name"] for v in grid["variants"]]
    for v in grid["variants"]:
        d = dv.definition(grid, v)
        cfg = compose(grid["recipe"], ["run_dir=/nonexistent", *dv.stage_overrides(d), *dv.dev_overrides(d)])
        formats = [s.format for s in cfg.data.sources]
        assert formats[0] == "sharegpt_v3" and formats[-1] == "stdlib_chat" and cfg.data.sources[-1].split == "val"
        assert cfg.validate.prompts == grid["dev"]["prompts"] and not cfg.validate.test_speed
        assert (cfg.validate.test_k, cfg.validate.test_tree) == (grid["dev"]["k"], "")
        assert cfg.data.decontaminate and cfg.data.regenerate  # as the recipe makes its data
    by = {v["name"]: dv.definition(grid, v) for v in grid["variants"]}
    assert by["all-turns"]["sources"][0]["turns"] == "all" and by["first-bf16"]["sources"][0]["turns"] == "first"
    assert "data.regen_dtype=float32" in by["first-fp32"]["overrides"]
    assert any(s["format"] == "target_prompts" for s in by["target-prompts"]["sources"])


def test_the_cut_takes_the_fewest_permuted_rows_that_reach_the_tokens(tmp_path):
    lengths = [5, 9, 3, 12, 7, 4, 8, 6]
    datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths],
                                "loss_mask": [[1] * n for n in lengths]}).save_to_disk(str(tmp_path / "train"))
    order = permutation(len(lengths), 0)
    running = [sum(lengths[i] for i in order[:n]) for n in range(1, len(lengths) + 1)]
    for want in (1, running[2], running[2] + 1, running[-1]):
        n = rows_for_tokens(tmp_path, want, 0)
        assert running[n - 1] >= want and (n == 1 or running[n - 2] < want)
    with pytest.raises(SystemExit, match="under the"):
        rows_for_tokens(tmp_path, running[-1] + 1, 0)


def _judged(name, steps_emitted):
    half = len(steps_emitted) // 2
    sets = {"mt-bench": steps_emitted[:half], "sharegpt-dev": steps_emitted[half:]}
    return {"variant": name, "definition": {"dev": {"prompts": list(sets)}},
            "sets": {n: {"per_prompt": [{"steps": s, "emitted": e} for s, e in rows]} for n, rows in sets.items()}}


def test_the_difference_from_the_reference_is_paired_by_prompt():
    # prompts of very different τ: unpaired intervals would overlap widely; paired, a head one token better on
    # every prompt is better in every resample
    ref = [(10, 10 + 10 * (i % 5)) for i in range(40)]
    better = [(s, e + 1) for s, e in ref]
    same = dv.compare(_judged("same", ref), _judged("ref", ref))
    assert same["diff"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    c = dv.compare(_judged("better", better), _judged("ref", ref))
    assert c["diff"]["low"] > 0 and c["diff"]["value"] == pytest.approx(40 / 400)
    assert c["tau"]["low"] < c["tau"]["value"] - c["diff"]["value"] < c["tau"]["high"]  # the spread the pairing removes
    with pytest.raises(SystemExit, match="not the same prompts"):
        dv.compare(_judged("short", ref[:-2]), _judged("ref", ref))
