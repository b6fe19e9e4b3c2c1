"""The peers protocol (benchmarks/peers/protocol.py) without its slow parts: the grid, the budget check, resuming from
the heads' JSONs, the best-configuration rule, the two-level bootstrap, the bf16 rounding of a served export, the
table, and the failures that stop it (a step count other than asked, greedy output beyond a near-tie). Training and
vLLM are replaced by stand-ins; no peer venv is needed."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))
sys.path.insert(0, str(PEERS.parent))

import protocol  # noqa: E402
from mtp_train.validate.testset import ratio_interval, seeds_interval  # noqa: E402

GRID = protocol.load_grid()
DATA, OTHER = "a" * 64, "b" * 64
TEST_SETS = ("mt-bench-test", "sharegpt-test", "functions-test")


def figures(taus: dict[str, float], prompts: int = 6, seed: int = 0) -> dict:
    """Judged figures with per-prompt counters near the given τ(5) per set (10 steps a prompt)."""
    rng, sets = random.Random(seed), {}
    for name, tau in taus.items():
        rows = []
        for _ in range(prompts):
            total = max(0, (tau - 1) * 10 + rng.choice((-1, 0, 1)))  # drafts accepted in the prompt's 10 steps
            accepted = [round(total * w) for w in (0.45, 0.25, 0.15, 0.1, 0.05)]
            rows.append({"steps": 10, "accepted": accepted})
        steps = 10 * prompts
        rate = [sum(r["accepted"][j] for r in rows) / steps for j in range(5)]
        sets[name] = {"tau": 1 + sum(rate), "acceptance_by_position": rate, "num_prompts": prompts,
                      "greedy_identical_prompts": prompts, "mismatched": [], "per_prompt": rows}
    return {"sets": sets, "mean_tau": sum(s["tau"] for s in sets.values()) / len(sets), "settings": {}}


def head(trainer: str, config: str, seed: int, digest: str = DATA, dev: float | None = None,
         test: dict | None = None, export: Path | None = None) -> dict:
    return {"head": protocol.head_name(trainer, config, seed), "trainer": trainer, "seed": seed,
            "configuration": protocol.configuration(GRID, trainer, config), "export": str(export or "/nonexistent"),
            "dataset": {"token_ids_sha256": digest}, "processor": "cpu-x", "layers": 1,
            "dev": {"sets": {"recipe": {"tau": dev}, "mt-bench": {"tau": dev}}, "mean_tau": dev} if dev else None,
            "test": figures(test, seed=seed) if test else None}


def write(folder: Path, *heads: dict) -> None:
    for h in heads:
        protocol.write_head(folder, h)


# -- the grid and the budget ------------------------------------------------------------------------------------------
def test_the_grid_gives_each_trainer_four_configurations_with_their_reasons(tmp_path):
    for trainer in protocol.TRAINERS:
        configs = GRID["trainers"][trainer]["configs"]
        assert len(configs) == 4 and all(len(c["reason"]) > 40 for c in configs)
    assert [c["name"] for c in GRID["trainers"]["ours"]["configs"]][:2] == ["recipe", "random-start"]
    assert protocol.configuration(GRID, "ours", "random-start")["overrides"] == ["head.init_fc=-1",
                                                                                 "head.init_layer=-1"]
    broken = tmp_path / "grid.yaml"
    text = (PEERS / "grid.yaml").read_text()
    broken.write_text(text[:text.rindex("      - name: matched-lk")])  # specforge left with 3
    with pytest.raises(protocol.ProtocolError, match=r"grid.yaml: trainers.specforge.configs names .*expected 4"):
        protocol.load_grid(broken)


def test_the_matched_configurations_are_the_settings_side_by_side_used():
    import side_by_side as sbs

    args = SimpleNamespace(lr=2e-3, warmup=20, steps=GRID["budget"]["steps"], depth=3)
    spec = {c["name"]: c["flags"] for c in GRID["trainers"]["speculators"]["configs"]}
    assert spec["matched"] == [x.replace("0.002", "2e-3") for x in sbs.speculators_settings(args, norms=True)]
    assert spec["matched-lk"] == [x if x != "kl_div" else '{"kl_div":0.5,"nla":0.5}' for x in spec["matched"]]
    assert spec["defaults"] == [] and spec["defaults-lk"] == ["--loss-fn", '{"kl_div":0.5,"nla":0.5}']
    forge = {c["name"]: c for c in GRID["trainers"]["specforge"]["configs"]}
    assert forge["matched"]["flags"] == [x.replace("0.002", "2e-3") for x in sbs.specforge_settings(args)]
    assert forge["defaults"]["flags"] == [] and forge["defaults-lk"]["overrides"] == ["training.lk_loss_type=lambda"]


def test_the_budget_takes_tokens_per_step_within_2_percent_and_the_exact_steps():
    budget = GRID["budget"]
    ok = protocol.check_budget("ours-recipe-s0", {"steps": 150, "tokens_per_step": 2039.0}, budget, 2000.0, "log")
    assert ok["real_tokens"] == 150 * 2039 and ok["deviation"] == pytest.approx(0.0195)
    with pytest.raises(protocol.ProtocolError, match=r"speculators-defaults-s0: 1,958 real tokens a step, -2.1% "
                                                     r"from the budget's 2,000"):
        protocol.check_budget("speculators-defaults-s0", {"steps": 150, "tokens_per_step": 1958.0}, budget, 2000.0,
                              "log")
    with pytest.raises(protocol.ProtocolError, match="specforge-matched-s1: 149 optimizer steps made, 150 asked"):
        protocol.check_budget("specforge-matched-s1", {"steps": 149, "tokens_per_step": 2000.0}, budget, 2000.0, "x")


def test_train_head_keeps_ours_layers_and_each_peers_adjustments(tmp_path, monkeypatch):
    """train_head through stand-in launchers: ours' record has its head's layers and no launcher adjustments (ours
    has no launcher); a peer's has one layer and its launcher's adjustments with their call counts."""
    import side_by_side as sbs

    made = {"export": tmp_path / "export", "speed": {"steps": 150, "tokens_per_step": 2000.0}}
    adjusted = {"adjustments": {"muon_fp32_gemms": {"calls": 600}, "sdpa": {"calls": None}}}
    monkeypatch.setattr(sbs, "ours", lambda *a, **k: {**made, "cfg": SimpleNamespace(head=SimpleNamespace(
        num_layers=2)), "teacher_forced": {"d1": 0.4}, "settings": ["head.num_layers=2"]})
    monkeypatch.setattr(sbs, "speculators", lambda *a, **k: {**made, **adjusted, "settings": ["--lr", "1e-3"]})
    monkeypatch.setattr(sbs, "specforge", lambda *a, **k: {**made, "adjustments": {}, "overrides": ["x=1"]})
    ctx = SimpleNamespace(grid=GRID, base=tmp_path, cfg=SimpleNamespace(train=SimpleNamespace(depth=3)), layers=30,
                          work=tmp_path / "work", lengths=[300] * 1200, reference=2400.0, peers={}, peers_json=None)
    for name in ("ours-two-layers-s0", "speculators-defaults-lk-s0", "specforge-matched-lk-s0"):
        (ctx.work / name).mkdir(parents=True)
    ours = protocol.train_head(ctx, "ours", protocol.configuration(GRID, "ours", "two-layers"), 0)
    assert ours["layers"] == 2 and "adjustments" not in ours and ours["teacher_forced"] == {"d1": 0.4}
    spec = protocol.train_head(ctx, "speculators", protocol.configuration(GRID, "speculators", "defaults-lk"), 0)
    assert spec["layers"] == 1 and spec["adjustments"] == {"muon_fp32_gemms": 600, "sdpa": None}
    forge = protocol.train_head(ctx, "specforge", protocol.configuration(GRID, "specforge", "matched-lk"), 0)
    assert forge["layers"] == 1 and forge["adjustments"] == {} and forge["settings"] == ["x=1"]


def test_speculators_rows_are_chosen_to_hold_the_budgets_tokens():
    rng = random.Random(0)
    lengths = [rng.randint(20, 512) for _ in range(1200)]
    rows = protocol.packed_rows(lengths, 2200, seed=1, epoch=0)
    assert sum(rows) == sum(lengths) and max(rows) <= 2200 and rows == protocol.packed_rows(lengths, 2200, 1, 0)
    assert rows != protocol.packed_rows(lengths, 2200, 1, 1)  # each epoch its own order
    target = 8 * sum(lengths) / len(lengths)
    plan = protocol.speculators_rows(lengths, seed=0, steps=150, target=target)
    assert 0 <= plan["planned_tokens_per_step"] / target - 1 < 0.01 and plan["total_seq_len"] > target
    epoch_rows = len(protocol.packed_rows(lengths, plan["total_seq_len"], 0, 0))
    assert plan["epochs"] == (1 if epoch_rows >= 150 else 2)


# -- resuming, choosing, failing --------------------------------------------------------------------------------------
@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """protocol.main with the data, the trainers and vLLM replaced: what was trained and judged is recorded."""
    calls = {"trained": [], "judged": [], "steps": 150, "problems": []}
    ctx = SimpleNamespace(grid=GRID, hash=DATA, reference=2000.0, dataset={"token_ids_sha256": DATA},
                          work=tmp_path / "work")

    def train_head(ctx, trainer, conf, seed):
        name = protocol.head_name(trainer, conf["name"], seed)
        calls["trained"].append(name)
        (tmp_path / "exports" / name).mkdir(parents=True, exist_ok=True)
        return {"export": str(tmp_path / "exports" / name), "speed": {"steps": calls["steps"], "tokens_per_step":
                2010.0}, "settings": conf["overrides"], "train_seconds": 1.0, "log": "log.txt", "layers": 1}

    def judge_head(ctx, head, role):
        calls["judged"].append((head["head"], role))
        return figures({"recipe": 1.5, "mt-bench": 1.6}), list(calls["problems"])

    monkeypatch.setattr(protocol, "prepare", lambda grid, work: ctx)
    monkeypatch.setattr(protocol, "this_processor", lambda: "cpu-x")  # the processor the test heads were made on
    monkeypatch.setattr(protocol, "train_head", train_head)
    monkeypatch.setattr(protocol, "judge_head", judge_head)
    return calls


def main(tmp_path, *args: str) -> int:
    return protocol.main([*args, "--results", str(tmp_path / "heads"), "--work", str(tmp_path / "work")])


def test_a_run_skips_a_finished_head_and_trains_one_of_other_data_again(tmp_path, stand_ins, capsys):
    (tmp_path / "done").mkdir()
    write(tmp_path / "heads", head("ours", "recipe", 0, dev=1.7, export=tmp_path / "done"),
          head("ours", "random-start", 0, OTHER, dev=1.6, export=tmp_path / "done"))
    assert main(tmp_path, "--stage", "dev", "--only", "ours", "--leave-out") == 0
    assert stand_ins["trained"] == ["ours-floor0-s0", "ours-two-layers-s0"]
    assert "ours-random-start-s0 left out: trained on other data (bbbbbbbbbbbb)" in capsys.readouterr().out
    assert main(tmp_path, "--stage", "dev", "--only", "ours") == 0
    assert stand_ins["trained"][2:] == ["ours-random-start-s0"]  # then the finished ones are skipped
    again = json.loads((tmp_path / "heads" / "ours-random-start-s0.json").read_text())
    assert again["dataset"]["token_ids_sha256"] == DATA and again["dev"]["mean_tau"] == pytest.approx(1.55, abs=0.05)
    assert again["budget"]["tokens_per_step"] == 2010.0 and again["configuration"]["steps"] == 150
    assert ("ours-recipe-s0", "dev") not in stand_ins["judged"]


def test_on_another_processor_kind_a_stage_stops_before_the_data_and_leaves_the_tables_heads(tmp_path, stand_ins,
                                                                                             monkeypatch, capsys):
    write(tmp_path / "heads", head("ours", "recipe", 0, dev=1.7))
    monkeypatch.setattr(protocol, "this_processor", lambda: "cpu-y")
    made = protocol.prepare
    monkeypatch.setattr(protocol, "prepare", lambda grid, work: pytest.fail("the data was made"))
    before = (tmp_path / "heads" / "ours-recipe-s0.json").read_text()
    for stage in ("dev", "best", "test"):
        assert main(tmp_path, "--stage", stage, "--only", "ours") == 1
        assert re.search(r"made on cpu-x \(data a{12} \(cpu-x: 1 heads\)\); this machine is cpu-y", capsys.readouterr().err)
    assert stand_ins["trained"] == [] and (tmp_path / "heads" / "ours-recipe-s0.json").read_text() == before
    monkeypatch.setattr(protocol, "prepare", made)  # a table of this processor kind goes in a folder of its own
    assert protocol.main(["--stage", "dev", "--only", "ours", "--max-heads", "1", "--results",
                          str(tmp_path / "heads-y"), "--work", str(tmp_path / "work")]) == 0
    assert stand_ins["trained"] == ["ours-recipe-s0"]
    assert json.loads((tmp_path / "heads-y" / "ours-recipe-s0.json").read_text())["processor"] == "cpu-y"


def test_a_later_session_without_the_exports_keeps_the_figures_in_the_jsons(tmp_path, stand_ins):
    """The exports live under runs/ (not committed): a fresh clone skips the heads judged on dev, and the test
    stage trains the best configuration's seed 0 again for its export, keeping its dev figures."""
    write(tmp_path / "heads", *(head("ours", c["name"], 0, dev=1.5 + 0.1 * (c["name"] == "floor0"))
                                for c in GRID["trainers"]["ours"]["configs"]))  # no export anywhere
    assert main(tmp_path, "--stage", "dev", "--only", "ours") == 0
    assert stand_ins["trained"] == [] and stand_ins["judged"] == []
    assert main(tmp_path, "--stage", "best", "--only", "ours") == 0
    assert stand_ins["trained"] == ["ours-floor0-s1", "ours-floor0-s2"]
    assert main(tmp_path, "--stage", "test", "--only", "ours") == 0
    assert stand_ins["trained"][2:] == ["ours-floor0-s0"]  # seeds 1 and 2 still have their exports
    again = json.loads((tmp_path / "heads" / "ours-floor0-s0.json").read_text())
    assert again["dev"]["mean_tau"] == pytest.approx(1.6) and again["dev"]["judged_before_retraining"]
    assert again["test"] is not None


