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


# -- states without pickle, checksums, falling back past a damaged checkpoint ---------------------------------
def test_states_round_trip_exactly_without_pickle(tmp_path):
    """An optimizer-like state (int keys, tuples, NaN and infinities, 0-dim and bf16 tensors) and the RNG
    states come back equal, bit for bit, from safetensors + JSON."""
    import math
    import random

    random.seed(3)
    state = {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 2)},
                       1: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4).bfloat16()}},
             "param_groups": [{"lr": 1 / 3, "betas": (0.9, 0.95), "eps": 1e-8, "params": [0, 1], "fused": None,
                               "weird": [float("nan"), float("inf"), -0.0]}],
             "rng": ckpt.rng_state(), "shared": [torch.arange(4)] * 2}
    ckpt.save_state(tmp_path, "opt", state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt.json", "opt.safetensors"]
    back = ckpt.load_state(tmp_path, "opt")
    assert set(back["state"]) == {0, 1} and back["param_groups"][0]["betas"] == (0.9, 0.95)
    assert back["param_groups"][0]["lr"] == 1 / 3 and back["param_groups"][0]["eps"] == 1e-8
    nan, inf, zero = back["param_groups"][0]["weird"]
    assert math.isnan(nan) and inf == float("inf") and math.copysign(1, zero) == -1
    for k in (0, 1):
        for name, t in state["state"][k].items():
            assert back["state"][k][name].dtype == t.dtype and torch.equal(back["state"][k][name], t)
    assert back["rng"]["python"] == state["rng"]["python"]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    ckpt.set_rng_state(back["rng"])
    drawn = random.random(), torch.rand(1)
    ckpt.set_rng_state(state["rng"])
    assert drawn == (random.random(), torch.rand(1))


class _Planted:
    """A pickle that makes a directory when it is unpickled: what a malicious checkpoint file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.makedirs, (self.marker,)


def test_a_planted_pickle_is_never_executed(tmp_path):
    path = save(tmp_path / "ck", 1)
    for name in ("trainer_state.json", "trainer_state.safetensors"):  # an earlier version's checkpoint ...
        (path / name).unlink()
    marker = tmp_path / "the-pickle-ran"
    torch.save({"step": 1, "rng": _Planted(marker)}, path / "trainer_state.pt")  # ... with code planted in it
    import pytest

    with pytest.raises(ValueError, match="trainer_state.pt .* is not loaded: unpickling it would run code"):
        ckpt.load_trainer_state(path)
    assert not marker.exists()
    # an earlier version's honest file (tensors and plain values) still loads, through weights_only=True
    torch.save({"step": 1, "rng": ckpt.rng_state(), "scheduler": {"last_epoch": 1, "lr_lambdas": [None]}},
               path / "trainer_state.pt")
    assert ckpt.load_trainer_state(path)["step"] == 1


def test_checksums_name_the_damage_and_resume_falls_back(tmp_path):
    import pytest

    assert ckpt.newest_intact(tmp_path) is None  # nothing saved yet: a fresh start
    for step in (1, 2):
        save(tmp_path, step)
    said = []
    assert ckpt.newest_intact(tmp_path, said.append).name == "step-000002" and not said
    head = tmp_path / "step-000002" / "head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 1
    head.write_bytes(bytes(data))
    assert ckpt.verify(head.parent) == ["head.safetensors does not match its sha256"]
    with pytest.raises(ValueError, match="step-000002 is damaged: head.safetensors does not match its sha256"):
        ckpt.load_head_state(head.parent)
    assert ckpt.newest_intact(tmp_path, said.append).name == "step-000001"
    assert "step-000002: head.safetensors does not match its sha256" in said[0] and "Resuming from step-000001" in said[0]
    opt = tmp_path / "step-000001" / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:-3])  # truncated
    with pytest.raises(ValueError, match=r"no intact checkpoint .*step-000001: optimizer.safetensors has \d+ bytes"):
        ckpt.newest_intact(tmp_path)
