"""`mtp-train validate` on a small trained run: report.json with the teacher-forced metrics (the trainer's
own numbers) and real decoding for k = 1..K, greedy output identical to the target's, plots and table."""

import json

import pytest

from mtp_train.cli import main
from mtp_train.data.held_out import held_out_prompts
from mtp_train.report import format_table
from mtp_train.validate.decoding import outlier

ENTRY_KEYS = {"drafter", "k", "temperature", "tau", "acceptance_by_position", "tokens_per_s",
              "target_only_tokens_per_s", "greedy_identical", "num_prompts", "new_tokens"}


@pytest.fixture(scope="module")
def report(validated_run):
    run_dir, _ = validated_run
    return json.loads((run_dir / "validation" / "report.json").read_text())


def test_report_has_every_section(report):
    assert {"val_loss", "accuracy_by_depth", "expected_acceptance_by_depth", "decoding"} <= set(report)
    assert len(report["accuracy_by_depth"]) == len(report["expected_acceptance_by_depth"]) == 2  # depth = max_k
    entries = report["decoding"]
    assert {(e["drafter"], e["temperature"], e["k"]) for e in entries} == {
        (d, t, k) for d in ("head", "draft") for t in (0.0, 1.0) for k in (1, 2)}
    for e in entries:
        assert ENTRY_KEYS <= set(e)
        assert e["num_prompts"] == 2 and len(e["acceptance_by_position"]) == e["k"]
        assert 1 <= e["tau"] <= e["k"] + 1
        # τ (tokens per verification forward; each prompt's first token comes from the prefill) agrees with
        # the acceptance counts, stop tokens included
        assert e["tau"] * e["steps"] == pytest.approx(e["new_tokens"] - e["num_prompts"])
        assert e["tau"] == pytest.approx(1 + sum(e["accepted"]) / e["steps"])
        assert e["acceptance_by_position"] == pytest.approx([a / d for a, d in zip(e["accepted"], e["drafted"])])
        assert e["tokens_per_s"] > 0 and e["target_only_tokens_per_s"] > 0
        assert e["greedy_identical"] is (True if e["temperature"] == 0 else None)
    head_greedy = [e for e in entries if e["drafter"] == "head" and e["temperature"] == 0]
    assert max(e["tau"] for e in head_greedy) > 1.1  # the trained head's drafts are accepted


def test_report_has_the_trees_beside_the_chains(report):
    """One entry per drafter and temperature for the tree 2/2/3 (steps/topk/num_draft_tokens): tau from its
    counts, acceptance by depth, the target forwards and the tokens each verified, greedy identical."""
    trees = report["tree_decoding"]
    assert {(e["drafter"], e["temperature"], tuple(e["tree"])) for e in trees} == {
        (d, t, (2, 2, 3)) for d in ("head", "draft") for t in (0.0, 1.0)}
    for e in trees:
        assert e["k"] == 2 and len(e["acceptance_by_depth"]) == 2
        assert 1 <= e["tau"] <= 3 and e["tau"] == pytest.approx(1 + sum(e["accepted"]) / e["steps"])
        assert e["tau"] * e["target_forwards"] == pytest.approx(e["new_tokens"] - e["num_prompts"])
        assert 1 <= e["verified_per_forward"] <= 2  # num_draft_tokens - 1 nodes (fewer near max_new_tokens)
        assert e["greedy_identical"] is (True if e["temperature"] == 0 else None)


def test_speeds_are_measured_in_rounds(report):
    """The target alone is timed before the drafters and after each (drafter, temperature) block; each row
    divides by the mean of the rounds on either side of its block."""
    for b in report["target_only"]:
        rounds = b["rounds"]
        assert len(rounds) == 1 + 2 and b["tokens_per_s"] == pytest.approx(sum(rounds) / 3)
        assert b["spread"] == pytest.approx((max(rounds) - min(rounds)) / b["tokens_per_s"])
        for i, name in enumerate(("head", "draft")):
            rows = [e for e in report["decoding"] + report["tree_decoding"]
                    if e["drafter"] == name and e["temperature"] == b["temperature"]]
            assert len(rows) == 3
            for e in rows:
                # the first timing sits between the block's rounds; a re-timing between rounds of its own
                first = (e["earlier_timings"] or [e])[0]
                assert first["target_only_either_side"] == pytest.approx([rounds[i], rounds[i + 1]])
                assert len(e["earlier_timings"]) == e["retimed"] <= 2
                assert e["target_only_tokens_per_s"] == pytest.approx(sum(e["target_only_either_side"]) / 2)
                assert e["speedup"] == pytest.approx(e["tokens_per_s"] / e["target_only_tokens_per_s"])
                assert e["speedup_above_tau"] is (e["speedup"] > e["tau"])
                assert e["suspect"] is (outlier(e, e["predicted_speedup"]) is not None)


