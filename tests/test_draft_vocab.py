"""The draft vocabulary (`head.draft_vocab=N`): chosen deterministically from the train store's trained tokens,
kept by the head (`d2t` / `t2d`, EAGLE-3's convention) in every checkpoint, applied where logits are formed:
the loss equals a direct full-logits computation over the subset (gradients and metrics too), a trained
head resumes exactly and refuses another size, greedy speculative output is the target's own, sampled output
follows the target's distribution, and export leaves the mapping out and says so."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.drafters import HeadDrafter
from mtp_train.inference.speculative import generate, SpeculativeDecoder
from mtp_train.model.head import DraftHead, DraftLMHead, HeadConfig, unrolled
from mtp_train.store.format import identity_for, write_split
from mtp_train.store.reader import StoreReader
from mtp_train.train import checkpoint as ckpt
from mtp_train.train.distill import distill_ce
from mtp_train.train.loss import LossConfig, TargetStats, head_loss, needed_positions
from mtp_train.train.trainer import Trainer
from mtp_train.train.vocab import choose_draft_vocab, most_frequent, trained_token_counts
from test_inference import (NEW, ROWS, STOP, VOCAB, fresh_prefill, prompts, reference, target,  # noqa: F401 (fixtures)
                            tiny_lm)
from test_train import config, killed_after, losses, samples  # noqa: F401 (fixture)
from windows import make_store


# -- construction ----------------------------------------------------------------------------------------------
def test_most_frequent_breaks_ties_by_id_and_fills_with_unseen_ids():
    counts = torch.tensor([5, 0, 3, 5, 1, 3, 0, 2])
    assert most_frequent(counts, 3).tolist() == [0, 2, 3]  # 5, 5, then 3 (ids 2 and 5): the smaller id
    assert most_frequent(counts, 5).tolist() == [0, 2, 3, 5, 7]
    assert most_frequent(counts, 7).tolist() == [0, 1, 2, 3, 4, 5, 7]  # six seen, then the smallest unseen id


def test_counted_from_the_trained_positions_of_the_store(tmp_path):
    """Only tokens whose loss_mask is set count (token 5 is the commonest token but never trained), over every
    shard of the split; the same store gives the same vocabulary."""
    rows = [([7, 3, 3, 9, 3, 2], [0, 1, 1, 1, 0, 1]), ([9, 9, 1, 4], [1, 1, 0, 1]), ([5, 5, 5, 5], [0, 0, 0, 0]),
            ([4, 2, 11], [1, 1, 1])]
    samples = [{"hidden": torch.randn(len(ids), 4), "input_ids": torch.tensor(ids),
                "loss_mask": torch.tensor(mask, dtype=torch.int8)} for ids, mask in rows]
    write_split(tmp_path / "train", samples, identity=identity_for(), shard_mb=1e-4)
    reader = StoreReader(tmp_path / "train")
    assert len(reader.manifest["shards"]) > 1
    want = torch.zeros(16, dtype=torch.long)
    want[[2, 3, 4, 9, 11]] = torch.tensor([2, 2, 2, 3, 1])
    assert torch.equal(trained_token_counts(reader, 16), want)
    vocab = choose_draft_vocab(reader, 3, 16)
    assert vocab.ids.tolist() == [2, 3, 9] and vocab.coverage == pytest.approx(0.7) and vocab.unseen == 0
    assert torch.equal(choose_draft_vocab(reader, 3, 16).ids, vocab.ids)
    filled = choose_draft_vocab(reader, 7, 16)
    assert filled.ids.tolist() == [0, 1, 2, 3, 4, 9, 11] and filled.unseen == 2 and filled.coverage == 1.0
    assert "2 of them never occur there" in filled.summary()
    record = filled.as_dict()
    assert record["token_ids"] == [0, 1, 2, 3, 4, 9, 11] and record["trained_positions"] == 10
    with pytest.raises(ValueError, match="token id 11, outside the target's vocabulary of 10"):
        trained_token_counts(reader, 10)


SMALL = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_hidden_layers=1, vocab_size=50)


def test_head_keeps_the_mapping_in_eagle3_convention():
    """Draft ids in ascending target-id order: target id = draft id + d2t[draft id] (offsets >= 0), t2d marks
    the target ids inside; both are persistent buffers (in every checkpoint) and load back."""
    head = DraftHead(SMALL, HeadConfig(draft_vocab=6))
    head.set_draft_vocab(torch.tensor([40, 2, 7, 9, 11, 30]))
    ids = torch.tensor([2, 7, 9, 11, 30, 40])
    draft = torch.arange(6)
    assert torch.equal(draft + head.d2t[draft], ids) and bool((head.d2t >= 0).all())
    assert torch.equal(head.t2d.nonzero().flatten(), ids) and head.t2d.shape == (50,)
    state = head.state_dict()
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    back = DraftHead(SMALL, HeadConfig(draft_vocab=6))
    back.load_state_dict(state)
    assert torch.equal(back.draft_ids, ids)
    W = torch.randn(50, 32)
    lm = back.draft_lm_head(W)
    assert torch.equal(lm.weight, W[ids]) and lm.to_target(torch.tensor([0, 5])).tolist() == [2, 40]
    q = lm.to_target_probs(torch.full((1, 6), 1 / 6), 50)
    assert q.shape == (1, 50) and torch.equal(q[0].nonzero().flatten(), ids)
    full = DraftHead(SMALL).draft_lm_head(W)
    assert full.weight is W and full.ids is None and "d2t" not in DraftHead(SMALL).state_dict()
    for bad in ([1, 1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 3, 4, 5, 50]):
        with pytest.raises(ValueError, match="expected 6 distinct target ids"):
            head.set_draft_vocab(torch.tensor(bad))
    with pytest.raises(ValueError, match="head.draft_vocab=50 is not below the target's vocabulary size 50"):
        DraftHead(SMALL, HeadConfig(draft_vocab=50))
    with pytest.raises(ValueError, match="head.draft_vocab=-1"):
        HeadConfig(draft_vocab=-1)


# -- the loss ----------------------------------------------------------------------------------------------------
def direct(x, y, W, ids, weight, temperature):
    """[N, V] at once: the CE against the target renormalised over the subset, rows whose target argmax is
    outside left out; the metrics with q zero outside the subset."""
    t = y @ W.T
    top = t.argmax(-1)
    inside = torch.isin(top, ids)
    p_sub = torch.softmax(t[:, ids] / temperature, -1)
    log_q = torch.log_softmax(x @ W[ids].T, -1)
    loss = -(weight * inside * (p_sub * log_q).sum(-1)).sum()
    q = torch.zeros_like(t)
    q[:, ids] = log_q.exp()
    accept = torch.minimum(torch.softmax(t / temperature, -1), q).sum(-1)
    return loss, (ids[log_q.argmax(-1)] == top).float(), accept, inside.float()


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draft_vocab_loss_equals_direct(chunk, temperature):
    torch.manual_seed(0)
    N, Hd, V = 53, 16, 97
    W, y, weight = torch.randn(V, Hd), torch.randn(N, Hd), torch.rand(N)
    ids = torch.randperm(V)[:40].sort().values
    x1 = torch.randn(N, Hd, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    loss, metrics = distill_ce(x1, y, W, weight, temperature, chunk, W[ids], ids)
    ref, acc, accept, inside = direct(x2, y, W, ids, weight, temperature)
    assert 0 < inside.sum() < N  # rows inside and outside the subset
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    (2.5 * loss).backward()
    (2.5 * ref).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-6)
    assert bool((x1.grad[inside == 0] == 0).all())  # out-of-vocabulary rows: no gradient
    torch.testing.assert_close(metrics[:, 0], acc)
    torch.testing.assert_close(metrics[:, 1], accept)
    torch.testing.assert_close(metrics[:, 2], inside)


def test_head_loss_with_a_draft_vocabulary_matches_the_formula():
    """CE and metrics per counted position, divided by all counted positions (out-of-vocabulary ones count as
    zero loss and as misses), so they compare with a full-vocabulary head; `in_vocab` besides."""
    torch.manual_seed(2)
    B, T, Hd, V = 2, 9, 8, 31
    hidden, W = torch.randn(B, T, Hd), torch.randn(V, Hd)
    outs = [torch.randn(B, T, Hd) for _ in range(2)]
    loss_mask, lengths = (torch.rand(B, T) > 0.3).to(torch.int8), torch.tensor([9, 6])
    head = DraftHead(LlamaConfig(**{**SMALL.to_dict(), "hidden_size": Hd, "head_dim": 2, "vocab_size": V}),
                     HeadConfig(draft_vocab=12))
    head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:12])
    ids = head.draft_ids
    cfg = LossConfig(w_feat=0.3, w_logit=0.9, gamma=0.5, chunk_tokens=4)
    total, m = head_loss(outs, hidden, loss_mask, lengths, W, cfg, draft=head.draft_lm_head(W))
    expect = 0.0
    for j, o in enumerate(outs):
        rows = [(b, i) for b in range(B) for i in range(T) if i + 2 + j < lengths[b] and loss_mask[b, i + 2 + j]]
        x = torch.stack([o[b, i] for b, i in rows])
        y = torch.stack([hidden[b, i + 1 + j] for b, i in rows])
        feat = torch.stack([torch.nn.functional.smooth_l1_loss(a, t) for a, t in zip(x, y)])
        ce, acc, accept, inside = direct(x, y, W, ids, torch.ones(len(rows)), 1.0)
        n = len(rows)
        assert m[f"d{j + 1}/n"] == n
        expect += 0.5 ** j * (0.3 * feat.mean() + 0.9 * ce / n)
        assert m[f"d{j + 1}/ce"] == pytest.approx(ce.item() / n, rel=1e-5)
        assert m[f"d{j + 1}/acc"] == pytest.approx(acc.mean().item())
        assert m[f"d{j + 1}/accept"] == pytest.approx(accept.mean().item(), rel=1e-5)
        assert m[f"d{j + 1}/in_vocab"] == pytest.approx(inside.mean().item())
    torch.testing.assert_close(total, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("own_lm_head,accept_weight,out_of_vocab,topk_weight", [
    (False, 0.0, "drop", 0.0), (True, 0.0, "drop", 0.0), (False, 0.6, "drop", 0.0), (True, 1.0, "drop", 0.0),
    (True, 0.0, "renormalise", 0.0), (False, 0.6, "renormalise", 0.0), (True, 0.0, "drop", 0.7),
    (False, 0.6, "renormalise", 0.7)])
def test_head_loss_over_a_draft_vocabulary_has_the_gradients_of_the_formula(chunk, own_lm_head, accept_weight,
                                                                           out_of_vocab, topk_weight):
    """All depths in one pass over the target positions (`SharedTargetDistill`, chunked by position): the loss,
    its gradients with respect to every depth's output and to a trainable draft lm_head (an eagle3 head's own),
    and the per-depth metrics equal depth-by-depth autograd through the direct formula, at a temperature; with
    the LK term (`accept_weight`), each kept row's term is (1 - w) CE + w (-log Σ min(p_full, q)). A row whose
    target argmax is outside the draft vocabulary has no term (`out_of_vocab="drop"`) or the same as any other
    ("renormalise"); it stays in the mean either way, and `in_vocab` counts it as outside. With HASS's top-K term
    (`topk_weight` w_k, K = 4 here) a kept row adds w_k (-Σ over the target's 4 likeliest draft tokens of p log q)."""
    torch.manual_seed(4)
    B, T, Hd, V, M, depth = 3, 10, 8, 41, 15, 3
    hidden, W = torch.randn(B, T, Hd), torch.randn(V, Hd)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:M].sort().values
    loss_mask, lengths = (torch.rand(B, T) > 0.25).to(torch.int8), torch.tensor([10, 7, 9])
    outs = [torch.randn(B, T, Hd, requires_grad=True) for _ in range(depth)]
    Wd = (torch.randn(M, Hd) if own_lm_head else W[ids].clone()).requires_grad_(own_lm_head)
    draft = DraftLMHead(Wd, ids, W[ids] if own_lm_head else None)
    cfg = LossConfig(w_feat=0.2, w_logit=0.9, gamma=0.7, chunk_tokens=chunk, temperature=0.8,
                     accept_weight=accept_weight, out_of_vocab=out_of_vocab, topk_weight=topk_weight, topk=4)
    total, m = head_loss(outs, hidden, loss_mask, lengths, W, cfg, draft=draft)
    ref_outs = [o.detach().clone().requires_grad_(True) for o in outs]
    ref_wd = Wd.detach().clone().requires_grad_(own_lm_head)
    expect = 0.0
    for j, o in enumerate(ref_outs):
        rows = [(b, i) for b in range(B) for i in range(T) if i + 2 + j < lengths[b] and loss_mask[b, i + 2 + j]]
        x = torch.stack([o[b, i] for b, i in rows])
        y = torch.stack([hidden[b, i + 1 + j] for b, i in rows])
        t = y @ W.T
        inside = torch.isin(t.argmax(-1), ids)
        counts = inside if out_of_vocab == "drop" else torch.ones_like(inside)
        log_q = torch.log_softmax(x @ ref_wd.T, -1)
        ce = -(counts * (torch.softmax(t[:, ids] / 0.8, -1) * log_q).sum(-1))
        feat = torch.nn.functional.smooth_l1_loss(x, y, reduction="none").mean(-1)
        q = torch.zeros_like(t)
        q[:, ids] = log_q.exp()
        alpha = torch.minimum(torch.softmax(t / 0.8, -1), q).sum(-1)
        term = (1 - accept_weight) * ce + accept_weight * counts * -alpha.clamp_min(1e-4).log()
        p_sub = torch.softmax(t[:, ids] / 0.8, -1)
        top4 = torch.zeros_like(p_sub).scatter_(-1, p_sub.topk(4, -1).indices, 1.0)
        term = term + topk_weight * counts * -(top4 * p_sub * log_q).sum(-1)
        expect = expect + 0.7 ** j * (0.2 * feat.mean() + 0.9 * term.mean())
        assert m[f"d{j + 1}/n"] == len(rows)
        assert m[f"d{j + 1}/ce"] == pytest.approx(ce.mean().item(), rel=1e-5)
        assert m[f"d{j + 1}/acc"] == pytest.approx((ids[log_q.argmax(-1)] == t.argmax(-1)).float().mean().item())
        assert m[f"d{j + 1}/accept"] == pytest.approx(
            torch.minimum(torch.softmax(t / 0.8, -1), q).sum(-1).mean().item(), rel=1e-5)
        assert m[f"d{j + 1}/in_vocab"] == pytest.approx(inside.float().mean().item())
        assert 0 < inside.float().mean() < 1  # both kinds of rows are there
    torch.testing.assert_close(total, expect, rtol=1e-5, atol=1e-5)
    (1.5 * total).backward()
    (1.5 * expect).backward()
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o.grad, r.grad, rtol=1e-4, atol=1e-6)
    if own_lm_head:
        torch.testing.assert_close(Wd.grad, ref_wd.grad, rtol=1e-4, atol=1e-5 if accept_weight else 1e-6)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("vocab", ["draft", "draft-per-depth", "full"])
