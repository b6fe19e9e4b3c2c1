"""benchmarks/peers/step_profile.py on a toy trainer: the window's steps, forward and backward time tied to the
categories whose scopes created them, and everything it changed put back."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))

import step_profile  # noqa: E402


class ToyAttention(torch.nn.Module):
    """Deliberately the heavy part: 30 chained products of a 96-row block."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        a = self.proj(x)
        for _ in range(30):
            a = torch.tanh(a @ a.transpose(-1, -2) @ a / 64)
        return a


def toy_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels)


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = ToyAttention()
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.out(self.attn(x))


def train(steps: int, optimizers: int = 1) -> None:
    torch.manual_seed(0)
    model, x, y = Toy(), torch.randn(96, 64), torch.randint(0, 10, (96,))
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[i::optimizers], lr=1e-3) for i in range(optimizers)]
    for _ in range(steps):
        loss = sys.modules[__name__].toy_loss(model(x), y)  # looked up at call time, as a trainer's import is
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()


def test_window_categories_forward_and_backward():
    prof = step_profile.StepProfile([(4, 6), (8, 9)], {"loss": [f"{__name__}:toy_loss"]}, {"attention": "Attention$"},
                                    {"loss": "out"}).install()  # the projection the loss reads, by its name
    try:
        train(10, optimizers=2)  # two optimizers a step: still 10 steps
    finally:
        prof.remove()
    rec = prof.record()
    assert rec["steps_made"] == 10 and rec["windows"] == [[4, 6], [8, 9]] and "error" not in rec
    assert [w["window"] for w in rec["results"]] == [[4, 6], [8, 9]]
    assert rec["results"][1]["categories"]["attention"]["share"] > 0.5  # the second window is profiled alike
    rec = {**rec, **rec["results"][0]}
    cats = rec["categories"]
    assert set(cats) == {"attention", "loss"}
    att, loss = cats["attention"], cats["loss"]
    # the backward time is found through the operations the scope created (the attention's products)
    assert att["forward_s"] > 0 and att["backward_s"] > 0 and loss["forward_s"] > 0 and loss["backward_s"] > 0
    assert att["share"] > 0.5 > loss["share"]  # 30 products against one cross-entropy over 10 classes
    assert 0 < rec["share_total"] <= 1.05  # the categories do not count a moment twice
    assert rec["step_s"] > 0 and rec["step_s_before"] > 0 and rec["overhead"] > 0
    assert any("mm" in op["op"] for op in rec["top_self_ops"])
    assert rec["scopes"]["names"] == {"loss": "out"}


def test_a_module_is_scoped_by_the_name_its_parent_gives_it():
    """Only `out` (a Linear) is in the category, not the attention's own Linear `proj` nor its products."""
    prof = step_profile.StepProfile([(2, 3)], names={"head": "out"}).install()
    try:
        train(3)
    finally:
        prof.remove()
    rec = prof.record()["results"][0]
    assert set(rec["categories"]) == {"head"} and rec["categories"]["head"]["forward_s"] > 0
    assert rec["categories"]["head"]["share"] < 0.5  # the attention's products are not in it


def test_remove_puts_everything_back_and_an_unreached_window_says_so():
    original = toy_loss
    prof = step_profile.StepProfile([(5, 9)], {"loss": [f"{__name__}:toy_loss"]}, {"attention": "Attention$"}).install()
    assert sys.modules[__name__].toy_loss is not original
    try:
        train(3)
    finally:
        prof.remove()
    assert sys.modules[__name__].toy_loss is original
    rec = prof.record()
    assert rec["steps_made"] == 3 and "not reached" in rec["error"]
    train(6)  # no hook is left: nothing counts these steps
    assert len(prof.step_end) == 3


def test_window_must_leave_reference_steps():
    for windows in ([(1, 4)], [(5, 4)], [(2, 4), (5, 6)], [(6, 8), (2, 3)]):
        try:
            step_profile.StepProfile(windows)
        except ValueError as e:
            assert "2 <= first <= last" in str(e)
        else:
            raise AssertionError(f"windows {windows} accepted")
    step_profile.StepProfile([(2, 4), (6, 6)])  # one unprofiled step between them