def test_a_speedup_above_tau_is_flagged(report):
    greedy = next(e for e in report["decoding"] if e["temperature"] == 0 and e["drafter"] == "head")
    fake = dict(report, decoding=[dict(greedy, speedup=greedy["tau"] + 0.5, speedup_above_tau=True)],
                tree_decoding=[], prediction=None)
    table = format_table(fake)
    assert "x! yes" in table and "speed-up above tau" in table
    assert "speed-up above tau" not in format_table(dict(fake, decoding=[greedy]))


def test_report_predicts_the_speedups(report, validated_run):
    """The speed model beside each measured head row (this machine's profile, measured when validating), and
    its serving table on an H100 for b = 1..64, from the same taus."""
    pred = report["prediction"]
    assert pred["device"]["name"] == "cpu" and pred["device"]["bandwidth_gb_s"] > 0
    heads = [e for e in report["decoding"] + report["tree_decoding"] if e["drafter"] == "head"]
    assert [(c["k"], c["tree"], c["temperature"], c["tau"], c["measured"]) for c in pred["checks"]] == \
        [(e["k"], e.get("tree"), e["temperature"], e["tau"], e["speedup"]) for e in heads]
    for c in pred["checks"]:
        assert c["predicted"] > 0 and c["error"] == pytest.approx(c["predicted"] / c["measured"] - 1)
    # the engine's per-step overhead, timed before decoding, is in every prediction, the outlier check's included
    o = pred["overhead"]
    assert o["steps_timed"] == 3 * 3 * 12 and len(o["measured_ms"]) == 3 and min(o["measured_ms"]) > 0
    assert o["per_draft_ms"] >= 0
    assert [c["predicted"] for c in pred["checks"]] == pytest.approx([e["predicted_speedup"] for e in heads])
    serving = pred["serving"]
    assert serving["profile"]["name"] == "H100-SXM" and [r["batch"] for r in serving["table"]] == [1, 4, 16, 64]
    for r in serving["table"]:
        assert set(r["speedup_by_k"]) == {"1", "2"} or set(r["speedup_by_k"]) == {1, 2}
        assert list(r["speedup_by_tree"]) == ["tree 2/2/3"]
        assert r["best_speedup"] == max([*r["speedup_by_k"].values(), *r["speedup_by_tree"].values()])
    _, printed = validated_run
    assert "predicted speed-up serving on H100-SXM" in printed and "T=0 k=1: measured" in printed


def test_teacher_forced_metrics_are_the_trainers(validated_run, report, tiny_run_config):
    """Depth 1 equals the trainer's final validation on the same store (same code, same batches); the
    loss is the training objective's weighted sum of the per-depth terms."""
    run_dir, _ = validated_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "val/d1/acc" in r][-1]
    assert report["accuracy_by_depth"][0] == pytest.approx(final["val/d1/acc"], abs=1e-6)
    assert report["expected_acceptance_by_depth"][0] == pytest.approx(final["val/d1/accept"], abs=1e-6)
    assert report["accuracy_by_depth"][0] > 0.2
    loss = tiny_run_config(run_dir).train.loss
    terms = report["loss_terms_by_depth"]
    assert report["val_loss"] == pytest.approx(sum(loss.gamma ** i * (loss.w_feat * t["feat"] + loss.w_logit * t["ce"])
                                                   for i, t in enumerate(terms)))