def test_the_alignment_mask_keeps_the_rows_decoding_reaches(k, vocab, monkeypatch):
    """`loss.align_topk` (GRIFFIN's token-alignable training): an anchor's row at depth j counts only while the
    draft's top-k at every earlier depth held the target's full-vocabulary argmax; the others have no term, stay in
    the mean's denominator and in acc / accept; `reached` is the share that counts and `ce` is over those rows.
    Loss, gradients and metrics against a direct per-anchor reference, over a draft vocabulary (one shared pass, or
    a `ce` given, one call per depth) and over the full vocabulary. Per depth at k = 1 the CE's own agreement column
    is the test: no extra pass over the vocabulary (`draft_holds`) is made."""
    from mtp_train.train import loss as loss_module
    holds_calls = []
    real_holds = loss_module.draft_holds
    monkeypatch.setattr(loss_module, "draft_holds", lambda *a, **kw: holds_calls.append(1) or real_holds(*a, **kw))
    torch.manual_seed(6)
    B, T, Hd, V, M, depth = 3, 12, 8, 41, 15, 3
    hidden, W = torch.randn(B, T, Hd), torch.randn(V, Hd)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(2))[:M].sort().values
    if vocab.startswith("draft"):  # targets whose argmax is mostly a draft token, so that chains go on
        hidden = 0.3 * hidden + 0.8 * W[ids][torch.randint(M, (B, T))]
    loss_mask, lengths = (torch.rand(B, T) > 0.2).to(torch.int8), torch.tensor([12, 9, 11])
    # each depth's output near the state it predicts: some drafts right, some wrong
    outs = [(torch.roll(hidden, -1 - j, 1) + 0.5 * torch.randn(B, T, Hd)).requires_grad_(True)
            for j in range(depth)]
    sub = vocab.startswith("draft")
    draft = DraftLMHead(W[ids].clone(), ids, None) if sub else None
    Wd, tid = (W[ids], ids) if sub else (W, torch.arange(V))
    cfg = LossConfig(w_feat=0.2, w_logit=0.9, gamma=0.7, chunk_tokens=5, align_topk=k)
    total, m = head_loss(outs, hidden, loss_mask, lengths, W, cfg, draft=draft,
                         ce=distill_ce if vocab == "draft-per-depth" else None)
    assert len(holds_calls) == (0 if k == 1 and vocab != "draft" else depth - 1)
    ref_outs = [o.detach().clone().requires_grad_(True) for o in outs]
    reach = {(b, i): True for b in range(B) for i in range(T)}
    expect, seen = 0.0, []
    for j, o in enumerate(ref_outs):
        rows = [(b, i) for b in range(B) for i in range(T) if i + 2 + j < lengths[b] and loss_mask[b, i + 2 + j]]
        x = torch.stack([o[b, i] for b, i in rows])
        y = torch.stack([hidden[b, i + 1 + j] for b, i in rows])
        t = y @ W.T
        kept = torch.tensor([reach[r] for r in rows], dtype=torch.float32)
        log_q = torch.log_softmax(x @ Wd.T, -1)
        inside = torch.isin(t.argmax(-1), tid).float()
        ce = -(inside * (torch.softmax(t[:, tid], -1) * log_q).sum(-1))
        feat = torch.nn.functional.smooth_l1_loss(x, y, reduction="none").mean(-1)
        expect = expect + 0.7 ** j * (0.2 * (kept * feat).mean() + 0.9 * (kept * ce).mean())
        assert m[f"d{j + 1}/reached"] == pytest.approx(kept.mean().item())
        assert m[f"d{j + 1}/ce"] == pytest.approx(((kept * ce).sum() / kept.sum()).item(), rel=1e-5)
        assert m[f"d{j + 1}/acc"] == pytest.approx((tid[log_q.argmax(-1)] == t.argmax(-1)).float().mean().item())
        holds = (tid[log_q.topk(k, -1).indices] == t.argmax(-1)[:, None]).any(-1)
        nxt = {r: False for r in reach}
        for r, h, kk in zip(rows, holds.tolist(), kept.tolist()):
            nxt[r] = h and kk > 0
        reach = nxt
        seen.append(kept.mean().item())
    assert seen[0] == 1 and 0 < seen[1] < 1 and 0 < seen[2] < seen[1]  # the mask is neither empty nor everything
    torch.testing.assert_close(total, expect, rtol=1e-5, atol=1e-5)
    (1.5 * total).backward()
    (1.5 * expect).backward()
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o.grad, r.grad, rtol=1e-4, atol=1e-6)
    off, _ = head_loss(outs, hidden, loss_mask, lengths, W, LossConfig(w_feat=0.2, w_logit=0.9, gamma=0.7),
                       draft=draft)
    assert off.item() > total.item()  # without the mask every row counts


