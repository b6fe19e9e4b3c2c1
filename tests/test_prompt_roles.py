"""Prompt sets by role: dev sets choose, test sets only report (`mtp-train test`), and neither may overlap the
training data or each other (mtp_train/data/overlap.py, mtp_train/validate/disjoint.py, testset.py)."""

import contextlib
import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from mtp_train.data import overlap
from mtp_train.data import prompt_sets as P
from mtp_train.validate.config import ValidateConfig


def test_overlap_finds_copies_inside_longer_texts_and_near_duplicates():
    index = overlap.TextIndex()
    index.add("System: be brief. User: Write a poem about the sea in the style of a pirate, please!", "train row 0")
    index.add("Explain how a transistor amplifies a signal, step by step, for a beginner.", "train row 1")
    assert overlap.prompt_key("Hello,   WORLD") == overlap.prompt_key("hello world!")
    found = index.find("write a POEM about the sea in the style of a pirate", "test 0")
    assert found.kind == "contained" and found.other == "train row 0" and found.share == 1.0
    near = index.find("Explain how a transistor amplifies a signal, step by step, for a child who is six.", "test 1")
    assert near.kind == "near" and near.other == "train row 1" and 0.5 <= near.share < 1
    assert "a near-duplicate" in str(near) and "train row 1" in str(near)
    assert index.find("Explain how a transistor works.", "test 2") is None
    assert index.find("What is the capital of France?", "test 3") is None
    exact = index.find("explain how a transistor amplifies a signal step by step for a beginner", "test 4")
    assert exact.kind == "same"
    index.add("User: hi. Please continue writing the story now, with a dragon.", "train row 2")
    index.add("Continue writing the story", "train row 3")
    assert index.find("hi", "short") is None  # fewer than NGRAM words: only an equal text counts
    assert index.find("continue writing the story!", "four words").other == "train row 3"
    assert index.find("please continue writing the story now", "five words").kind == "contained"
    assert [o.other for o in index.matches("continue writing the story now with a dragon", "m")] == ["train row 2"]
    assert [o.prompt for o in overlap.overlaps([("a pirate poem", "x"), ("write a poem about the sea in the style "
                                                                          "of a pirate", "y")], index)] == ["y"]


def test_roles_are_kept_apart_in_the_config():
    assert ValidateConfig().test_prompts == ["mt-bench-test", "sharegpt-test", "functions-test"]
    with pytest.raises(ValueError, match=r"mt-bench-test is a test set: test sets are only reported, by `mtp-train "
                                         r"test`"):
        ValidateConfig(prompts=["recipe", "mt-bench-test"])
    with pytest.raises(ValueError, match="mt-bench is a dev set"):
        ValidateConfig(test_prompts=["mt-bench"])
    with pytest.raises(ValueError, match="test_tree='3/2': expected steps/topk/num_draft_tokens"):
        ValidateConfig(test_tree="3/2")
    assert ValidateConfig(test_tree="3/2/4").tree_for_test().num_draft_tokens == 4
    assert ValidateConfig(test_prompts=["mine.jsonl"]).tree_for_test() is None


def test_mt_bench_dev_is_one_question_per_category_and_test_the_other_72(tmp_path, monkeypatch):
    categories = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps({"question_id": 81 + i, "category": categories[i // 10],
                                        "turns": [f"question {81 + i}", "second"]}) + "\n" for i in range(80)))
    monkeypatch.setattr(P, "fetch", lambda source: path)
    dev, _ = P.mt_bench("dev")
    test, what = P.mt_bench("test")
    assert [p.id for p in dev] == [str(i) for i in P.MT_BENCH_DEV_IDS]
    assert sorted({p.category for p in dev}) == sorted(categories)
    assert len(test) == 72 and not {p.id for p in dev} & {p.id for p in test} and "test questions" in what
    path.write_text("".join(json.dumps({"question_id": 200 + i, "turns": ["q"]}) + "\n" for i in range(80)))
    with pytest.raises(ValueError, match="0 MT-bench dev questions, expected 8"):
        P.mt_bench("dev")