def test_the_test_stage_trains_a_best_seed_the_best_stage_left_once_and_judges_it_on_dev_then_test(tmp_path,
                                                                                                  stand_ins):
    write(tmp_path / "heads", *(head("ours", c["name"], 0, dev=1.5 + 0.1 * (c["name"] == "floor0"))
                                for c in GRID["trainers"]["ours"]["configs"]))
    assert main(tmp_path, "--stage", "test", "--only", "ours") == 0
    assert stand_ins["trained"] == ["ours-floor0-s0", "ours-floor0-s1", "ours-floor0-s2"]  # each once
    assert stand_ins["judged"] == [("ours-floor0-s0", "test"), ("ours-floor0-s1", "dev"), ("ours-floor0-s1", "test"),
                                   ("ours-floor0-s2", "dev"), ("ours-floor0-s2", "test")]
    s1 = json.loads((tmp_path / "heads" / "ours-floor0-s1.json").read_text())
    assert s1["dev"]["mean_tau"] and s1["test"]["mean_tau"] and "judged_before_retraining" not in s1["dev"]


def test_the_best_configuration_has_the_highest_mean_dev_tau_and_a_tie_goes_to_the_first_listed():
    taus = {"defaults": 1.60, "defaults-lk": 1.65, "matched": 1.65, "matched-lk": 1.62}
    heads = {h["head"]: h for h in (head("speculators", c, 0, dev=t) for c, t in taus.items())}
    assert protocol.best_config(heads, GRID, "speculators") == "defaults-lk"
    heads["speculators-matched-s0"] = head("speculators", "matched", 0, dev=1.66)
    assert protocol.best_config(heads, GRID, "speculators") == "matched"
    del heads["speculators-defaults-s0"]
    with pytest.raises(protocol.ProtocolError, match="speculators-defaults-s0: no dev figures.*--stage dev"):
        protocol.best_config(heads, GRID, "speculators")