def test_target_stats_are_the_full_vocabulary_argmax_and_logsumexp_per_sample_whatever_the_batch():
    """`TargetStats` at the positions the loss reads equals argmax / logsumexp of W h / T formed directly; a
    sample gives the same bits alone or padded in a batch, and from the cache on its second visit; the cache
    keeps nothing past its budget and nothing without indices."""
    g = torch.Generator().manual_seed(5)
    V, H, T = 300, 16, 11
    W = torch.randn(V, H, generator=g)
    hidden = torch.randn(3, T, H, generator=g)
    lengths = torch.tensor([11, 7, 9])
    mask = torch.rand(3, T, generator=g) > 0.3
    mask &= torch.arange(T)[None] < lengths[:, None]
    for temperature in (1.0, 0.7):
        stats = TargetStats(W, temperature, chunk=4, max_mb=1.0)
        top, lse = stats(hidden, mask, lengths, 3, torch.tensor([10, 11, 12]))
        need = needed_positions(mask, lengths, 3)
        assert need.any() and not need[:, 0].any()  # h_0 is no anchor's target
        logits = hidden @ W.T
        assert torch.equal(top[need], logits.argmax(-1)[need])
        assert torch.allclose(lse[need], (logits / temperature).logsumexp(-1)[need], atol=1e-5)
        for b in range(3):
            n = int(lengths[b])
            alone = TargetStats(W, temperature, chunk=4)(hidden[b:b + 1, :n], mask[b:b + 1, :n], lengths[b:b + 1], 3)
            assert torch.equal(alone[0][0], top[b, :n]) and torch.equal(alone[1][0], lse[b, :n])
        again = stats(hidden[[2, 0]], mask[[2, 0]], lengths[[2, 0]], 3, torch.tensor([12, 10]))
        assert (stats.hits, stats.misses) == (2, 3)
        assert torch.equal(again[0], top[[2, 0]]) and torch.equal(again[1], lse[[2, 0]])
    small = TargetStats(W, 1.0, chunk=4, max_mb=100 / 2**20)  # room for 12 tokens: the first sample only
    small(hidden, mask, lengths, 3, torch.tensor([0, 1, 2]))
    assert list(small.kept) == [0] and small.bytes == 88
    unindexed = TargetStats(W, 1.0, chunk=4, max_mb=1.0)
    unindexed(hidden, mask, lengths, 3)
    assert not unindexed.kept