def test_plots_and_table(validated_run):
    run_dir, printed = validated_run
    for name in ("acceptance_by_position.png", "tau_vs_k.png"):
        assert (run_dir / "validation" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "teacher-forced on the val store" in printed and "greedy = target" in printed
    rows = [line.split() for line in printed.splitlines() if line.startswith(("  head ", "  draft ", "  none "))]
    assert len(rows) == 8 + 2 and all(r[-1] == "yes" for r in rows if r[0] != "none" and r[1] == "0")
    trees = [line.split() for line in printed.splitlines() if line.startswith("  2/2/3 ")]
    assert len(trees) == 4 and all(r[-1] == "yes" for r in trees if r[2] == "0")


def test_table_counts_the_prompts_that_matched(report):
    """A greedy row that differs from the target alone on some prompts (bf16 near-ties on a GPU) says how many
    matched; sampled rows say nothing."""
    greedy = next(e for e in report["decoding"] if e["temperature"] == 0)
    changed = dict(report, decoding=[dict(greedy, greedy_identical=False, greedy_identical_prompts=1)])
    row = next(line for line in format_table(changed).splitlines() if line.startswith(f"  {greedy['drafter']} "))
    assert row.endswith("NO (1/2)")


def test_prompts_are_cut_where_the_assistant_answers(trained_run, tiny_dir):
    from mtp_train.model.target import load_tokenizer

    prompts, source = held_out_prompts(trained_run / "data", 3, 512)
    tok = load_tokenizer(tiny_dir / "target")
    assert len(prompts) == 3 and "3 conversations" in source
    for p in prompts:
        assert tok.decode(p).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_validate_without_a_checkpoint_says_train_first(tmp_path, capsys):
    assert main(["validate", f"run_dir={tmp_path}"]) == 1
    assert "run mtp-train train first" in capsys.readouterr().err


def test_teacher_forced_alone_reads_only_E_and_W_and_runs_in_bf16(trained_run, tmp_path, monkeypatch,
                                                                   tiny_run_config):
    """validate.num_prompts=0 (a target too big for one device) never loads the whole target, and a bf16
    run (head trained in bf16 autocast, bf16 target) is measured with the trainer's numerics: the same
    figures as fp32 up to bf16 rounding."""
    import shutil

    import mtp_train.validate.run as validate

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    monkeypatch.setattr(validate, "load_runner", lambda *a, **k: pytest.fail("the whole target was loaded"))
    settings = ("validate.num_prompts=0", "validate.val_samples=8")
    fp32 = validate.run(tiny_run_config(run_dir, *settings))
    bf16 = validate.run(tiny_run_config(run_dir, *settings, "target.dtype=bfloat16", "train.precision=bf16"))
    assert fp32["decoding"] == bf16["decoding"] == [] and fp32["val_samples"] == 8
    assert bf16["accuracy_by_depth"] == pytest.approx(fp32["accuracy_by_depth"], abs=0.03)
    assert bf16["val_loss"] == pytest.approx(fp32["val_loss"], rel=0.02)


def test_no_held_out_prompt_is_an_error_naming_the_setting(trained_run, tiny_run_config):
    from mtp_train.validate.run import run

    with pytest.raises(ValueError, match=r"no held-out prompt in .*validate.max_prompt_tokens=2 tokens"):
        run(tiny_run_config(trained_run, "validate.max_prompt_tokens=2"))


def test_outliers_by_hand():
    """A timing is suspect below 0.5x or above 1.5x of its prediction, between target-only rounds that spread
    more than 15%, or above its tau."""
    row = {"speedup": 1.0, "tau": 1.6, "speedup_above_tau": False, "target_only_either_side": [100.0, 110.0]}
    assert outlier(row, 1.2) is None and outlier(row, None) is None
    assert "against predicted 2.10x (0.48 of it, outside 0.5..1.5)" in outlier(row, 2.1)
    assert "(0.67 of it" not in (outlier(row, 1.5) or "") and "1.50 of it" not in (outlier(row, 0.67) or "")
    assert outlier(row, 0.66).startswith("measured 1.00x against predicted 0.66x (1.52 of it")
    spread = dict(row, target_only_either_side=[100.0, 120.0])  # 20 / 110 = 18%
    assert outlier(spread, 1.0) == "target-only rounds either side 100.0 / 120.0 tokens/s (spread 18% > 15%)"
    assert "above tau 1.60" in outlier(dict(row, speedup=1.7, speedup_above_tau=True), 1.7)


class SlowDrafter:
    """A drafter that sleeps `delay` s before each proposal while `slow` is set: a machine slowed down."""

    def __init__(self, inner, delay):
        self.inner, self.delay, self.slow = inner, delay, True
        self.name, self.feature_layers = inner.name, inner.feature_layers

    def propose(self, *args, **kwargs):
        if self.slow:
            import time

            time.sleep(self.delay)
        return self.inner.propose(*args, **kwargs)

    def __getattr__(self, name):  # start, accept, select, propose_tree: the real drafter's
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def decoding_parts(trained_run, tiny_run_config):
    """(config: head only, greedy, k = 1, no trees, 3 re-timings at most; target; the head drafter; prompts;
    stop tokens) for calling `validate.decoding` directly."""
    import torch

    from mtp_train.inference.drafters import HeadDrafter
    from mtp_train.inference.runner import load_runner
    from mtp_train.inference.load import load_head_module, stop_tokens
    from mtp_train.model.target import load_tokenizer

    cfg = tiny_run_config(trained_run, "validate.max_k=1", "validate.temperatures=[0.0]", "validate.trees=[]",
                          "validate.max_new_tokens=24", "validate.retimes=3")
    target = load_runner(cfg.target.path, cfg.target)
    head, _ = load_head_module(cfg, target.device, torch.float32)
    drafter = HeadDrafter(head, target.model.get_input_embeddings(), target.lm_head)
    prompts, _ = held_out_prompts(trained_run / "data", 2, 512)
    return cfg, target, drafter, prompts, stop_tokens(load_tokenizer(cfg.target.path), target)


def test_a_row_timed_under_a_slow_down_is_timed_again_and_flagged_when_it_stays_slow(decoding_parts):
    """The clean speed-up is the prediction. Slowed down (a sleep of six target steps before every proposal) the
    row measures far below half of it: it is timed again, 3 times, stays slow, and is flagged with the reason.
    When the slow-down ends as the re-timing starts, the second timing is kept and nothing is flagged."""
    from mtp_train.validate.decoding import decoding

    cfg, target, drafter, prompts, stop = decoding_parts
    said = []
    entries, _, base = decoding(cfg, target, {"head": drafter}, prompts, stop, say=said.append)
    clean = entries[0]["speedup"]
    step_s = 1 / base[0]["tokens_per_s"]  # a target-only step

    slow = SlowDrafter(drafter, 6 * step_s)
    said.clear()
    e = decoding(cfg, target, {"head": slow}, prompts, stop, say=said.append, predict=lambda e: clean)[0][0]
    assert e["retimed"] == 3 and len(e["earlier_timings"]) == 3 and e["suspect"] is True
    assert all(t["speedup"] < 0.5 * clean for t in e["earlier_timings"]) and e["speedup"] < 0.5 * clean
    assert e["predicted_speedup"] == clean
    assert f"against predicted {clean:.2f}x" in e["suspect_reason"] and "(timed 4 times)" in e["suspect_reason"]
    assert sum("timing head T=0 k=1 again: measured" in line for line in said) == 3
    table = format_table({"head": {"checkpoint": "c", "variant": "mtp", "depth": 1, "step": 1}, "decoding": [e],
                          "target_only": [], "decoding_settings": {"max_new_tokens": 24, "batch_size": 1,
                                                                   "device": "cpu"}})
    assert "x? yes" in table and "? head T=0 k=1 stays suspect: measured" in table

    slow = SlowDrafter(drafter, 6 * step_s)

    def say(line):  # the slow-down ends when the re-timing starts
        slow.slow = slow.slow and "again" not in line

    e = decoding(cfg, target, {"head": slow}, prompts, stop, say=say, predict=lambda e: clean)[0][0]
    assert e["retimed"] >= 1 and e["earlier_timings"][0]["speedup"] < 0.5 * clean
    # the timing kept is a clean one (a busy machine may still spread the target-only rounds around it)
    assert "against predicted" not in e.get("suspect_reason", ""), e.get("suspect_reason")
    assert 0.5 * clean <= e["speedup"] <= 1.5 * clean


def test_categories_in_the_report(trained_run, tiny_run_config, tmp_path):
    """A prompt file with categories: every row has per-category counts that add up to its own, and the table
    prints them; the run's own prompts (first set) stay the top-level figures."""
    from mtp_train.validate.run import run

    path = tmp_path / "set.jsonl"
    questions = [("def add(a, b):", "coding"), ("Write a function that sorts a list.", "coding"),
                 ("What is a list?", "stem")]
    path.write_text("".join(json.dumps({"turns": [q], "category": c}) + "\n" for q, c in questions))
    report = run(tiny_run_config(trained_run, f"validate.prompts=[recipe,{path}]", "validate.teacher_forced=false",
                                 "validate.drafters=[head]", "validate.temperatures=[0.0]", "validate.trees=[]",
                                 "validate.num_prompts=3", "validate.predict=false", "validate.plots=false",
                                 "validate.retimes=0"))
    first, second = report["prompt_sets"]
    assert first["name"] == "recipe" and report["decoding"] == first["decoding"] and second["name"] == str(path)
    assert "by_category" not in first["decoding"][0]
    for e in second["decoding"]:
        cats = e["by_category"]
        assert list(cats) == ["coding", "stem"] and [c["prompts"] for c in cats.values()] == [2, 1]
        for key in ("steps", "new_tokens"):
            assert sum(c[key] for c in cats.values()) == e[key]
        assert [sum(c["accepted"][j] for c in cats.values()) for j in range(e["k"])] == e["accepted"]
        for c in cats.values():
            assert c["tau"] == pytest.approx(1 + sum(c["accepted"]) / c["steps"])
    table = format_table(report)
    assert f"prompt set '{path}'" in table and "by category, head, greedy: tau / acceptance of the first draft" in table
    coding = next(line for line in table.splitlines() if line.strip().startswith("coding"))
    k1 = second["decoding"][0]["by_category"]["coding"]
    assert coding.split()[1:4] == ["2", f"{k1['tau']:.2f}", f"{k1['acceptance_by_position'][0]:.2f}"]