def test_a_step_count_other_than_asked_stops_the_run_naming_the_head(tmp_path, stand_ins, capsys):
    stand_ins["steps"] = 149
    assert main(tmp_path, "--stage", "dev", "--only", "specforge") == 1
    assert "protocol: specforge-defaults-s0: 149 optimizer steps made, 150 asked" in capsys.readouterr().err
    assert not (tmp_path / "heads" / "specforge-defaults-s0.json").exists()


def test_greedy_output_beyond_a_near_tie_stops_the_run_naming_the_head(tmp_path, stand_ins, capsys):
    stand_ins["problems"] = ["mt-bench prompt 3: position 17, top-2 gap 2.5"]
    assert main(tmp_path, "--stage", "dev", "--only", "ours") == 1
    err = capsys.readouterr().err
    assert "ours-recipe-s0: greedy output differs from vLLM's target alone beyond a near-tie (dev)" in err
    assert "mt-bench prompt 3: position 17" in err
    failed = json.loads((tmp_path / "heads" / "ours-recipe-s0.json").read_text())
    assert failed["error"]["role"] == "dev" and "mt-bench prompt 3" in failed["error"]["what"]
    assert stand_ins["trained"] == ["ours-recipe-s0"]
    stand_ins["problems"] = []  # judged again (not trained again), and passed: the error goes
    assert main(tmp_path, "--stage", "dev", "--only", "ours") == 0
    assert "error" not in json.loads((tmp_path / "heads" / "ours-recipe-s0.json").read_text())
    assert stand_ins["trained"][0] == "ours-recipe-s0" and stand_ins["trained"].count("ours-recipe-s0") == 1