def test_the_target_stats_cache_changes_no_bit_of_training(tmp_path, samples, tiny_dir):  # noqa: F811
    """Three epochs with the cache and with train.target_stats_cache_mb=0: the same losses, validation metrics
    and weights, bit for bit; with it the full-vocabulary stats of epochs 2 and 3 are read, not recomputed."""
    args = ("head.draft_vocab=200", "train.steps=12", "train.micro_batch=4", "train.depth=2", "train.lr=1e-3",
            "train.eval_every=4")
    runs = {}
    for name, cache in (("cached", "1024"), ("recomputed", "0")):
        make_store(tmp_path / name, samples, tiny_dir / "target", n_train=16)
        runs[name] = Trainer(config(tmp_path / name, *args, f"train.target_stats_cache_mb={cache}"))
        runs[name].fit()
    train, val = runs["cached"].target_stats["train"], runs["cached"].target_stats["val"]
    assert (train.misses, train.hits) == (16, 32) and val.hits > 0
    assert runs["recomputed"].target_stats["train"].hits == 0 and not runs["recomputed"].target_stats["train"].kept
    rows = {n: [json.loads(line) for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
            for n in runs}
    strip = [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k} for r in rows["cached"]]
    assert strip == [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k} for r in rows["recomputed"]]
    wa = ckpt.load_head_state(tmp_path / "cached" / "checkpoints" / "step-000012")
    wb = ckpt.load_head_state(tmp_path / "recomputed" / "checkpoints" / "step-000012")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_full_vocabulary_head_computes_what_it_did():
    torch.manual_seed(4)
    hidden, W, outs = torch.randn(2, 7, 32), torch.randn(50, 32), [torch.randn(2, 7, 32)]
    mask, lengths = torch.ones(2, 7, dtype=torch.bool), torch.tensor([7, 5])
    a = head_loss(outs, hidden, mask, lengths, W, LossConfig(chunk_tokens=3))
    b = head_loss(outs, hidden, mask, lengths, W, LossConfig(chunk_tokens=3), draft=DraftHead(SMALL).draft_lm_head(W))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and "d1/in_vocab" not in b[1]


