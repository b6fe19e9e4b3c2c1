"""Checkpoint directories: atomic `latest`, pruning that never removes what `latest` names."""

import torch

from mtp_train.train import checkpoint as ckpt


def save(root, step, keep=2):
    return ckpt.save(root, step, {"w": torch.full((2,), float(step))}, {"step": step}, {}, {"step": step},
                     "seed: 0\n", keep=keep)


def test_keeps_the_newest_and_points_latest_at_it(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    assert ckpt.latest(tmp_path).name == "step-000004"
    assert not list(tmp_path.glob("*.tmp"))


def test_steps_sort_numerically(tmp_path):
    save(tmp_path, 999_999, keep=0)
    save(tmp_path, 1_000_000, keep=2)
    save(tmp_path, 1_000_001, keep=2)
    assert [ckpt.step_of(p) for p in ckpt.checkpoints(tmp_path)] == [1_000_000, 1_000_001]
    assert ckpt.latest(tmp_path).name == "step-1000001"


def test_continuing_from_an_earlier_step_never_prunes_the_new_checkpoint(tmp_path):
    """`latest` pointed back at step 2 (e.g. after a divergence); a later step-5 directory is an abandoned
    continuation: saving step 3 with keep=1 keeps step 3 and `latest` names it."""
    for step in (2, 5):
        save(tmp_path, step, keep=0)
    (tmp_path / "latest").write_text("step-000002\n")
    save(tmp_path, 3, keep=1)
    assert ckpt.latest(tmp_path).name == "step-000003"
    assert (tmp_path / "step-000005").is_dir() and not (tmp_path / "step-000002").exists()


def test_saving_a_step_again_replaces_it(tmp_path):
    save(tmp_path, 7)
    path = ckpt.save(tmp_path, 7, {"w": torch.zeros(2)}, {"step": 7}, {}, {"step": 7}, "", keep=2)
    assert torch.equal(ckpt.load_head_state(path)["w"], torch.zeros(2))
    assert ckpt.latest(tmp_path) == path and not list(tmp_path.glob("*.old"))


def test_latest_naming_a_missing_checkpoint_is_explained(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "latest").write_text("step-000009\n")
    import pytest

    with pytest.raises(ValueError, match="step-000009.*missing or incomplete"):
        ckpt.latest(tmp_path)