def test_near_ties_names_a_mismatch_where_the_target_is_not_tied(tmp_path):
    from judge import near_ties
    from mtp_train.config import compose
    from mtp_train.inference.runner import load_runner

    cfg = compose("tiny", [f"run_dir={tmp_path}"])
    prompt = [1, 5, 9, 14, 3]
    logits = load_runner(cfg.target.path, cfg.target).model(input_ids=torch.tensor([prompt])).logits[0, -1]
    top = torch.topk(logits, 3)
    head_token = int(top.indices[2])  # the target's third choice: no near-tie, whatever the gap
    sets = [SimpleNamespace(name="mt-bench", prompts=[prompt])]
    same = {"mt-bench": {"mismatched": []}}
    assert near_ties(same, sets, cfg) == []
    found = {"mt-bench": {"mismatched": [{"prompt": 0, "head": [head_token], "target": [int(top.indices[0])]}]}}
    problems = near_ties(found, sets, cfg)
    assert len(problems) == 1 and problems[0].startswith("mt-bench prompt 0: position 0, top-2 gap ")
    assert problems[0].endswith("not the runner-up") and found["mt-bench"]["mismatched"][0]["near_tie"] is False


# -- the intervals and the table --------------------------------------------------------------------------------------
def test_a_head_judged_by_vllm_otherwise_is_left_out_of_the_table():
    from table import split_heads

    def judged(name: str, options: list[str]) -> dict:
        h = head(*name.rsplit("-s", 1)[0].split("-", 1), int(name[-1]), dev=1.5)
        h["dev"]["settings"] = {"k": 5, "served": f"/runs/{name}/served", "options": options}
        return h

    batched = ["--max-num-seqs", "16", "--per-prompt"]
    heads = {n: judged(n, batched) for n in ("ours-recipe-s0", "speculators-matched-s0", "specforge-defaults-s0")}
    heads["ours-floor0-s0"] = judged("ours-floor0-s0", ["--max-num-seqs", "1", "--per-prompt"])
    heads["ours-two-layers-s0"] = head("ours", "two-layers", 0)  # not judged yet: nothing to compare
    kept, left, digest, _ = split_heads(heads)
    assert digest == DATA and sorted(kept) == ["ours-recipe-s0", "ours-two-layers-s0", "specforge-defaults-s0",
                                               "speculators-matched-s0"]
    assert list(left) == ["ours-floor0-s0"] and '"1"' in left["ours-floor0-s0"] and '"16"' in left["ours-floor0-s0"]


def test_the_two_level_bootstrap_of_identical_seeds_is_the_one_level_interval():
    rng = random.Random(1)
    den = [rng.randint(20, 40) for _ in range(30)]
    num = [d + rng.randint(5, 30) for d in den]
    one = ratio_interval(num, den, seed=7)
    three = seeds_interval([num] * 3, [den] * 3, seed=7)
    assert three == pytest.approx(one, rel=1e-12) and one["low"] < one["value"] < one["high"]
    assert seeds_interval([num] * 3, [den] * 3, seed=7) == three  # seeded: the same every time
    # seeds that differ widen it: the seed spread (τ 1.4 .. 1.9) outweighs the prompts'
    spread = [[round(d * f) for d in den] for f in (1.4, 1.65, 1.9)]
    two = seeds_interval(spread, [den] * 3, seed=7)
    flat = ratio_interval([x for row in spread for x in row], den * 3, seed=7)
    assert two["high"] - two["low"] > 5 * (flat["high"] - flat["low"])


def test_the_table_comes_from_the_jsons_and_names_a_head_left_out(tmp_path, capsys):
    folder = tmp_path / "heads"
    dev = {"ours": {"recipe": 1.80, "random-start": 1.60, "floor0": 1.78, "two-layers": 1.79},
           "speculators": {"defaults": 1.55, "defaults-lk": 1.60, "matched": 1.62, "matched-lk": 1.64},
           "specforge": {"defaults": 1.40, "defaults-lk": 1.42, "matched": 1.58, "matched-lk": 1.57}}
    test = {"ours": 1.9, "speculators": 1.7, "specforge": 1.6}
    for trainer, configs in dev.items():
        best = max(configs, key=configs.get)
        for config, tau in configs.items():
            write(folder, head(trainer, config, 0, dev=tau, test={s: test[trainer] for s in TEST_SETS}
                               if config == best else None))
        for seed in (1, 2):
            write(folder, head(trainer, best, seed, test={s: test[trainer] + 0.02 * seed for s in TEST_SETS}))
    write(folder, head("specforge", "defaults", 1, OTHER, dev=1.3))
    assert main(tmp_path, "--table") == 1
    out, err = capsys.readouterr()
    assert "left out: specforge-defaults-s1: other data (sha256 bbbbbbbbbbbb)" in out and "--leave-out" in err
    assert main(tmp_path, "--table", "--leave-out") == 0
    table = json.loads((tmp_path / "heads-table.json").read_text())
    assert table["dataset_sha256"] == DATA and list(table["left_out"]) == ["specforge-defaults-s1"]
    ours = table["trainers"]["ours"]
    assert ours["configuration"] == "recipe" and ours["heads"] == ["ours-recipe-s0", "ours-recipe-s1",
                                                                   "ours-recipe-s2"]
    assert table["trainers"]["speculators"]["configuration"] == "matched-lk"
    rows = [json.loads((folder / f"{n}.json").read_text())["test"]["sets"]["sharegpt-test"]["per_prompt"]
            for n in ours["heads"]]
    steps = sum(p["steps"] for r in rows for p in r)
    s = ours["sets"]["sharegpt-test"]
    assert s["tau"]["value"] == pytest.approx(sum(p["steps"] + sum(p["accepted"]) for r in rows for p in r) / steps)
    assert s["tau3"]["value"] == pytest.approx(sum(p["steps"] + sum(p["accepted"][:3]) for r in rows for p in r)
                                               / steps)
    assert s["prompts"] == 6 and s["seeds"] == 3 and s["tau"]["low"] <= s["tau"]["value"] <= s["tau"]["high"]
    ratio = table["ratios"]["sharegpt-test"]
    peer = table["trainers"]["speculators"]["sets"]["sharegpt-test"]["tau"]["value"]
    assert ratio["peer"] == "speculators" and ratio["value"] == pytest.approx(s["tau"]["value"] / peer)
    assert ratio["low"] < ratio["value"] < ratio["high"]
    means = {t: sum(table["trainers"][t]["sets"][x]["tau"]["value"] for x in TEST_SETS) / len(TEST_SETS)
             for t in ("ours", "speculators")}
    assert table["trainers"]["ours"]["mean"]["tau"]["value"] == pytest.approx(means["ours"])
    pooled = table["ratios"]["mean of the test sets"]  # the goal's figure, over the peer best on the mean
    assert pooled["peer"] == "speculators" and pooled["value"] == pytest.approx(means["ours"] / means["speculators"])
    assert pooled["low"] < pooled["value"] < pooled["high"]
    per_set = [table["ratios"][x] for x in TEST_SETS]  # three sets' prompts: narrower than one set's
    assert pooled["high"] - pooled["low"] < max(r["high"] - r["low"] for r in per_set)