# -- training ----------------------------------------------------------------------------------------------------
def expected_vocab(samples, n: int, V: int = 8192) -> list[int]:
    counts = torch.zeros(V, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()], minlength=V)
    return sorted(sorted(range(V), key=lambda t: (-int(counts[t]), t))[:n]), counts


def test_training_with_a_draft_vocabulary(tmp_path, samples, tiny_dir, capsys):  # noqa: F811
    """The N most frequent trained tokens of store/train, recorded in draft_vocab.json and in the checkpoint
    (read back as validate, generate and export read it); the head learns, with honest metrics."""
    from mtp_train.model.checkpoint import read_head

    make_store(tmp_path, samples, tiny_dir / "target")
    N = 256
    cfg = config(tmp_path, f"head.draft_vocab={N}", "train.steps=24", "train.lr=2e-3", "train.depth=2")
    summary = Trainer(cfg).fit()
    want, counts = expected_vocab(samples[:48], N)
    record = json.loads((tmp_path / "draft_vocab.json").read_text())
    assert record["token_ids"] == want and record["draft_vocab"] == N and record["target_vocab"] == 8192
    assert record["coverage"] == pytest.approx(counts[want].sum().item() / counts.sum().item())
    assert 0.5 < record["coverage"] < 1 and f"covering {record['coverage']:.1%}" in capsys.readouterr().out
    path = ckpt.latest(tmp_path / "checkpoints")
    state, meta = ckpt.load_head_state(path), ckpt.load_meta(path)
    assert meta["head"]["draft_vocab"] == N and meta["draft_vocab_coverage"] == record["coverage"]
    assert (state["d2t"] + torch.arange(N)).tolist() == want and state["t2d"].nonzero().flatten().tolist() == want
    head, _ = read_head(cfg)
    assert head.draft_ids.tolist() == want
    start, final = summary["start"], summary["final"]
    for k in (1, 2):
        assert 0 < final[f"d{k}/in_vocab"] < 1 and final[f"d{k}/acc"] <= final[f"d{k}/in_vocab"]
        assert final[f"d{k}/in_vocab"] == start[f"d{k}/in_vocab"]  # the target's, not the head's
    assert final["d1/acc"] > start["d1/acc"] + 0.15 and final["d1/accept"] > start["d1/accept"] + 0.15
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("train/d1/in_vocab" in r for r in rows) and any("val/d2/in_vocab" in r for r in rows)