def test_the_function_writing_test_draw_is_pinned_and_read_by_no_recipe():
    pinned = json.loads(P.FUNCTIONS_TEST.read_text())
    assert hashlib.sha256("\n".join(pinned["keys"]).encode()).hexdigest() == pinned["sha256"]
    assert len(pinned["keys"]) >= 48 == len(set(pinned["keys"]))
    prompts, what = P.functions_test()
    if pinned["python"].rsplit(".", 1)[0] == ".".join(map(str, __import__("sys").version_info[:2])):
        assert len(prompts) == len(pinned["keys"]) and "absent" not in what
    assert all(m["role"] != "assistant" for p in prompts for m in p.messages) and all(p.text for p in prompts)
    # no recipe reads them: every stdlib_chat source on the validation split, with its seed and place
    from mtp_train.config import available_recipes, compose
    from mtp_train.data.prepare import _subset
    from mtp_train.data.sources import BadRecord, read_source
    from mtp_train.data.config import SourceConfig

    records = list(dict.fromkeys(r.key() for r in read_source(SourceConfig("validation", "stdlib_chat"))
                                 if not isinstance(r, BadRecord)))
    for name in available_recipes():
        cfg = compose(name, [] if name.startswith("tiny") else ["target.path=/nonexistent"])
        for i, src in enumerate(cfg.data.sources):
            if src.format == "stdlib_chat" and src.path == "validation":
                read = set(_subset(records, src.limit, f"{cfg.seed}:{i}") if src.limit else records)
                assert not read & set(pinned["keys"]), name


def _prompt_file(path, texts):
    path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    return str(path)


def _a_training_prompt(run_dir, tokenizer):
    """The user text of the first training row (the function-writing prompt the head was trained on)."""
    import datasets

    row = datasets.load_from_disk(str(run_dir / "data" / "train"))[0]
    first = row["loss_mask"].index(1)
    text = tokenizer.decode(row["input_ids"][:first], skip_special_tokens=True)
    return text[text.index("Write `"):].rsplit("\n", 1)[0]


def test_dev_or_test_prompts_that_overlap_training_or_each_other_are_refused(trained_run, tmp_path, tiny_dir):
    from mtp_train.data.prompt_sets import load_set
    from mtp_train.model.target import load_tokenizer
    from mtp_train.validate.disjoint import check_disjoint

    tok = load_tokenizer(tiny_dir / "target")
    copied = _a_training_prompt(trained_run, tok)
    clean = ["What is the tallest mountain in Europe?", "Name three prime numbers above one hundred."]
    leak = load_set(_prompt_file(tmp_path / "leak.jsonl", [clean[0], copied]), "test", tok, 0, 512)
    dev = load_set(_prompt_file(tmp_path / "dev.jsonl", [clean[1]]), "dev", tok, 0, 512)
    with pytest.raises(ValueError, match=r"(?s)1 held-out prompts overlap .*leak.jsonl:2 is (contained in|the same text "
                                         r"as|a near-duplicate).*data/train row"):
        check_disjoint(trained_run / "data", tok, [dev], [leak])
    twice = load_set(_prompt_file(tmp_path / "twice.jsonl", [clean[1].upper()]), "test", tok, 0, 512)
    with pytest.raises(ValueError, match=r"(?s)test set .*twice.jsonl:1 is the same text as dev set .*dev.jsonl:1"):
        check_disjoint(trained_run / "data", tok, [dev], [twice])
    ok = load_set(_prompt_file(tmp_path / "ok.jsonl", clean[:1]), "test", tok, 0, 512)
    checked = check_disjoint(trained_run / "data", tok, [dev], [ok])
    assert checked["overlaps"] == 0 and checked["test_prompts"] == 1 and checked["train_rows"] == 96


