"""Tree drafting: the tree's mask and positions, EAGLE-2's expansion and ancestor-closed selection on a
hand-computed example, the target's cache after a verified tree equal to a fresh prefill of the accepted
path, greedy tree decoding equal to target-only greedy decoding for every drafter (batch 1 and batch > 1),
sampled tree decoding reproducing the target's joint distribution (and a broken verifier failing the same
test), and the tree's acceptance beside the chain's."""

import pytest
import torch
from transformers import AutoConfig

from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.drafters import LMDrafter
from mtp_train.inference.runner import CausalLMRunner, left_pad
from mtp_train.inference.speculative import generate, SpeculativeDecoder
from mtp_train.inference import tree as tree_module
from mtp_train.inference.cache import SlotCache
from mtp_train.inference.tree import DraftTree, TreeConfig, grow, select
from mtp_train.model.head import DraftHead, HeadConfig

from test_inference import draft_lm, head_drafter, held_out, target  # noqa: E402,F401  (the engine tests' fixtures)

NEW = 12  # new tokens per prompt
SETTINGS = [TreeConfig(3, 2, 4), TreeConfig(4, 3, 8)]


@pytest.fixture(scope="module")
def eagle3_head(tiny_dir, target):
    """A random eagle3 head over a 512-token draft vocabulary: aux-layer features, its own lm_head."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_dir / "target")
    return head_drafter(DraftHead(config, HeadConfig(variant="eagle3", draft_vocab=512, aux_layers=[0, 1, 2])), target)


@pytest.fixture(scope="module")
def trained_head(trained_run, tiny_run_config, target):
    from mtp_train.inference.load import load_head

    return load_head(tiny_run_config(trained_run), target)[0]


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    """Held-out prompts: 2 function-writing conversations cut at the assistant turn (where the trained head
    drafts well) and 2 code snippets of different lengths."""
    return held_out(tiny_dir, 2, (5, 24))


@pytest.fixture(scope="module")
def reference(target, prompts):
    return [generate(target, [p], max_new_tokens=NEW).tokens[0] for p in prompts]


# -- the tree's structure ------------------------------------------------------------------------------------
def hand_tree():
    """pending -> a (node 0), b (node 1); b -> c (node 2), d (node 3); d -> e (node 4)."""
    t = lambda x: torch.tensor([x])  # noqa: E731
    return DraftTree(tokens=t([10, 11, 12, 13, 14]), parents=t([-1, -1, 1, 1, 3]), depth=t([1, 1, 2, 2, 3]),
                     scores=t([-0.1, -0.2, -0.3, -0.4, -0.5]))


def test_tree_config_refuses_what_cannot_be_built():
    assert TreeConfig(4, 3, 8).max_nodes == 3 + 3 * 9
    TreeConfig(2, 2, 7)  # 2 + 4 nodes: the largest tree
    for bad, message in [((0, 2, 4), r"tree.steps=0: must be >= 1"), ((3, 0, 4), r"tree.topk=0: must be >= 1"),
                         ((3, 2, 1), r"tree.num_draft_tokens=1: must be between 2"),
                         ((2, 2, 8), r"num_draft_tokens=8: must be between 2 .* and 1 \+ 6"),
                         ((1, 3, 5), r"and 1 \+ 3"), ((2.0, 2, 4), r"tree.steps=2.0: expected an integer")]:
        with pytest.raises(ValueError, match=message):
            TreeConfig(*bad)
    # in a recipe, the error names the list entry
    from mtp_train.config import ConfigError, compose

    with pytest.raises(ConfigError, match=r"validate.trees\[1\]: tree.num_draft_tokens=9: must be between 2"):
        compose("tiny", ["run_dir=r", "validate.trees=[{steps:2,topk:2,num_draft_tokens:3},"
                                      "{steps:2,topk:2,num_draft_tokens:9}]"])
    assert TreeConfig(4, 3, 8).shallower(1) == TreeConfig(1, 3, 4)
    assert TreeConfig(4, 3, 8).shallower(2) == TreeConfig(2, 3, 8)


def test_mask_positions_and_children_of_a_hand_built_tree():
    tree = hand_tree()
    #                       pending a  b  c  d  e
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],   # pending
                             [1, 1, 0, 0, 0, 0],   # a
                             [1, 0, 1, 0, 0, 0],   # b
                             [1, 0, 1, 1, 0, 0],   # c: b, itself
                             [1, 0, 1, 0, 1, 0],   # d: b, itself
                             [1, 0, 1, 0, 1, 1]],  # e: b, d, itself
                            dtype=torch.bool)
    assert torch.equal(tree.mask()[0], expected)
    assert tree.positions().tolist() == [[0, 1, 1, 2, 2, 3]]
    assert tree.children().tolist() == [[[0, 1], [-1, -1], [2, 3], [-1, -1], [4, -1], [-1, -1]]]
    # on a cache: row 0 holds 3 entries after a padding slot, row 1 two after two; the tree mask replaces the
    # new tokens' block, every valid cached slot stays visible
    cache = SlotCache(2)
    cache.valid = torch.tensor([[False, True, True, True], [False, False, True, True]])
    mask = cache.attention_mask(torch.ones(2, 6, dtype=torch.bool), torch.float32, tree=tree.mask().expand(2, 6, 6))
    allowed = mask == 0
    assert allowed.shape == (2, 1, 6, 10)
    assert torch.equal(allowed[0, 0, :, :4], cache.valid[0].expand(6, 4))
    assert torch.equal(allowed[1, 0, :, :4], cache.valid[1].expand(6, 4))
    assert torch.equal(allowed[:, 0, :, 4:], expected.expand(2, 6, 6))
    assert (mask[~allowed] == torch.finfo(torch.float32).min).all()
    positions = cache.lengths[:, None] + tree.positions()
    assert positions.tolist() == [[3, 4, 4, 5, 5, 6], [2, 3, 3, 4, 4, 5]]
    # a drafter's second tree forward: 2 earlier tree entries in the cache (W = 4 > T = 2); each new node sees
    # its parent among them and itself (an all-False tree still lets a token see itself)
    cache.valid = torch.ones(2, 6, dtype=torch.bool)
    seen = torch.tensor([[[0, 1, 0, 0], [1, 0, 0, 0]]], dtype=torch.bool).expand(2, 2, 4)
    allowed = cache.attention_mask(torch.ones(2, 2, dtype=torch.bool), torch.float32, tree=seen)[:, 0] == 0
    assert allowed[0].int().tolist() == [[1, 1, 1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0, 1]]
    with pytest.raises(ValueError, match="tree mask of shape"):
        cache.attention_mask(torch.ones(2, 2, dtype=torch.bool), torch.float32, tree=seen[:, :, :1])


def test_expansion_and_selection_by_cumulative_score():
    """topk 2, steps 3, 5 nodes, with fixed draft distributions over 5 tokens:
    depth 1: a=0 (.5), b=1 (.3)
    depth 2: a -> 2 (.5: .25), 3 (.3: .15); b -> 4 (.9: .27), 0 (.05: .015); frontier: b4 (.27), a2 (.25)
    depth 3: b4 -> 1 (.9: .243), 2 (.1); a2 -> 0 (.5: .125), 3 (.4: .1)
    best 5 overall: a .5, b .3, b4 .27, a2 .25, b4-1 .243 (a3 .15 and a2-0 .125 are left out)."""
    def lq(*probs):
        return torch.tensor(probs).clamp(min=1e-30).log()

    first = lq(.5, .3, .1, .1, 0)[None]
    calls = []
    tables = {1: {0: lq(0, 0, .5, .3, .2), 1: lq(.05, 0, .03, .02, .9)},
              2: {4: lq(0, .9, .1, 0, 0), 2: lq(.5, .05, .05, .4, 0)}}

    def extend(tokens, parent, seen, depth):
        calls.append((tokens.tolist(), parent.tolist(), seen.int().tolist(), depth))
        return torch.stack([tables[depth][t] for t in tokens[0].tolist()])[None]

    tree = grow(first, extend, TreeConfig(3, 2, 6))
    assert calls[0] == ([[0, 1]], [[0, 0]], [[[1, 0], [0, 1]]], 1)
    assert calls[1] == ([[4, 2]], [[1, 0]], [[[0, 1, 1, 0], [1, 0, 0, 1]]], 2)  # b4 first: it scored higher
    assert tree.tokens.tolist() == [[0, 1, 2, 4, 1]]
    assert tree.parents.tolist() == [[-1, -1, 0, 1, 3]]
    assert tree.depth.tolist() == [[1, 1, 2, 2, 3]]
    torch.testing.assert_close(tree.scores.exp(), torch.tensor([[.5, .3, .25, .27, .243]]))
    # a child scoring as much as its parent (q = 1) never comes before it: ties go to the earlier node
    chosen, parents = select(torch.tensor([[0.0, -1.0, 0.0, 0.0]]), torch.tensor([[-1, -1, 0, 2]]), 2)
    assert chosen.tolist() == [[0, 2]] and parents.tolist() == [[-1, 0]]
    chosen, parents = select(torch.tensor([[-1.0, -0.5, -1.0]]), torch.tensor([[-1, -1, 0]]), 2)
    assert chosen.tolist() == [[0, 1]] and parents.tolist() == [[-1, -1]]


def test_walks_on_a_hand_built_tree():
    """Greedy: the target's argmax is b at the pending token, d at b, e at d: the non-leftmost path b -> d -> e
    and then the argmax at e; a depth limit of 1 stops at b. Sampled with one-hot p: the same walk. Sampled
    with a table p(next | token) over 6 tokens: the first emitted token (the accepted child or the draw from
    what is left) follows p at the pending token, 40000 draws, chi-square at 1e-3."""
    from test_inference_sampling import chi_square_p_value

    tree = hand_tree()
    tree.tokens = torch.tensor([[0, 1, 2, 3, 4]])  # a, b, c, d, e
    argmax = torch.tensor([1, 5, 3, 5, 4, 2])  # at pending, a, b, c, d, e
    logits = torch.nn.functional.one_hot(argmax, 6).float()[None] * 5
    for max_depth, nodes, nxt in ((None, [1, 3, 4], 2), (torch.tensor([1]), [1, -1, -1], 3)):
        path = tree_module.verify_tree_greedy(tree, logits, max_depth)
        assert (path.nodes.tolist(), path.next.tolist()) == ([nodes], [nxt])
        assert path.accepted.tolist() == [sum(j >= 0 for j in nodes)]
        path = tree_module.verify_tree_sampled(tree, torch.softmax(logits * 100, -1), max_depth,
                                               torch.Generator().manual_seed(0))
        assert (path.nodes.tolist(), path.next.tolist()) == ([nodes], [nxt])
    g = torch.Generator().manual_seed(3)
    table = torch.softmax(torch.randn(6, 6, generator=g) * 1.5, -1)
    pending = 5
    columns = torch.tensor([pending, 0, 1, 2, 3, 4])  # each token's distribution: p(. | that token)
    n = 40_000
    big = DraftTree(*(t.expand(n, -1) for t in (tree.tokens, tree.parents, tree.depth, tree.scores)))
    path = tree_module.verify_tree_sampled(big, table[columns].expand(n, 6, 6), generator=g)
    first = torch.where(path.accepted > 0, big.tokens.gather(1, path.nodes[:, :1].clamp(min=0)).squeeze(1), path.next)
    assert chi_square_p_value(torch.bincount(first, minlength=6), table[pending]) > 1e-3
    assert 0 < int((path.accepted >= 2).sum()) < n  # b -> c / d was walked too


# -- the target's cache after a verified tree ----------------------------------------------------------------
def row_entries(cache, b):
    v = cache.valid[b]
    return [(k[b][:, v], val[b][:, v]) for k, val in zip(cache.keys, cache.values)]


def fresh(runner, tokens):
    cache = runner.new_cache(1)
    logits, hidden = runner.forward(cache, torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.bool))
    return cache, logits[0], hidden[0]


def test_cache_after_a_non_leftmost_path_is_a_fresh_prefill(target, prompts):
    """Two rows (different prompt lengths) verify the hand-built tree; row 0 keeps the path b -> d -> e, row 1
    keeps a alone. Each row's cache entries, the features of the kept tokens and the logits of the next
    forward equal those of a fresh prefill of prompt + pending + path."""
    tree = hand_tree()
    tree = DraftTree(*(t.expand(2, -1) for t in (tree.tokens, tree.parents, tree.depth, tree.scores)))
    tree.tokens = torch.tensor([[300, 301, 302, 303, 304], [400, 401, 402, 403, 404]])
    rows = [prompts[1][:-1], prompts[2][:-1]]
    pending = [prompts[1][-1], prompts[2][-1]]
    paths = [[1, 3, 4], [0]]
    cache = target.new_cache(2)
    target.forward(cache, *left_pad(rows))
    verify = torch.cat([torch.tensor(pending)[:, None], tree.tokens], 1)
    _, hidden = target.forward(cache, verify, torch.ones(2, 6, dtype=torch.bool),
                               positions=cache.lengths[:, None] + tree.positions(), tree=tree.mask())
    path = tree_module.TreePath(torch.tensor([[1, 3, 4], [0, -1, -1]]), torch.tensor([3, 1]), torch.tensor([7, 8]))
    kept = path.kept(6)
    assert kept.int().tolist() == [[1, 0, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    cache.keep_new(kept)
    nxt_logits, _ = target.forward(cache, torch.tensor([[7], [8]]), torch.ones(2, 1, dtype=torch.bool))
    for b in range(2):
        accepted = rows[b] + [pending[b]] + [int(tree.tokens[b, j]) for j in paths[b]]
        ref_cache, _, ref_hidden = fresh(target, accepted)
        ref_logits, _ = target.forward(ref_cache, torch.tensor([[7 + b]]), torch.ones(1, 1, dtype=torch.bool))
        ours = row_entries(cache, b)
        theirs = row_entries(ref_cache, 0)
        assert len(ours) == len(theirs) == 4
        for (k1, v1), (k2, v2) in zip(ours, theirs):
            assert k1.shape == k2.shape  # the accepted tokens and the next one, no stale entry
            torch.testing.assert_close(k1, k2, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(v1, v2, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(hidden[b][kept[b]], ref_hidden[len(rows[b]):], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(nxt_logits[b, -1], ref_logits[0, -1], atol=1e-4, rtol=1e-4)


# -- greedy decoding --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["draft_lm", "trained_head", "eagle3_head"])
def test_greedy_tree_decoding_is_the_targets(which, request, target, prompts, reference):
    """Token for token target-only greedy decoding, for two tree settings (the random eagle3 head, which
    exercises the aux-layer features: the wider one), all prompts in one batch and one alone; the drafter's
    cache holds only committed entries after every step."""
    drafter = request.getfixturevalue(which)
    for cfg in SETTINGS[1:] if which == "eagle3_head" else SETTINGS:
        batch = generate(target, prompts, drafter=drafter, tree=cfg, max_new_tokens=NEW)
        assert batch.tokens == reference, cfg
        s = batch.stats
        assert s.emitted == s.steps + sum(s.accepted)
        # a step verifies at most num_draft_tokens - 1 nodes (fewer: a shallower tree near every row's limit)
        assert s.steps * (cfg.num_draft_tokens - 1) >= s.verified >= s.steps - len(prompts) * cfg.steps
        i = SETTINGS.index(cfg) * 3  # a conversation, then a code snippet, alone
        dec = SpeculativeDecoder(target, [prompts[i]], drafter=drafter, tree=cfg, max_new_tokens=NEW)
        while not dec.done:
            dec.step()
            if not dec.done:
                held = drafter.committed if which != "draft_lm" else drafter.seen
                assert drafter.cache.lengths.tolist() == held.tolist()
        assert dec.result().tokens[0] == reference[i], (cfg, i)
        if which == "trained_head":
            assert s.tau > 1.2  # the tree's multi-token paths ran


def test_greedy_tree_respects_stop_tokens_and_length(target, draft_lm, prompts, reference):
    """A stop token inside an accepted path ends the row there; no row emits past max_new_tokens, also
    when a tree could reach further (the tree is cut to the rows' limits)."""
    row = reference[2]
    stop = row[4]
    cut = row[:row.index(stop) + 1]
    out = generate(target, [prompts[2]] * 2, drafter=draft_lm, tree=TreeConfig(4, 3, 8), max_new_tokens=NEW,
                   stop_tokens=[stop])
    assert out.tokens == [cut, cut] and out.stopped == [True, True]
    for limit in (1, 2, 5):
        out = generate(target, prompts, drafter=draft_lm, tree=TreeConfig(4, 3, 8), max_new_tokens=limit)
        assert out.tokens == [r[:limit] for r in reference]
        assert out.stats.emitted == out.stats.steps + sum(out.stats.accepted)


def test_tree_acceptance_beside_the_chain(target, trained_head, prompts, capsys):
    """A topk-1 tree is the chain: the same drafts, tokens and counts. Wider trees: τ reported beside the
    chain's at equal depth (EAGLE-2's score-based tree need not contain the greedy chain, so no inequality
    is asserted between them)."""
    chain = generate(target, prompts, drafter=trained_head, k=3, max_new_tokens=NEW)
    line = generate(target, prompts, drafter=trained_head, tree=TreeConfig(3, 1, 4), max_new_tokens=NEW)
    assert line.tokens == chain.tokens
    assert (line.stats.steps, line.stats.accepted, line.stats.drafted) == \
        (chain.stats.steps, chain.stats.accepted, chain.stats.drafted)
    taus = {cfg: generate(target, prompts, drafter=trained_head, tree=cfg, max_new_tokens=NEW).stats.tau
            for cfg in (TreeConfig(3, 3, 8),)}
    with capsys.disabled():
        print(f"\nchain k=3 tau {chain.stats.tau:.3f}; " + "; ".join(
            f"tree {c.steps}/{c.topk}/{c.num_draft_tokens} tau {t:.3f}" for c, t in taus.items()))
    assert all(t > 1.2 for t in taus.values())


# -- sampled decoding, on a target with a vocabulary of 8 --------------------------------------------------------
ROWS = 1500


def joint_first_three(target, prompt):
    """The target's exact joint distribution of its first three sampled tokens (T = 1), [512]."""
    from test_inference import VOCAB

    grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    with torch.no_grad():
        p1 = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(target.model(torch.tensor([prompt + [x] for x in range(VOCAB)])).logits[:, -1], -1)
        after = torch.cat([torch.tensor(prompt).expand(len(grid), 3), grid], 1)
        p3 = torch.softmax(target.model(after).logits[:, -1], -1)
    return ((p1[:, None] * p2).reshape(-1, 1) * p3).flatten()


def sampled_p_value(target, drafter, prompt, joint, rows, seed):
    """Decode `rows` copies of `prompt` (T = 1, tree 2 deep, topk 4, 8 nodes) -> (the smaller p-value of the
    chi-square tests of the first two and the first three new tokens against the target's joint, stats)."""
    from test_inference import VOCAB
    from test_inference_sampling import chi_square_p_value

    out = generate(target, [prompt] * rows, drafter=drafter, tree=TreeConfig(2, 4, 9), max_new_tokens=4,
                   sampling=SamplingConfig(temperature=1.0), generator=torch.Generator().manual_seed(seed))
    firsts = torch.tensor([t[:3] for t in out.tokens])
    pairs = firsts[:, 0] * VOCAB + firsts[:, 1]
    p2 = chi_square_p_value(torch.bincount(pairs, minlength=VOCAB ** 2), joint.view(VOCAB ** 2, VOCAB).sum(1))
    p3 = chi_square_p_value(torch.bincount(pairs * VOCAB + firsts[:, 2], minlength=VOCAB ** 3), joint)
    return min(p2, p3), out.stats


def wrong_verifier(always_accept: bool, renormalise: bool):
    """The sampled walk with a defect: every tried child accepted (the draft's own choice), or r left
    unnormalised after a rejection (later children accepted with p(c) instead of p(c) / (1 - rejected))."""
    def verify(tree, probs, max_depth=None, generator=None):
        B = probs.shape[0]
        children, rows = tree.children(), torch.arange(B)
        D = int(tree.depth.max())
        max_depth = torch.full((B,), D) if max_depth is None else max_depth
        cur, nodes = torch.zeros(B, dtype=torch.long), torch.full((B, D), -1, dtype=torch.long)
        alive, r = torch.ones(B, dtype=torch.bool), probs[:, 0].clone()
        for d in range(D):
            kids = children[rows, cur]
            moved, dest = torch.zeros(B, dtype=torch.bool), cur.clone()
            for f in range(kids.shape[1]):
                c = kids[:, f]
                tried = (c >= 0) & alive & ~moved & (d < max_depth)
                tok = tree.tokens.gather(1, c.clamp(min=0)[:, None])
                pc = r.gather(1, tok).squeeze(1)
                acc = tried & ((torch.rand(B, generator=generator) < pc) | always_accept)
                dropped = r.scatter(1, tok, 0.0)
                if renormalise:
                    dropped = dropped / dropped.sum(-1, keepdim=True).clamp(min=1e-30)
                r = torch.where((tried & ~acc)[:, None], dropped, r)
                moved |= acc
                dest = torch.where(acc, c + 1, dest)
            nodes[:, d] = torch.where(moved, dest - 1, -1)
            cur = dest
            r = torch.where(moved[:, None], probs[rows, cur], r)
            alive &= moved
        return tree_module.TreePath(nodes, (nodes >= 0).sum(1), tree_module.sample(r, generator))
    return verify


@pytest.mark.parametrize("which", ["draft", "head", "same"])
def test_sampled_tree_decoding_reproduces_the_target(which, monkeypatch):
    """1500 samples of the first three new tokens (T = 1; the first from the prefill, the next from tree
    steps: 2 deep, topk 4, 8 nodes) follow the target's joint p(x1) p(x2 | x1) p(x3 | x1, x2) (chi-square on
    the pairs and on the triples, significance 1e-3), with a draft LM far from the target, a random head, or
    the target itself as the draft.
    With the last (its children carry much of p, so a wrong walk shows) the same test rejects (p < 1e-6) a
    verifier that always accepts the first child and one that does not renormalise after a rejection."""
    from test_inference import VOCAB, tiny_lm

    target = CausalLMRunner(tiny_lm(0, 5.0))
    if which == "head":
        torch.manual_seed(2)
        drafter = head_drafter(DraftHead(target.model.config), target)
    else:
        drafter = LMDrafter(CausalLMRunner(tiny_lm(1, 40.0) if which == "draft" else tiny_lm(0, 5.0)), VOCAB)
    prompt = [3, 1, 4]
    joint = joint_first_three(target, prompt)
    p, stats = sampled_p_value(target, drafter, prompt, joint, ROWS, seed=7)
    assert p > 1e-3
    accept = stats.acceptance_by_position
    assert stats.drafted[0] >= ROWS and 0.05 < accept[0] < 0.95 and stats.accepted[1] > 0  # paths of depth 2 too
    if which == "same":
        for always_accept, renormalise in ((True, True), (False, False)):
            monkeypatch.setattr("mtp_train.inference.speculative.verify_tree_sampled",
                                wrong_verifier(always_accept, renormalise))
            p_wrong = sampled_p_value(target, drafter, prompt, joint, 1000, seed=7)[0]
            assert p_wrong < 1e-6, f"always_accept={always_accept}, renormalise={renormalise}: p = {p_wrong}"