def test_resume_with_a_draft_vocabulary_is_exact_and_refuses_another_size(tmp_path, samples, tiny_dir, monkeypatch):  # noqa: F811
    """Resumed in the second epoch: the uninterrupted run reads the target stats it kept from the first epoch,
    the resumed one starts with none and recomputes them; the losses and weights are the same bits."""
    args = ("head.draft_vocab=200", "train.steps=8", "train.save_every=5", "train.micro_batch=4", "train.depth=2",
            "train.lr=1e-3")
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    for d in (clean, broken):
        make_store(d, samples, tiny_dir / "target", n_train=16)  # 4 steps an epoch
    uninterrupted = Trainer(config(clean, *args))
    uninterrupted.fit()
    assert uninterrupted.target_stats["train"].hits == 16  # steps 5..8 read what steps 1..4 computed
    killed_after(config(broken, *args), 6, monkeypatch)  # step 6 is logged after the checkpoint of step 5
    resumed = Trainer(config(broken, *args, "resume=true"))
    assert (resumed.step, resumed.epoch, resumed.consumed) == (5, 1, 1)
    resumed.fit()
    assert resumed.target_stats["train"].hits == 0
    a, b = losses(clean), losses(broken)
    assert [a[s] for s in range(1, 9)] == [b[s] for s in range(1, 9)]
    wa = ckpt.load_head_state(clean / "checkpoints" / "step-000008")
    wb = ckpt.load_head_state(broken / "checkpoints" / "step-000008")
    assert wa.keys() == wb.keys() and "d2t" in wa and all(torch.equal(wa[k], wb[k]) for k in wa)
    for other in ("head.draft_vocab=100", "head.draft_vocab=0"):
        with pytest.raises(ValueError, match=r"trained with head.draft_vocab=200; this run has head.draft_vocab="):
            Trainer(config(broken, *args, other, "resume=true"))


