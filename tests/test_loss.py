"""The training objective: the chunked distribution loss against a direct computation (value, gradient,
metrics), the prediction mask, and the per-depth weighting."""

import pytest
import torch
import torch.nn.functional as F

from mtp_train.train.loss import LossConfig, distill_ce, head_loss, predicted_mask


def direct(x, y, W, weight, temperature):
    """The whole [N, V] at once: -Σ p log q per row, weighted."""
    log_q = torch.log_softmax(x @ W.T, -1)
    p = torch.softmax((y @ W.T) / temperature, -1)
    return -(weight * (p * log_q).sum(-1)).sum(), log_q.exp(), p


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_loss_equals_direct(chunk, temperature):
    torch.manual_seed(0)
    N, Hd, V = 53, 16, 97
    W = torch.randn(V, Hd)
    y = torch.randn(N, Hd)
    weight = torch.rand(N)
    x1 = torch.randn(N, Hd, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    loss, metrics = distill_ce(x1, y, W, weight, temperature, chunk)
    ref, q, p = direct(x2, y, W, weight, temperature)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    (2.5 * loss).backward()
    (2.5 * ref).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(metrics[:, 0], (q.argmax(-1) == p.argmax(-1)).float())
    torch.testing.assert_close(metrics[:, 1], torch.minimum(p, q).sum(-1))


def test_identical_distributions_accept_everything():
    torch.manual_seed(1)
    W, y = torch.randn(50, 8), torch.randn(10, 8)
    _, m = distill_ce(y.clone(), y, W, torch.ones(10))
    torch.testing.assert_close(m[:, 1], torch.ones(10))
    assert m[:, 0].sum() == 10


def test_predicted_mask():
    """Anchor i at depth j predicts x_{i+2+j}: counted when that token is inside the sample and trainable."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.int8)
    lengths = torch.tensor([8, 5])
    m0 = predicted_mask(loss_mask, lengths, 0)
    assert m0[0].tolist() == [True, True, True, False, True, True, False, False]
    assert m0[1].tolist() == [True, True, True, False, False, False, False, False]  # x_5.. are padding
    m2 = predicted_mask(loss_mask, lengths, 2)
    assert m2[0].tolist() == [True, False, True, True, False, False, False, False]
    assert m2[1].tolist() == [True, False, False, False, False, False, False, False]


def test_head_loss_matches_formula():
    """Depth j: γ^j (w_feat·SmoothL1(ĥ_j, h_{i+1+j}) + w_logit·CE(q, p)), each a mean over counted positions."""
    torch.manual_seed(2)
    B, T, Hd, V = 2, 9, 8, 31
    hidden = torch.randn(B, T, Hd)
    W = torch.randn(V, Hd)
    outs = [torch.randn(B, T, Hd) for _ in range(2)]
    loss_mask = (torch.rand(B, T) > 0.3).to(torch.int8)
    lengths = torch.tensor([9, 6])
    cfg = LossConfig(w_feat=0.3, w_logit=0.9, temperature=1.0, gamma=0.5, chunk_tokens=4)
    total, m = head_loss(outs, hidden, loss_mask, lengths, W, cfg)
    expect = 0.0
    for j, o in enumerate(outs):
        terms = []
        for b in range(B):
            for i in range(T):
                if i + 2 + j < lengths[b] and loss_mask[b, i + 2 + j]:
                    target = hidden[b, i + 1 + j]
                    feat = F.smooth_l1_loss(o[b, i], target)
                    ce = -(torch.softmax(W @ target, -1) * torch.log_softmax(W @ o[b, i], -1)).sum()
                    terms.append(0.3 * feat + 0.9 * ce)
        assert m[f"d{j + 1}/n"] == len(terms) > 0
        expect += 0.5 ** j * torch.stack(terms).mean()
    torch.testing.assert_close(total, expect, rtol=1e-5, atol=1e-5)
    assert m["loss"] == pytest.approx(total.item())


@pytest.mark.parametrize("bad", [dict(w_feat=-1.0), dict(w_feat=0.0, w_logit=0.0), dict(temperature=0.0),
                                 dict(gamma=1.5), dict(chunk_tokens=0)])
def test_bad_loss_config(bad):
    with pytest.raises(ValueError, match="loss\\."):
        LossConfig(**bad)


def test_bf16_lm_head_close_to_fp32():
    """GPU runs keep W in bf16: loss and gradient stay within bf16 rounding of the fp32 computation."""
    torch.manual_seed(3)
    N, Hd, V = 40, 32, 211
    W = torch.randn(V, Hd) * 0.3
    y, weight = torch.randn(N, Hd), torch.full((N,), 1 / N)
    x1 = torch.randn(N, Hd, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    loss, _ = distill_ce(x1, y, W.bfloat16(), weight, 1.0, 16)
    ref, _, _ = direct(x2, y, W, weight, 1.0)
    loss.backward()
    ref.backward()
    assert x1.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=5e-2, atol=5e-3)


def test_nothing_counted_gives_zero_loss_with_a_graph():
    """A batch with no trainable predicted token: loss 0 that still backpropagates (zeros)."""
    h_hat = torch.randn(1, 5, 8, requires_grad=True)
    total, m = head_loss([h_hat], torch.randn(1, 5, 8), torch.zeros(1, 5, dtype=torch.int8), torch.tensor([5]),
                         torch.randn(11, 8), LossConfig())
    total.backward()
    assert total.item() == 0.0 and m["d1/n"] == 0 and torch.equal(h_hat.grad, torch.zeros_like(h_hat))
