"""The training objective: the chunked distribution loss against a direct computation (value, gradient,
metrics), the prediction mask, and the per-depth weighting."""

import pytest
import torch
import torch.nn.functional as F

from mtp_train.train.distill import distill_ce
from mtp_train.train.loss import LossConfig, head_loss, predicted_mask


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


def test_the_soft_cross_entropy_has_the_gradient_of_the_kl_divergence_the_peers_train_with():
    """KL(p || q) = CE(p, q) - H(p) and H(p) does not depend on the draft: a trainer minimising the forward KL
    (speculators' loss) steps exactly as ours does; the loss differs by the target's entropy alone."""
    torch.manual_seed(3)
    N, Hd, V = 29, 16, 61
    W, y, weight = torch.randn(V, Hd), torch.randn(N, Hd), torch.rand(N)
    x1 = torch.randn(N, Hd, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    loss, _ = distill_ce(x1, y, W, weight, 0.8, 8)
    p = torch.softmax(y @ W.T / 0.8, -1)
    kl = (weight * F.kl_div(torch.log_softmax(x2 @ W.T, -1), p, reduction="none").sum(-1)).sum()
    entropy = -(weight * (p * p.log()).sum(-1)).sum()
    torch.testing.assert_close(loss, kl + entropy, rtol=1e-5, atol=1e-5)
    loss.backward()
    kl.backward()
    assert x2.grad.abs().max() > 0.1
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("accept_weight", [0.3, 1.0])
def test_the_lk_term_has_the_value_and_gradient_of_its_formula(accept_weight):
    """`accept_weight` w: each row's term is (1 - w) CE(q, p) + w (-log α), α = Σ min(p, q); autograd through
    that formula gives the same loss and gradient, and the metrics stay the CE's argmax agreement and α."""
    torch.manual_seed(5)
    N, Hd, V = 37, 16, 83
    W, y, weight = torch.randn(V, Hd), torch.randn(N, Hd), torch.rand(N)
    x1 = torch.randn(N, Hd, requires_grad=True)
    x2 = x1.detach().double().requires_grad_(True)  # the formula in float64: -log α's gradient, (1[q < p] - A)
    loss, metrics = distill_ce(x1, y, W, weight, 1.0, 8, accept_weight=accept_weight)  # / α, is the less exact
    log_q = torch.log_softmax(x2 @ W.double().T, -1)
    p = torch.softmax(y.double() @ W.double().T, -1)
    alpha = torch.minimum(p, log_q.exp()).sum(-1)
    ref = (weight * ((1 - accept_weight) * -(p * log_q).sum(-1) - accept_weight * alpha.log())).sum()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    (2.5 * loss).backward()
    (2.5 * ref).backward()
    assert x2.grad.abs().max() > 1
    torch.testing.assert_close(x1.grad.double(), x2.grad, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(metrics[:, 1].double(), alpha.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics[:, 0], (log_q.argmax(-1) == p.argmax(-1)).float())


@pytest.mark.parametrize("accept_weight", [0.0, 0.5])
def test_the_top_k_term_has_the_value_and_gradient_of_its_formula(accept_weight):
    """HASS's top-K distillation (`topk_weight` w_k, `topk` K) over the full vocabulary: each row adds
    w_k (-Σ_{x in top-K(p)} p_x log q_x) to its term, alone or beside the LK term; autograd through the formula
    gives the same loss and gradient, and the term only adds weight on the target's K likeliest tokens."""
    torch.manual_seed(8)
    N, Hd, V, K = 29, 16, 71, 5
    W, y, weight = torch.randn(V, Hd), torch.randn(N, Hd), torch.rand(N)
    x1 = torch.randn(N, Hd, requires_grad=True)
    x2 = x1.detach().double().requires_grad_(True)
    loss, _ = distill_ce(x1, y, W, weight, 1.0, 8, accept_weight=accept_weight, topk=(0.7, K))
    log_q = torch.log_softmax(x2 @ W.double().T, -1)
    p = torch.softmax(y.double() @ W.double().T, -1)
    on_top = torch.zeros_like(p).scatter_(-1, p.topk(K, -1).indices, 1.0)
    alpha = torch.minimum(p, log_q.exp()).sum(-1)
    ref = (weight * ((1 - accept_weight) * -(p * log_q).sum(-1) - accept_weight * alpha.log()
                     + 0.7 * -(on_top * p * log_q).sum(-1))).sum()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    (2.5 * loss).backward()
    (2.5 * ref).backward()
    torch.testing.assert_close(x1.grad.double(), x2.grad, rtol=1e-3, atol=1e-4)
    without, _ = distill_ce(x1.detach(), y, W, weight, 1.0, 8, accept_weight=accept_weight)
    assert loss.item() > without.item()


def test_the_lk_term_raises_acceptance_where_cross_entropy_trades_it_away():
    """The case the LK loss is for: a draft that cannot represent the target. Its own lm_head (a draft vocabulary
    of 3 tokens) gives logits (s, 0, -s), one degree of freedom, against p = (0.6, 0.05, 0.35). Fitted by
    gradient descent through `distill_ce`, cross-entropy stops at its optimum (s = 0.38, α = 0.732); the
    acceptance objective goes on to the higher α of s = 0.78 (0.775)."""
    p = torch.tensor([0.6, 0.05, 0.35])
    W = torch.stack([p.log(), torch.zeros(3)], -1)  # the target: softmax(W y) = p at y = (1, 0)
    y, ids = torch.tensor([[1.0, 0.0]]), torch.arange(3)
    Wd = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])  # the draft's own lm_head

    def fit(w):
        x = torch.tensor([[0.1, 0.0]], requires_grad=True)  # s = 0 is a stationary point of α
        opt = torch.optim.SGD([x], lr=0.3)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / 400)  # α has a kink at its optimum
        for _ in range(400):
            loss, metrics = distill_ce(x, y, W, torch.ones(1), 1.0, 8, Wd, ids, W, accept_weight=w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            decay.step()
        return x[0, 0].item(), metrics[0, 1].item()

    (s_ce, a_ce), (s_lk, a_lk) = fit(0.0), fit(1.0)
    assert s_ce == pytest.approx(0.38, abs=0.01) and a_ce == pytest.approx(0.732, abs=0.001)
    assert s_lk == pytest.approx(0.78, abs=0.04) and a_lk == pytest.approx(0.775, abs=0.003)


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
                                 dict(gamma=1.5), dict(chunk_tokens=0), dict(accept_weight=1.5),
                                 dict(out_of_vocab="keep"), dict(align_topk=-1),
                                 dict(topk_weight=-0.1), dict(topk=0)])
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