# -- inference ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab_drafter(trained_run, tiny_run_config, tiny_dir, target):  # noqa: F811
    """The trained (full-vocabulary) head restricted to the 512 most frequent trained tokens of its store."""
    from mtp_train.model.checkpoint import read_head

    trained, _ = read_head(tiny_run_config(trained_run))
    head = DraftHead(AutoConfig.from_pretrained(tiny_dir / "target"),
                     HeadConfig(**{**asdict(trained.cfg), "draft_vocab": 512}))
    missing, unexpected = head.load_state_dict(trained.state_dict(), strict=False)
    assert sorted(missing) == ["d2t", "t2d"] and not unexpected
    head.set_draft_vocab(choose_draft_vocab(StoreReader(trained_run / "store" / "train"), 512, 8192).ids)
    return HeadDrafter(head.eval(), target.model.get_input_embeddings(), target.lm_head)


def test_greedy_speculative_output_with_a_draft_vocabulary_is_the_targets(vocab_drafter, target, prompts,  # noqa: F811
                                                                          reference):  # noqa: F811
    inside = vocab_drafter.head.t2d
    assert not all(bool(inside[t]) for r in reference for t in r)  # the target emits tokens the head cannot draft
    taus = []
    for k in range(1, 5):
        batch = generate(target, prompts, drafter=vocab_drafter, k=k, max_new_tokens=NEW, stop_tokens=STOP)
        assert batch.tokens == reference, f"k={k}, batch 8"
        taus.append(batch.stats.tau)
        alone = generate(target, [prompts[k + 3]], drafter=vocab_drafter, k=k, max_new_tokens=NEW, stop_tokens=STOP)
        assert alone.tokens[0] == reference[k + 3], f"k={k}, prompt {k + 3} alone"
    assert min(taus) > 1.2 and taus[3] > taus[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_come_from_the_draft_vocabulary(vocab_drafter, target, prompts, temperature):  # noqa: F811
    """Greedy: the argmax over the subset, as a target id. Sampled: q is softmax(W[ids] ĥ) scattered into
    the target's vocabulary (zero elsewhere), the distribution the training forward gives at that anchor."""
    prompt = prompts[1]
    dec = SpeculativeDecoder(target, [prompt], drafter=vocab_drafter, k=2, max_new_tokens=8)
    proposal = vocab_drafter.propose(dec.seqs, dec.features, 2, SamplingConfig(temperature=temperature),
                                     torch.Generator().manual_seed(0))
    head, ids = vocab_drafter.head, vocab_drafter.head.draft_ids
    assert all(bool(head.t2d[t]) for t in proposal.tokens[0].tolist())
    seq, P = dec.seqs[0], len(prompt)
    embed = target.model.get_input_embeddings()
    _, hidden = fresh_prefill(target, seq)  # h_0 .. h_P
    h = torch.cat([hidden, torch.zeros(1, hidden.shape[-1])])[None]
    with torch.no_grad():
        outs = unrolled(head, embed, h, torch.tensor([seq + [int(proposal.tokens[0, 0])]]), torch.tensor([P + 2]), 2)
    for j in range(2):
        logits = target.lm_head.weight[ids] @ outs[j][0, P - 1]
        if temperature == 0:
            assert int(proposal.tokens[0, j]) == int(ids[logits.argmax()])
        else:
            q = proposal.probs[0, j]
            assert q.shape == (8192,) and float(q.sum()) == pytest.approx(1.0, abs=1e-5)
            assert float(q[~head.t2d].abs().sum()) == 0.0
            torch.testing.assert_close(q[ids], torch.softmax(logits, -1), atol=1e-5, rtol=1e-4)


def test_sampled_speculative_decoding_with_a_draft_vocabulary_reproduces_the_target():
    """As tests/test_inference.py's chi-square test, with a random head that drafts over 5 of the 8 tokens:
    the first three new tokens follow the target's joint distribution, tokens outside the subset included."""
    from test_inference_sampling import chi_square_p_value

    from mtp_train.inference.runner import CausalLMRunner

    target_lm = CausalLMRunner(tiny_lm(0, 30.0))
    torch.manual_seed(2)
    head = DraftHead(target_lm.model.config, HeadConfig(draft_vocab=5))
    head.set_draft_vocab(torch.tensor([0, 2, 3, 5, 7]))
    drafter = HeadDrafter(head.eval(), target_lm.model.get_input_embeddings(), target_lm.lm_head)
    prompt = [3, 1, 4]
    out = generate(target_lm, [prompt] * ROWS, drafter=drafter, k=3, max_new_tokens=5,
                   sampling=SamplingConfig(temperature=1.0), generator=torch.Generator().manual_seed(7))
    firsts = torch.tensor([t[:3] for t in out.tokens])
    grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    model = target_lm.model
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(model(torch.tensor([prompt + [x] for x in range(VOCAB)])).logits[:, -1], -1)
        p3 = torch.softmax(model(torch.cat([torch.tensor(prompt).expand(len(grid), 3), grid], 1)).logits[:, -1], -1)
    joint = (p1[:, None] * p2).reshape(-1, 1) * p3
    cells = (firsts[:, 0] * VOCAB + firsts[:, 1]) * VOCAB + firsts[:, 2]
    assert chi_square_p_value(torch.bincount(cells, minlength=VOCAB ** 3), joint) > 1e-3
    outside = torch.isin(firsts, torch.tensor([1, 4, 6]))
    assert outside.float().mean() > 0.05  # the test sees tokens the head cannot draft
    accept = out.stats.acceptance_by_position
    assert out.stats.drafted[0] >= ROWS and 0.05 < accept[0] < 0.95


# -- export and memory -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mtp", "eagle1"])
def test_export_leaves_the_draft_vocabulary_out_and_says_so(tmp_path, variant):
    """Only vllm-mtp (and the EAGLE-3 layouts) carry a draft vocabulary; the others leave it out and say so."""
    from mtp_train.export.run import run as export
    from test_export import keys, saved_run, tiny_llama

    cfg, head, _ = saved_run(tmp_path, tiny_llama(), HeadConfig(variant=variant, draft_vocab=20))
    assert "d2t" in ckpt.load_head_state(ckpt.latest(Path(cfg.run_dir) / "checkpoints"))
    written = export(cfg)  # read back and checked against the trained head
    files = {"hf-mtp": "model.safetensors", "hf-mtp-stitched": "model-mtp.safetensors",
             "eagle-vllm": "model.safetensors", "eagle-sglang": "model.safetensors"}
    assert [p.name for p in written] == (["hf-mtp", "hf-mtp-stitched", "vllm-mtp"] if variant == "mtp"
                                         else ["eagle-vllm", "eagle-sglang"])
    for out in written:
        if out.name == "vllm-mtp":  # tests/test_export.py: test_vllm_mtp_carries_the_draft_vocabulary
            continue
        assert not keys(out / files[out.name]) & {"d2t", "t2d"}
        card = (out / "README.md").read_text()
        assert "## Draft vocabulary" in card and "draft vocabulary of 20 of the target's 101 tokens" in card
        assert ("drafts over the full vocabulary" if variant == "mtp" else "uses the target's full lm_head") in card


def test_memory_estimate_counts_the_draft_vocabulary():
    from mtp_train.train.memory import estimate_memory
    from mtp_train.train.config import TrainConfig

    big = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=128256)
    train = TrainConfig(micro_batch=4, depth=1)
    full = estimate_memory(big, train, 512, 1, "single", HeadConfig())
    small = estimate_memory(big, train, 512, 1, "single", HeadConfig(draft_vocab=32000))
    assert small.frozen - full.frozen == 32000 * 256 * 4
    assert small.buffers < full.buffers  # one [chunk, V] logits buffer instead of two, plus [chunk, N] ones
