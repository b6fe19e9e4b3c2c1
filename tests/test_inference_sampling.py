"""Sampling and verification, on synthetic distributions: the logits processing, greedy verification,
and rejection sampling reproducing the target's distribution exactly (chi-square) for a draft that is
far from it, while the draft's own samples fail the same test."""

import pytest
import torch

from mtp_train.inference.sampling import (SamplingConfig, probabilities, sample, verify_greedy,
                                          verify_sampled)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's test of observed counts against probabilities; cells expecting fewer than `min_expected`
    samples are pooled into one. Returns the p-value (chi-square survival function via gammaincc)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token the target gives probability 0 was emitted"
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_probabilities_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    torch.testing.assert_close(probabilities(logits, SamplingConfig(temperature=1.0)), torch.softmax(logits, -1))
    torch.testing.assert_close(probabilities(logits, SamplingConfig(temperature=0.5)), torch.softmax(logits / 0.5, -1))
    greedy = probabilities(logits, SamplingConfig())
    assert greedy.tolist() == [[0, 0, 0, 0, 1.0]]
    top2 = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (top2 > 0).tolist() == [[True, False, False, False, True]]
    torch.testing.assert_close(top2[0, [4, 0]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    # softmax = [.237, .087, .032, .012, .644]: top_p 0.7 keeps {4, 0} (0.644 < 0.7, 0.881 >= 0.7)
    nucleus = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert (nucleus > 0).tolist() == [[True, False, False, False, True]]
    assert (probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.5)) > 0).sum() == 1  # the top token alone
    torch.testing.assert_close(nucleus.sum(-1), torch.ones(1))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingConfig(**bad)


def one_hot_logits(tokens, V=7):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float() * 5


def test_verify_greedy():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    target = torch.stack([one_hot_logits([1, 2, 3, 6]),   # all kept: bonus 6
                          one_hot_logits([1, 5, 3, 6]),   # second draft wrong: correction 5
                          one_hot_logits([0, 2, 3, 6]),   # first wrong
                          one_hot_logits([1, 2, 3, 6])])  # all match, but the row drafted only 2
    accepted, nxt = verify_greedy(drafts, target, torch.tensor([3, 3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0, 2] and nxt.tolist() == [6, 5, 0, 3]


def test_rejection_sampling_with_one_hot_distributions_is_greedy():
    """Greedy is the temperature -> 0 limit: with one-hot p and q the rejection rule keeps exactly the
    matching drafts and emits the target's argmax."""
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    target = torch.stack([one_hot_logits([1, 2, 3, 6]), one_hot_logits([1, 5, 3, 6]), one_hot_logits([0, 2, 3, 6])])
    q = torch.nn.functional.one_hot(drafts, 7).float()
    p = probabilities(target, SamplingConfig())
    for seed in range(5):
        got = verify_sampled(drafts, q, p, generator=torch.Generator().manual_seed(seed))
        assert [t.tolist() for t in got] == [t.tolist() for t in verify_greedy(drafts, target)]


def test_identical_draft_is_always_accepted():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(64, 4, 11), -1)
    drafts = sample(p[:, :3])
    accepted, nxt = verify_sampled(drafts, p[:, :3], p, generator=torch.Generator().manual_seed(1))
    assert accepted.tolist() == [3] * 64  # p/q = 1 everywhere: nothing is rejected


V, N = 6, 40_000


def tables(seed):
    """A target and a very different draft, each a table of next-token distributions given the previous
    token: the draft puts most of its mass where the target puts little."""
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    Q = torch.softmax(-torch.log(P) * 1.2 + torch.randn(V, V, generator=g) * 0.3, -1)  # anti-correlated
    return P, Q


def speculative_pairs(P, Q, k, num_drafts, g):
    """Run speculative steps with table models for N sequences starting at token 0 until each has emitted
    two tokens; return the first two, [N, 2]. Row n verifies num_drafts[n] (<= k) drafts per step."""
    out = torch.full((N, 2), -1)
    filled = torch.zeros(N, dtype=torch.long)
    prev = torch.zeros(N, dtype=torch.long)
    while bool((filled < 2).any()):
        drafts, qs, tok = [], [], prev
        for _ in range(k):
            q = Q[tok]
            tok = torch.multinomial(q, 1, generator=g).squeeze(1)
            drafts.append(tok)
            qs.append(q)
        drafts, qs = torch.stack(drafts, 1), torch.stack(qs, 1)
        path = torch.cat([prev[:, None], drafts], 1)  # the target conditions on the draft path
        accepted, nxt = verify_sampled(drafts, qs, P[path], num_drafts, g)
        emitted = torch.cat([drafts, torch.zeros(N, 1, dtype=torch.long)], 1)
        emitted[torch.arange(N), accepted] = nxt
        for j in range(k + 1):
            write = (j <= accepted) & (filled < 2)
            out[write, filled[write]] = emitted[write, j]
            filled = filled + write.long()
        prev = nxt
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_reproduces_the_target_distribution(k):
    """The joint distribution of the first two emitted tokens equals the target's, P(x1) P(x2 | x1), within a
    chi-square test at significance 1e-3 over 36 cells, for a strongly different draft, with rows that
    verify all k drafts and rows that verify fewer (down to none). The draft alone is rejected at 1e-6."""
    P, Q = tables(seed=k)
    g = torch.Generator().manual_seed(100 + k)
    num_drafts = torch.randint(0, k + 1, (N,), generator=g)
    num_drafts[: N // 2] = k
    pairs = speculative_pairs(P, Q, k, num_drafts, g)
    joint = P[0][:, None] * P  # P(x1 = a) P(x2 = b | a)
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    assert chi_square_p_value(counts, joint) > 1e-3
    # the same test has the power to see the draft's own distribution
    x1 = torch.multinomial(Q[0], N, replacement=True, generator=g)
    x2 = torch.multinomial(Q[x1], 1, generator=g).squeeze(1)
    assert chi_square_p_value(torch.bincount(x1 * V + x2, minlength=V * V), joint) < 1e-6


def test_rejection_sampling_of_processed_distributions():
    """With top-k / top-p / temperature applied to both sides, the emitted token follows the processed target
    distribution, and never a token that processing removed."""
    g = torch.Generator().manual_seed(5)
    cfg = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)
    target_logits = torch.randn(1, 2, 12, generator=g).expand(N, 2, 12)
    draft_logits = torch.randn(1, 1, 12, generator=g).expand(N, 1, 12) * 2
    p, q = probabilities(target_logits, cfg), probabilities(draft_logits, cfg)
    drafts = sample(q, g)
    accepted, nxt = verify_sampled(drafts, q, p, generator=g)
    emitted = torch.where(accepted > 0, drafts[:, 0], nxt)
    counts = torch.bincount(emitted, minlength=12)
    assert counts[p[0, 0] == 0].sum() == 0
    assert chi_square_p_value(counts, p[0, 0]) > 1e-3