def test_the_test_report_runs_at_the_chosen_setting_and_keeps_every_run(trained_run, tmp_path):
    from mtp_train.cli import main
    from tests.conftest import RUN_OVERRIDES

    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(trained_run, run_dir)
    prompts = _prompt_file(tmp_path / "t.jsonl", ["Write a function that adds two numbers.",
                                                   "Write a function that reverses a list.",
                                                   "Sort a dictionary by its values."])
    args = ["test", "recipe=tiny", f"run_dir={run_dir}", *RUN_OVERRIDES, f"validate.test_prompts=[{prompts}]",
            "validate.test_k=2"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0, out.getvalue()
    report = json.loads((run_dir / "validation" / "test.json").read_text())
    (s,) = report["sets"]
    assert report["setting"] == "k=2" and s["num_prompts"] == 3 and len(s["per_prompt"]) == 3
    assert s["tau"]["low"] <= s["tau"]["value"] <= s["tau"]["high"] and s["tau"]["value"] >= 1
    assert s["speedup"]["low"] <= s["speedup"]["value"] <= s["speedup"]["high"]
    assert len(s["acceptance_by_position_k5"]) == 5 and s["implied_tau"][0] == 1 + s["acceptance_by_position_k5"][0]
    assert all(not m["near_tie"] for m in s["greedy_mismatches"]) is (s["greedy_identical_prompts"] == 3)
    assert report["choice"]["commit"] and report["disjoint"]["overlaps"] == 0
    assert "test report of" in out.getvalue() and "k=2" in out.getvalue()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args[:-1], "validate.test_tree=2/2/3"]) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "validate.test_speed=false"]) == 0
    runs = [json.loads(line) for line in (run_dir / "validation" / "test_runs.jsonl").read_text().splitlines()]
    assert [r["setting"] for r in runs] == ["k=2", "tree 2/2/3", "k=2"]
    (untimed,) = runs[2]["sets"]
    assert not untimed["timed"] and "speedup" not in untimed and len(untimed["acceptance_by_position"]) == 2
    assert untimed["tau"]["value"] == pytest.approx(s["tau"]["value"])  # the same greedy pass, untimed
    assert untimed["greedy_identical_prompts"] == s["greedy_identical_prompts"]  # against the target's own outputs
    assert [m["position"] for m in untimed["greedy_mismatches"]] == [
        m["position"] for m in s["greedy_mismatches"] if m["pass"] == "chosen setting"]
    cached = list((Path(os.environ["MTP_TRAIN_DATA"]) / "target-greedy").glob("*.json"))
    assert len(cached) == 1 and len(json.loads(cached[0].read_text())["tokens"]) == 3  # the target decoded once


def test_a_greedy_mismatch_names_its_position_and_the_logit_gap(trained_run, tiny_dir):
    import torch

    from mtp_train.config import compose
    from mtp_train.inference.runner import load_runner
    from mtp_train.validate.testset import NEAR_TIE, mismatch

    cfg = compose("tiny", [f"run_dir={trained_run}", "target.device=cpu"])
    target = load_runner(cfg.target.path, cfg.target)
    prompt, base = [5, 6, 7, 8], [9, 10, 11]
    m = mismatch(target, prompt, base, [9, 10, 12], 4, "mine")
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt + base[:2]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert m["position"] == 2 and m["target_token"] == 11 and m["head_run_token"] == 12 and m["prompt"] == 4
    second = int(torch.topk(logits, 2).indices[1])
    assert m["top2_gap"] == pytest.approx(float(top[0] - top[1])) and m["runner_up"] is (second == 12)
    assert m["near_tie"] is (m["top2_gap"] < NEAR_TIE and m["runner_up"])
    tie = mismatch(target, prompt, base, base[:2] + [second], 4, "mine")
    assert tie["runner_up"] and tie["near_tie"] is (tie["top2_gap"] < NEAR_TIE)
    assert mismatch(target, prompt, base, base[:2], 0, "mine_k5")["position"] == 2  # cut short: where it ends


def test_vllm_judges_the_test_sets_greedy_at_k_1_to_5(monkeypatch, tmp_path):
    from mtp_train.config import compose
    from mtp_train.validate import testset

    seen = {}

    def decode_sets(cfg, variant, sets, python):
        seen.update(temps=cfg.validate.temperatures, max_k=cfg.validate.max_k, variant=variant, python=python)
        rows = [{"k": k, "tau": 1 + k / 10, "acceptance_by_position": [0.5] * k, "num_prompts": 2,
                 "greedy_identical": k != 4, "greedy_identical_prompts": 2 - (k == 4)} for k in range(1, 6)]
        return [{"name": s.name, "decoding": rows, "decoding_settings": {"vllm_version": "0.32.0"}} for s in sets]

    monkeypatch.setattr(testset.vllm, "decode_sets", decode_sets)
    monkeypatch.setattr(testset.vllm, "python_for", lambda v, names: "/venv/bin/python")
    cfg = compose("tiny", [f"run_dir={tmp_path}", "validate.engine=vllm", "validate.temperatures=[0.0,1.0]"])
    judged = testset.vllm_judge(cfg, "eagle3", [P.PromptSet("mt-bench-test", "test", [[1, 2]], None, "x")])
    assert seen == {"temps": [0.0], "max_k": 5, "variant": "eagle3", "python": "/venv/bin/python"}
    assert [(x["k"], x["greedy_identical"]) for x in judged][3] == (4, False)
    assert all(x["name"] == "mt-bench-test" and x["vllm_version"] == "0.32.0" for x in judged)