def test_a_served_export_is_rounded_through_bfloat16(tmp_path):
    from safetensors.torch import load_file, save_file

    from judge import round_through_bf16

    src = tmp_path / "export"
    src.mkdir()
    weights = {"w": torch.tensor([1.0 + 2 ** -10, 3.14159265, -1e-3]), "d2t": torch.tensor([0, 7, 9])}
    save_file(weights, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"draft_vocab_size": 3}')
    torch.save({"state": 1}, src / "optimizer_state_dict.pt")
    out = round_through_bf16(src, tmp_path / "served")
    got = load_file(str(out / "model.safetensors"))
    assert got["w"].dtype == torch.float32 and torch.equal(got["w"], weights["w"].bfloat16().float())
    assert got["w"][0] == 1.0 and torch.equal(got["d2t"], weights["d2t"])
    assert (out / "config.json").read_text() == '{"draft_vocab_size": 3}'
    assert not (out / "optimizer_state_dict.pt").exists()  # optimizer states are not served
    again = round_through_bf16(out, tmp_path / "twice")  # bf16 values stay as they are
    assert torch.equal(load_file(str(again / "model.safetensors"))["w"], got["w"])
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert round_through_bf16(src, tmp_path / "served") == out  # up to date: not written again
    assert (out / "model.safetensors").stat().st_mtime_ns == written


# -- the JSON fields the earlier benchmarks wrote wrong ---------------------------------------------------------------
def test_trainer_speed_sets_each_peer_against_ours_with_as_many_layers():
    from trainer_speed import layer_count, like_for_like

    median = {"ours": 870.0, "speculators": 372.0, "ours-nl2": 653.0, "specforge": 420.0}
    layers = {"ours": 1, "ours-nl2": layer_count(["train.seed=0", "head.num_layers=2"]), "speculators": 2,
              "specforge": 1}
    like = like_for_like(median, layers)
    assert like["speculators"] == {"ours": "ours-nl2", "layers": 2, "ratio": pytest.approx(653 / 372)}
    assert like["specforge"]["ours"] == "ours" and like_for_like({"speculators": 1.0}, {"speculators": 1}) == {}


def test_trainer_speed_ratios_with_the_profiled_kernels_taken_out():
    """The peer's attention and loss (its CPU fallbacks) taken out of its time, then both sides': a peer 2x slower
    whose fallbacks are 60% of its step is 0.8x ours without them; ours with 20% in the same kernels, 1.0x; the
    peer given ours' 20% in place of its 60%, 1.0x."""
    from trainer_speed import like_for_like

    profiles = {"ours": {"share_total": 0.2}, "speculators": {"share_total": 0.6}}
    like = like_for_like({"ours": 1000.0, "speculators": 500.0}, {"ours": 1, "speculators": 1}, profiles)
    assert like["speculators"]["ratio"] == pytest.approx(2.0)
    assert like["speculators"]["ratio_peer_kernels_out"] == pytest.approx(0.8)
    assert like["speculators"]["ratio_kernels_out"] == pytest.approx(1.0)
    # the peer given ours' kernels: its 0.8 outside them, ours' 0.2 in them
    assert like["speculators"]["ratio_peer_with_ours"] == pytest.approx(0.8 + 0.2)
    assert "ratio_kernels_out" not in like_for_like({"ours": 1.0, "speculators": 1.0},
                                                    {"ours": 1, "speculators": 1})["speculators"]  # not profiled


def test_a_rejudging_records_each_heads_own_settings_and_every_speculators_rows(tmp_path):
    import side_by_side as sbs

    spec = tmp_path / "speculators-norms"
    (spec / "checkpoints" / "2").mkdir(parents=True)
    (spec / "record.json").write_text(json.dumps({"argv": ["--total-seq-len", "2482", "--lr", "0.002"]}))
    ours = tmp_path / "ours-nout"
    (ours / "export" / "eagle3").mkdir(parents=True)
    (ours / "trained.json").write_text(json.dumps(["head.norm_output=true", "train.lr=0.002"]))
    heads = {"speculators-norms": {"export": spec / "checkpoints" / "2", "judged_only": True, "speed": None},
             "ours-nout": {"export": ours / "export" / "eagle3", "judged_only": True, "speed": None},
             "mtp": {"export": tmp_path / "elsewhere" / "vllm-mtp", "judged_only": True, "speed": None}}
    out = tmp_path / "rejudge.json"
    sbs.save(out, SimpleNamespace(steps=50, lr=2e-3), ["train.steps=50"], None, heads, None)
    saved = json.loads(out.read_text())
    assert saved["matched_overrides"] is None  # the re-judging command's defaults are no head's settings
    assert saved["speculators_total_seq_len"] == {"speculators-norms": 2482}
    assert saved["heads"]["ours-nout"]["settings"]["overrides"] == ["head.norm_output=true", "train.lr=0.002"]
    assert saved["heads"]["mtp"]["settings"]["settings"] is None and "made elsewhere" in \
        saved["heads"]["mtp"]["settings"]["why"]
    trained = {"speculators-2l": {"export": spec, "speed": None, "total_seq_len": 2300, "settings": ["--seed", "0"]}}
    sbs.save(out, SimpleNamespace(steps=50), ["train.steps=50"], None, trained, None)
    assert json.loads(out.read_text())["speculators_total_seq_len"] == {"speculators-2l": 2300}


