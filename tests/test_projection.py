"""The CPU engine's few-row projections (`mtp_train.model.frozen.project`): every form computes `h @ W.T`, the
probe picks the faster on the machine's own timings (one row: `stream` or `pair`), a pinned form streams one
row, and decoding through a probed runner stays greedy-identical to the target alone."""

import pytest
import torch

from mtp_train.model import frozen


class FakeTimer:
    """perf_counter stand-in: each call after a form's start returns start + that form's made-up seconds
    per weight times the weights read, so the probe sees the timings a test chooses."""

    def __init__(self, seconds: dict[str, float], copies: int, spikes: dict[int, float] | None = None,
                 forms: tuple[str, ...] = ("stream", "gemm")):
        self.seconds, self.copies, self.now, self.calls, self.forms = seconds, copies, 0.0, 0, forms
        self.spikes = spikes or {}  # turn (0 = stream's first, 1 = gemm's first, ...) -> seconds another process took

    def __call__(self) -> float:
        turn = self.calls // 2
        form = self.forms[turn % 2]  # start, end of stream; start, end of gemm (or pair); ...
        if self.calls % 2:
            self.now += self.seconds[form] * self.copies + self.spikes.get(turn, 0.0)
        self.calls += 1
        return self.now


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
def test_both_forms_compute_the_projection(rows):
    torch.manual_seed(0)
    w, h, b = torch.randn(96, 32), torch.randn(rows, 32), torch.randn(96)
    want = torch.nn.functional.linear(h, w, b)
    torch.testing.assert_close(frozen.project(h, w, b), want, rtol=1e-5, atol=1e-5)  # probed
    if rows == 1:
        torch.testing.assert_close(frozen._pair(h, w) + b, want, rtol=1e-5, atol=1e-5)
    for form in frozen.FORMS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(frozen.PROJECTION_ENV, form)
            got = frozen.project(h[None], w, b)  # [1, rows, 32]: leading dims kept
        assert got.shape == (1, rows, 96)
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", ["stream", "gemm"])
def test_the_probe_picks_the_form_its_timings_say_is_faster(fast):
    slow = "gemm" if fast == "stream" else "stream"
    copies = max(1, min(64, frozen.PROBE_BYTES // (8 * 4 * 4)))
    timer = FakeTimer({fast: 1e-6, slow: 3e-6}, copies)
    form, fastest = frozen.probe_form(8, 4, 2, torch.float32, repeats=3, timer=timer)
    assert form == fast
    assert fastest[fast] == pytest.approx(1e-6) and fastest[slow] == pytest.approx(3e-6)
    assert timer.calls == 2 * 2 * 3  # two timer reads per form and repeat
    # another process slowing two of the faster form's three turns does not flip the choice
    fast_turns = (0, 2) if fast == "stream" else (1, 3)
    timer = FakeTimer({fast: 1e-6, slow: 3e-6}, copies, {t: 1.0 for t in fast_turns})
    assert frozen.probe_form(8, 4, 2, torch.float32, repeats=3, timer=timer)[0] == fast


def test_the_probe_picks_a_one_row_form_from_its_own_pair():
    copies = max(1, min(64, frozen.PROBE_BYTES // (8 * 4 * 4)))
    for fast, slow in (("pair", "stream"), ("stream", "pair")):
        timer = FakeTimer({fast: 1e-6, slow: 2e-6}, copies, forms=frozen.ONE_ROW_FORMS)
        form, fastest = frozen.probe_form(8, 4, 1, torch.float32, repeats=3, timer=timer)
        assert form == fast and set(fastest) == {"stream", "pair"}


def test_the_choice_is_made_once_and_a_pinned_form_streams_one_row(monkeypatch):
    calls = []

    def probe(o, i, rows, dtype):
        calls.append((o, i, rows))
        return ("pair" if rows == 1 else "gemm"), {}

    monkeypatch.delenv(frozen.PROJECTION_ENV, raising=False)
    monkeypatch.setattr(frozen, "probe_form", probe)
    monkeypatch.setattr(frozen, "_chosen", {})
    assert frozen.projection_form(64, 32, 1, torch.float32) == "pair"
    assert frozen.projection_form(64, 32, 3, torch.float32) == "gemm"
    assert frozen.projection_form(64, 32, 3, torch.float32) == "gemm"
    assert frozen.projection_form(64, 32, 1, torch.float32) == "pair"
    assert calls == [(64, 32, 1), (64, 32, 3)]
    monkeypatch.setenv(frozen.PROJECTION_ENV, "stream")
    assert frozen.projection_form(64, 32, 3, torch.float32) == "stream"  # pinned, whatever was probed
    monkeypatch.setenv(frozen.PROJECTION_ENV, "gemm")
    assert frozen.projection_form(64, 32, 1, torch.float32) == "stream"  # pinned: one row, one summation order
    monkeypatch.setenv(frozen.PROJECTION_ENV, "blas")
    with pytest.raises(ValueError, match=r"MTP_TRAIN_PROJECTION='blas'.*probe, stream, gemm"):
        frozen.projection_form(64, 32, 3, torch.float32)


@pytest.mark.parametrize("form", ["probe", "gemm", "pair"])
def test_speculative_decoding_through_each_form_is_greedy_identical(tiny_dir, monkeypatch, form):
    """The tiny target's runner with every projection routed through `project` in `form`: an untrained head
    (so drafts are mostly rejected and verification rolls back) and the target alone emit the same tokens."""
    from transformers import AutoConfig

    from mtp_train.inference.config import SamplingConfig
    from mtp_train.inference.drafters import HeadDrafter
    from mtp_train.inference.runner import load_runner
    from mtp_train.inference.speculative import generate
    from mtp_train.model.head import DraftHead
    from mtp_train.model.target import TargetConfig

    monkeypatch.setenv(frozen.PROJECTION_ENV, "probe" if form == "pair" else form)
    monkeypatch.setattr(frozen, "_chosen", {})
    if form == "pair":  # one row as a 2-column product (the target alone, the head's draft steps), gemm above it
        monkeypatch.setattr(frozen, "probe_form", lambda o, i, rows, d: ("pair" if rows == 1 else "gemm", {}))
    target = load_runner(str(tiny_dir / "target"), TargetConfig(path=str(tiny_dir / "target")))
    torch.manual_seed(0)
    head = DraftHead(AutoConfig.from_pretrained(tiny_dir / "target")).eval()
    drafter = HeadDrafter(head, target.model.get_input_embeddings(), target.lm_head)
    prompts = [[5, 17, 42, 9, 33, 8], [12, 7, 3, 99, 41, 2, 60, 11]]
    alone = generate(target, prompts, drafter=None, sampling=SamplingConfig(), max_new_tokens=24)
    for k in (1, 3):
        spec = generate(target, prompts, drafter=drafter, k=k, sampling=SamplingConfig(), max_new_tokens=24)
        assert spec.tokens == alone.tokens, f"k={k}, projections {form}"
    if form == "probe":
        assert {rows for _, _, rows, _ in frozen._chosen} >= {2, 4}  # verification of k + 1 = 2 and 4 rows probed
