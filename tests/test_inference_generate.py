"""`mtp-train generate`: the same text with the head, the draft LM and the target alone (greedy), and a
clear error for each input that cannot work."""

import shutil

import pytest

from mtp_train.cli import EXIT_USAGE, main

PROMPT = "Write `def add(a, b)`, returning a + b (and nothing else)."


def generated(capsys) -> tuple[str, str]:
    """(the generated text, the stats line) of a generate run's output."""
    text, _, stats = capsys.readouterr().out.rpartition("\n[")
    return text, stats


def test_generate_is_the_same_text_with_every_drafter(trained_run, capsys):
    texts, configs = {}, sorted(trained_run.glob("config*.yaml"))
    for how in ("head", "draft", "none"):
        assert main(["generate", f"run_dir={trained_run}", f"prompt={PROMPT}", f"speculative={how}", "k=3",
                     "max_new_tokens=24", "target.device=cpu"]) == 0
        texts[how], stats = generated(capsys)
        assert "tokens per target forward" in stats
    for how in ("head", "draft"):  # a draft tree instead of the chain: the same greedy text
        assert main(["generate", f"run_dir={trained_run}", f"prompt={PROMPT}", f"speculative={how}",
                     "tree=[3,2,4]", "max_new_tokens=24", "target.device=cpu"]) == 0
        texts[how + " tree"], stats = generated(capsys)
        assert f"{how}, tree 3/2/4: tau" in stats and "acceptance by depth" in stats
    assert texts["head"] == texts["draft"] == texts["none"] == texts["head tree"] == texts["draft tree"]
    assert texts["none"].strip()
    assert sorted(trained_run.glob("config*.yaml")) == configs  # generate writes nothing into the run


def test_generate_without_a_checkpoint_says_train_first(tmp_path, capsys):
    assert main(["generate", f"run_dir={tmp_path}", "prompt=hi"]) == 1
    assert "run mtp-train train first" in capsys.readouterr().err


def test_generate_with_draft_needs_a_draft_path(trained_run, capsys):
    assert main(["generate", f"run_dir={trained_run}", "speculative=draft", "target.draft_path=null"]) == 1
    assert "speculative=draft needs a draft LM: set target.draft_path" in capsys.readouterr().err


@pytest.mark.parametrize("arg,message", [("k=0", "generate.k=0: must be >= 1"),
                                         ("speculative=fast", "generate.speculative='fast'"),
                                         ("temperature=-1", "generate.temperature=-1.0: must be >= 0")])
def test_bad_generate_settings(tmp_path, capsys, arg, message):
    assert main(["generate", f"run_dir={tmp_path}", arg]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_a_head_trained_for_another_target_is_refused(trained_run, tmp_path, tiny_dir, capsys):
    shutil.copytree(trained_run / "checkpoints", tmp_path / "checkpoints")
    other = tmp_path / "target"
    shutil.copytree(tiny_dir / "target", other)
    (other / "config.json").write_text((other / "config.json").read_text().replace('"rms_norm_eps": 1e-05',
                                                                                   '"rms_norm_eps": 1e-06'))
    assert main(["generate", f"run_dir={tmp_path}", f"target.path={other}", "target.device=cpu"]) == 1
    assert "was trained for target" in capsys.readouterr().err