# -- the trainers' speed (speed.py) without training --------------------------------------------------------------
def test_speed_windows_lie_in_epochs_one_and_two_and_are_checked():
    import speed

    s = GRID["speed"]
    assert speed.windows(50, s) == [(s["warmup"] + 1, s["warmup"] + s["window"]), (51, 50 + s["window"])]
    with pytest.raises(protocol.ProtocolError, match="raise speed.rows"):
        speed.windows(s["warmup"] + s["window"] - 1, s)
    wins = [(2, 3), (5, 6)]
    ends = [1.0, 2.0, 3.0, 4.0, 10.0, 11.0]  # 5 s between steps 4 and 5: a peer's validation between epochs
    assert speed.check_epochs("ours", wins, [0, 0, 0, 0, 1, 1], None, ends) == "the epoch logged at each step"
    with pytest.raises(protocol.ProtocolError, match="expected 0 and 1"):  # the second window started in epoch 1
        speed.check_epochs("ours", wins, [0, 0, 0, 0, 0, 1], None, ends)
    assert "after step 4" in speed.check_epochs("speculators", wins, None, [[4.5, 9.5]], ends)
    with pytest.raises(protocol.ProtocolError, match="no checkpointing or validation between steps 4 and 5"):
        speed.check_epochs("speculators", wins, None, [[2.5, 2.7]], ends)
    # tokens/s of steps 5..6: 20 tokens over the 7 s from the end of step 4, less the 5 s of validation in them
    import side_by_side as sbs

    assert sbs.window_speed(ends, [10] * 6, [[4.5, 9.5]], 5, 6) == pytest.approx(20 / 2)
    assert sbs.window_speed(ends, [10] * 6, [], 2, 3) == pytest.approx(20 / 2)
    # the whole run's speed is the window of steps 2..N: 50 tokens over the 10 s after step 1, less 5 s outside
    assert sbs.speed(ends, [10] * 6, [[4.5, 9.5]])["tokens_per_s"] == pytest.approx(50 / 5)


def test_the_peer_launchers_return_their_records_steps_and_profile_only_the_run_just_made(tmp_path, monkeypatch):
    import side_by_side as sbs

    launched = []

    def fake_run(cmd, log):  # the launcher: its record (3 steps, validation between 2 and 3), a checkpoint, a profile
        launched.append(cmd)
        out = log.parent
        (out / "checkpoints" / "3").mkdir(parents=True, exist_ok=True)
        (out / "export-hf").mkdir(exist_ok=True)
        (out / "export-hf" / "config.json").write_text("{}")
        argv = cmd[cmd.index("--") + 1:] if "--" in cmd and "run_speculators.py" in cmd[1] else cmd
        (out / "record.json").write_text(json.dumps({"argv": argv, "step_end_s": [1.0, 2.0, 5.0], "step_tokens": [
            10, 10, 10], "outside_s": [[2.5, 4.0]], "adjustments": {
                sbs.MUON_ADJUSTMENT: {"calls": 3}} if "--muon-fp32-gemms" in cmd else {}}))
        if "--profile" in cmd:
            (out / "profile.json").write_text(json.dumps({"results": [{"share_total": 0.5}], "run": len(launched)}))

    import mtp_train.data.regen_engines as regen

    monkeypatch.setattr(regen, "read_cpuinfo", lambda: "flags\t\t: fpu avx2\n")  # no AMX: Muon by fp32 GEMMs
    monkeypatch.setattr(sbs, "run", fake_run)
    args = SimpleNamespace(micro_batch=2, steps=3, reuse=True, seed=0, peer_layers=1, mask_token_id=2, lr=2e-3,
                           warmup=1, depth=3)
    peers = {"mean_train_length": 5, "tokens": {"train": 100}, "target": "t", "draft_vocab": 8,
             "aux_layers": [1, 2, 3], "train_data_ratio": 0.9, "speculators": {"dir": "d", "d2t": "a", "t2d": "b"}}
    h = sbs.speculators(args, peers, tmp_path, profile=[(2, 3)])
    assert h["steps"] == {"ends": [1.0, 2.0, 5.0], "tokens": [10, 10, 10], "outside": [[2.5, 4.0]]}
    assert h["speed"]["tokens_per_s"] == pytest.approx(20 / 2.5) and h["profile"]["run"] == 1
    # a profiled run is never reused, and the profile it returns is its own: a stale one is removed before it runs
    (tmp_path / "speculators" / "profile.json").write_text(json.dumps({"results": [], "run": "stale"}))
    monkeypatch.setattr(sbs, "run", lambda cmd, log: fake_run([c for c in cmd if c != "--profile"], log))
    with pytest.raises(RuntimeError, match="wrote no profile.json"):  # a launcher that wrote none this time
        sbs.speculators(args, peers, tmp_path, profile=[(2, 3)])
    assert len(launched) == 2
    monkeypatch.setattr(sbs, "run", fake_run)
    assert "profile" not in sbs.speculators(args, peers, tmp_path)  # unprofiled: the same run reused
    assert len(launched) == 2 and all("--muon-fp32-gemms" in cmd[:cmd.index("--")] for cmd in launched)
    monkeypatch.setattr(regen, "read_cpuinfo", lambda: "flags\t\t: fpu amx_bf16 amx_tile\n")  # AMX: as released,
    sbs.speculators(args, peers, tmp_path)  # so the run made with the adjustment is not reused
    assert len(launched) == 3 and "--muon-fp32-gemms" not in launched[-1]
    sbs.speculators(args, peers, tmp_path)
    assert len(launched) == 3
    f = sbs.specforge(args, tmp_path / "peers.json", tmp_path, profile=[(2, 3)])
    assert f["steps"]["outside"] is None and f["steps"]["ends"] == [1.0, 2.0, 5.0] and f["profile"]["run"] == 4


