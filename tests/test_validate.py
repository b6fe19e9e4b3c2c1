"""`mtp-train validate` on a small trained run: report.json with the teacher-forced metrics (the trainer's
own numbers) and real decoding for k = 1..K, greedy output identical to the target's, plots and table."""

import json

import pytest

from mtp_train.cli import main
from mtp_train.validate import format_table, held_out_prompts

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
                assert e["target_only_tokens_per_s"] == pytest.approx((rounds[i] + rounds[i + 1]) / 2)
                assert e["speedup"] == pytest.approx(e["tokens_per_s"] / e["target_only_tokens_per_s"])
                assert e["speedup_above_tau"] is (e["speedup"] > e["tau"])


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

    import mtp_train.validate as validate

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    monkeypatch.setattr(validate, "load_runner", lambda *a, **k: pytest.fail("the whole target was loaded"))
    settings = ("validate.num_prompts=0", "validate.val_samples=8")
    fp32 = validate.run(tiny_run_config(run_dir, *settings))
    bf16 = validate.run(tiny_run_config(run_dir, *settings, "target.dtype=bfloat16", "train.precision=bf16"))
    assert fp32["decoding"] == bf16["decoding"] == [] and fp32["val_samples"] == 8
    assert bf16["accuracy_by_depth"] == pytest.approx(fp32["accuracy_by_depth"], abs=0.03)
    assert bf16["val_loss"] == pytest.approx(fp32["val_loss"], rel=0.02)


def test_no_held_out_prompt_is_an_error_naming_the_setting(trained_run, tiny_run_config):
    from mtp_train.validate import run

    with pytest.raises(ValueError, match=r"no held-out prompt in .*validate.max_prompt_tokens=2 tokens"):
        run(tiny_run_config(trained_run, "validate.max_prompt_tokens=2"))