def test_speed_summary_gives_each_epochs_ratio_with_its_spread_and_the_kernels_taken_out():
    import speed

    rounds = [{"ours": {"epoch1": 600.0, "epoch2": 900.0}, "speculators": {"epoch1": 400.0, "epoch2": 400.0}},
              {"ours": {"epoch1": 660.0, "epoch2": 800.0}, "speculators": {"epoch1": 300.0, "epoch2": 400.0}},
              {"ours": {"epoch1": 630.0, "epoch2": 1000.0}, "speculators": {"epoch1": 420.0, "epoch2": 500.0}}]
    window = lambda share: {"share_total": share}  # noqa: E731
    profiles = {"ours": {"results": [window(0.2), window(0.1)]},
                "speculators": {"results": [window(0.6), window(0.5)]}}
    s = speed.summary(rounds, profiles, {"ours": "recipe", "speculators": "defaults"})
    assert s["tokens_per_s"]["ours"]["epoch2"] == {"median": 900.0, "min": 800.0, "max": 1000.0}
    e1 = s["ours_over"]["speculators"]["epoch1"]
    assert (e1["median"], e1["min"], e1["max"]) == pytest.approx((1.5, 1.5, 2.2))  # per round: 1.5, 2.2, 1.5
    assert e1["peer_kernels_out"] == pytest.approx(1.5 * 0.4)  # the peer's 60% of attention and loss taken out
    assert e1["kernels_out"] == pytest.approx(1.5 * 0.4 / 0.8)  # and ours' 20%
    # the peer given ours' attention and loss: per token ours takes 1 unit, the peer 1.5 of which 0.9 in them
    assert e1["peer_with_ours"] == pytest.approx(1.5 * 0.4 + 0.2)
    e2 = s["ours_over"]["speculators"]["epoch2"]
    assert e2["median"] == pytest.approx(2.0) and e2["kernels_out"] == pytest.approx(2.0 * 0.5 / 0.9)
    assert "kernels_out" not in speed.summary(rounds, {}, {"ours": "recipe", "speculators": "d"})["ours_over"][
        "speculators"]["epoch1"]


def test_speed_times_ours_at_its_best_and_at_its_recipes_head_against_each_peer():
    import speed

    assert speed.timed({"ours": "recipe", "speculators": "d"}) == {"ours": "recipe", "speculators": "d"}
    chosen = speed.timed({"specforge": "m", "ours": "two-layers", "speculators": "d"})
    assert list(chosen.items()) == [("ours", "two-layers"), ("ours-recipe", "recipe"), ("speculators", "d"),
                                    ("specforge", "m")]  # the order of a round
    rounds = [{"ours": {"epoch1": 500.0, "epoch2": 600.0}, "ours-recipe": {"epoch1": 700.0, "epoch2": 800.0},
               "speculators": {"epoch1": 350.0, "epoch2": 400.0}, "specforge": {"epoch1": 250.0, "epoch2": 200.0}}]
    s = speed.summary(rounds, {}, chosen)
    assert s["ours_over"]["speculators"]["epoch1"]["median"] == pytest.approx(500 / 350)
    assert s["recipe_over"]["speculators"]["epoch1"]["median"] == pytest.approx(2.0)
    assert s["recipe_over"]["specforge"]["epoch2"]["median"] == pytest.approx(4.0)
    assert "ours-recipe" not in s["ours_over"] and set(s["recipe_over"]) == {"speculators", "specforge"}


def test_speed_on_another_processor_times_the_configurations_chosen_on_the_tables_data():
    import speed

    heads = {h["head"]: h for h in (head("ours", "recipe", 0, dev=1.3), head("ours", "two-layers", 0, dev=1.4))}
    assert speed.chosen_on(heads, DATA, None) == DATA  # this machine's data chose
    with pytest.raises(protocol.ProtocolError, match=r"no head of this machine's data \(bbbbbbbbbbbb\).*"
                                                     r"aaaaaaaaaaaa \(cpu-x: 2 heads\).*--chosen-on"):
        speed.chosen_on(heads, OTHER, None)  # another processor's data: the choice is named, not guessed
    assert speed.chosen_on(heads, OTHER, "aaaaaa") == DATA
    for prefix, matched in (("cccccc", 0), ("", 1), ("aaa", 1)):  # none, and too short to name one
        with pytest.raises(protocol.ProtocolError, match=f"--chosen-on '{prefix}' matches {matched} datasets"):
            speed.chosen_on(heads, OTHER, prefix)
    # each processor kind keeps its own rounds
    assert speed.speed_path(Path("r"), "AMD EPYC") == Path("r/speed-amd-epyc.json")
    assert speed.speed_path(Path("r"), "Intel(R) Xeon(R) Processor") == Path("r/speed-intel-xeon-processor.json")


def test_speed_names_the_muon_runs_whose_bf16_products_a_cpu_without_amx_computes_by_fp32_gemms():
    import speed

    def conf(trainer, name):
        return protocol.configuration(GRID, trainer, name)

    assert speed.bf16_optimizer("speculators", conf("speculators", "defaults-lk"))  # its default: Muon
    assert not speed.bf16_optimizer("speculators", conf("speculators", "matched"))  # --optimizer adamw
    assert not speed.bf16_optimizer("ours", conf("ours", "two-layers"))
    amx, plain = "flags\t\t: fpu sse avx512f amx_bf16 amx_tile\n", "flags\t\t: fpu sse avx2\n"
    muon = {"ours": "two-layers", "speculators": "defaults-lk"}
    assert speed.kernels(GRID, muon, amx) == {}  # AMX: torch's bf16 GEMMs at their speed, as released
    assert speed.kernels(GRID, {"ours": "two-layers", "speculators": "matched"}, plain) == {}  # no Muon
    assert speed.kernels(GRID, muon, plain) == {"muon_fp32_gemms": ["speculators"]}


def test_muon_cpu_computes_torchs_bf16_newton_schulz_by_fp32_gemms_and_the_same_in_fp32():
    """newton_schulz(between=bfloat16), what run_speculators.py --muon-fp32-gemms runs in place of torch.optim.Muon's
    iterations on a CPU without AMX, holds the values of torch's bf16 iterations: one iteration gives the same
    bits; five, summation orders apart, ten times closer to torch's than the fp32 iterations are."""
    from torch.optim._muon import DEFAULT_NS_STEPS, _zeropower_via_newtonschulz

    import muon_cpu

    gen = torch.Generator().manual_seed(0)
    for shape in ((48, 96), (96, 48), (64, 64)):  # wide, tall (transposed inside) and square
        g = torch.randn(shape, generator=gen)

        def torchs(steps):
            return _zeropower_via_newtonschulz(g, muon_cpu.NS_COEFFICIENTS, steps, 1e-7)

        one = muon_cpu.newton_schulz(g, 1, between=torch.bfloat16)
        assert one.dtype == torch.bfloat16 and torch.equal(one, torchs(1))
        theirs = torchs(DEFAULT_NS_STEPS).float()
        gemms = muon_cpu.newton_schulz(g, DEFAULT_NS_STEPS, between=torch.bfloat16).float()
        fp32 = muon_cpu.newton_schulz(g, DEFAULT_NS_STEPS)
        assert fp32.dtype == torch.float32 and theirs.shape == fp32.shape == gemms.shape

        def dist(x):
            return float((x - theirs).norm() / theirs.norm())

        assert dist(fp32) < 0.03  # bf16's rounding apart
        assert dist(gemms) < dist(fp32) / 4, (dist(gemms), dist(fp32))
        assert (fp32 - g / g.norm()).norm() / fp32.norm() > 0.5  # and not the input: it was orthogonalised


def test_the_speed_stage_stops_before_any_data_on_another_kind(tmp_path, monkeypatch, capsys):
    import speed

    import mtp_train.data.regen_engines as regen

    write(tmp_path / "heads", *(head(t, c["name"], 0, dev=1.3 + 0.01 * i) for t in protocol.TRAINERS
                                for i, c in enumerate(GRID["trainers"][t]["configs"])))  # best: each's last listed
    made = []
    monkeypatch.setattr(protocol, "this_processor", lambda: "cpu-y")
    monkeypatch.setattr(protocol, "subset_data", lambda grid, work: made.append("subset"))
    monkeypatch.setattr(protocol, "prepare", lambda grid, work: made.append("prepare"))
    monkeypatch.setattr(regen, "read_cpuinfo", lambda: "flags\t\t: fpu avx2\n")  # no AMX
    assert main(tmp_path, "--stage", "speed") == 1  # the heads are of cpu-x: which choice to time?
    assert "give --chosen-on HASH" in capsys.readouterr().err and made == []
    write(tmp_path / "heads", head("speculators", "defaults-lk", 0, dev=1.9))  # speculators' best: Muon

    def prepared(grid, work):
        made.append("prepare")
        raise protocol.ProtocolError("prepared")

    monkeypatch.setattr(protocol, "prepare", prepared)  # Muon without AMX no longer stops it: its products by fp32
    assert main(tmp_path, "--stage", "speed", "--chosen-on", DATA[:12]) == 1  # GEMMs (run_speculators.py)
    assert "protocol: prepared" in capsys.readouterr().err and made == ["prepare"]


def test_the_speed_stage_resumes_a_round_cut_off_from_the_runs_it_kept(tmp_path, monkeypatch, capsys):
    import speed

    import mtp_train.data.regen_engines as regen

    write(tmp_path / "heads", *(head("ours", c["name"], 0, dev=1.4 if c["name"] == "two-layers" else 1.3)
                                for c in GRID["trainers"]["ours"]["configs"]))  # best: two-layers, then the recipe's
    monkeypatch.setattr(protocol, "this_processor", lambda: "cpu-x")
    monkeypatch.setattr(regen, "read_cpuinfo", lambda: "flags\t\t: fpu avx2 amx_tile\n")
    ctx = SimpleNamespace(grid=GRID, lengths=[250] * 400, reference=2000.0, dataset={"token_ids_sha256": DATA},
                          work=tmp_path / "work")
    monkeypatch.setattr(protocol, "prepare", lambda grid, work: ctx)
    ran, stop_at = [], [3]

    def run_trainer(ctx, label, config, work, epoch1, profile=None):  # 90 steps of 2,000 tokens, 2 s or 1 s each
        if len(ran) == stop_at[0]:
            raise protocol.ProtocolError("the session ended")
        ran.append(label)
        step = 2.0 if label == "ours" else 1.0
        return {"ends": [step * (i + 1) for i in range(epoch1 + 40)], "tokens": [2000] * (epoch1 + 40),
                "epochs": [0] * epoch1 + [1] * 40, "outside": None,
                "profile": {"results": [{"share_total": 0.1}, {"share_total": 0.1}]} if profile else None}

    monkeypatch.setattr(speed, "run_trainer", run_trainer)
    stage = ("--stage", "speed", "--only", "ours", "--chosen-on", DATA[:12])
    assert main(tmp_path, *stage) == 1  # cut off in round 2, after its first run
    rec = json.loads(speed.speed_path(tmp_path / "heads", "cpu-x").read_text())
    assert ran == ["ours", "ours-recipe", "ours"] and len(rec["rounds"]) == 1
    assert list(rec["partial_round"]) == ["ours"] and rec["partial_round"]["ours"]["epoch1"] == pytest.approx(1000)
    stop_at[0] = None
    assert main(tmp_path, *stage) == 0
    assert "round 2/5: ours (two-layers) ran before this run" in capsys.readouterr().out
    # round 2 went on with ours-recipe, not a fresh ours: 5 rounds of 2 runs in all, and the 2 profile runs
    assert ran[3:] == ["ours-recipe"] + ["ours", "ours-recipe"] * 3 + ["ours", "ours-recipe"]
    rec = json.loads(speed.speed_path(tmp_path / "heads", "cpu-x").read_text())
    assert len(rec["rounds"]) == 5 and rec["partial_round"] == {}
    assert rec["summary"]["tokens_per_s"]["ours"]["epoch1"]["median"] == pytest.approx(1000)
    assert rec["summary"]["tokens_per_s"]["ours-recipe"]["epoch2"]["median"] == pytest.approx(2000)
