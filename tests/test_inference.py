"""The speculative decoding engine on the embedded tiny target: greedy speculative output is exactly the
target's own greedy output (head, random head, draft LM; k = 1..4; batch 1 and 8), rolled-back caches
equal a fresh prefill, the head drafts what the training forward computes, τ agrees with the acceptance
counts, stop tokens and lengths are honoured, and sampled decoding reproduces the target's distribution."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from mtp_train.data.chat import tokenize_conversation
from mtp_train.data.stdlib import function_conversations, list_files
from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.drafters import HeadDrafter, LMDrafter
from mtp_train.inference.runner import CausalLMRunner, load_runner
from mtp_train.inference.speculative import generate, SpeculativeDecoder
from mtp_train.model.head import DraftHead, unrolled
from mtp_train.model.target import TargetConfig, load_tokenizer

STOP = (1, 5)  # <|end_of_text|>, <|eot_id|>
NEW = 16  # new tokens per prompt


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_runner(str(tiny_dir / "target"), TargetConfig(path=str(tiny_dir / "target"), device="cpu"))


@pytest.fixture(scope="module")
def draft_lm(tiny_dir, target):
    runner = load_runner(str(tiny_dir / "draft"), TargetConfig(path=str(tiny_dir / "draft"), device="cpu"), "draft")
    return LMDrafter(runner, target.vocab_size)


def head_drafter(head, target):
    return HeadDrafter(head.eval(), target.model.get_input_embeddings(), target.lm_head)


@pytest.fixture(scope="module")
def random_head(tiny_dir, target):
    torch.manual_seed(0)
    return head_drafter(DraftHead(AutoConfig.from_pretrained(tiny_dir / "target")), target)


@pytest.fixture(scope="module")
def trained_head(trained_run, tiny_run_config, target):
    from mtp_train.inference.load import load_head

    return load_head(tiny_run_config(trained_run), target)[0]


def held_out(tiny_dir, conversations: int, code_lengths: tuple[int, ...]) -> list[list[int]]:
    """Held-out prompts (validation files, never trained on): the first `conversations` function-writing
    conversations cut at the assistant turn, then code snippets of `code_lengths` tokens."""
    tok = load_tokenizer(tiny_dir / "target")
    files = list_files("validation")
    chats = []
    for f in files:
        for conv in function_conversations(f.read(), max_chars=600):
            t = tokenize_conversation(tok, conv)
            chats.append(t.input_ids[:t.loss_mask.index(1)])
            break
        if len(chats) == conversations:
            break
    return chats + [tok(f.read()[:400])["input_ids"][:n] for f, n in zip(files[10:], code_lengths)]


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    """4 function-writing conversations cut at the assistant turn, 4 code snippets of different lengths."""
    return held_out(tiny_dir, 4, (3, 11, 24, 40))


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Target-only greedy decoding, one prompt at a time."""
    return [generate(target, [p], max_new_tokens=NEW, stop_tokens=STOP).tokens[0] for p in prompts]


def test_target_only_equals_transformers_generate(target, prompts, reference):
    for p, ours in zip(prompts[::3], reference[::3]):
        ids = torch.tensor([p])
        hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                   eos_token_id=list(STOP), pad_token_id=2)
        assert hf[0, len(p):].tolist() == ours


@pytest.mark.parametrize("which", ["draft_lm", "trained_head", "random_head"])
def test_greedy_speculative_output_is_the_targets(which, request, target, prompts, reference):
    """Token for token what greedy decoding of the target alone emits, for k = 1..4: all 8 prompts in one
    batch (rows accept different numbers of tokens and stop at different times) and, for each k, two of
    them alone (so every prompt is also decoded at batch 1)."""
    drafter = request.getfixturevalue(which)
    taus = []
    for k in range(1, 5):
        batch = generate(target, prompts, drafter=drafter, k=k, max_new_tokens=NEW, stop_tokens=STOP)
        assert batch.tokens == reference, f"k={k}, batch 8"
        taus.append(batch.stats.tau)
        for i in (k - 1, k + 3):  # a conversation and a code snippet
            alone = generate(target, [prompts[i]], drafter=drafter, k=k, max_new_tokens=NEW, stop_tokens=STOP)
            assert alone.tokens[0] == reference[i], f"k={k}, prompt {i} alone"
    if which == "random_head":
        assert max(taus) < 1.1  # a random head is (almost) never right, and changes nothing
    else:
        assert min(taus) > 1.2 and taus[3] > taus[0]  # drafts were accepted: the multi-token paths ran


def fresh_prefill(runner: CausalLMRunner, tokens: list[int]):
    cache = runner.new_cache(1)
    _, hidden = runner.forward(cache, torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.bool))
    return cache, hidden[0]


def row_entries(cache, b):
    """Row b's real cache entries, per layer: [(keys [heads, n, d], values), ...]."""
    v = cache.valid[b]
    return [(k[b][:, v], val[b][:, v]) for k, val in zip(cache.keys, cache.values)]


def assert_same_entries(a, b):
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a, b):
        assert ka.shape == kb.shape
        torch.testing.assert_close(ka, kb, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(va, vb, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("which", ["draft_lm", "trained_head"])
def test_rollback_leaves_the_caches_a_fresh_prefill_would_write(which, request, target, prompts):
    """After every step, each row's target cache holds exactly the entries of a fresh prefill of its
    committed tokens, and the drafter's cache those of a fresh run over what it has consumed; the
    sampled setting makes rows reject at different places."""
    drafter = request.getfixturevalue(which)
    dec = SpeculativeDecoder(target, [prompts[0], prompts[2], prompts[6]], drafter=drafter, k=3, max_new_tokens=12,
                             sampling=SamplingConfig(temperature=1.0), generator=torch.Generator().manual_seed(0))
    steps, partial = 0, 0
    while not dec.done:
        dec.step()
        steps += 1
        for b, r in enumerate(dec.active):
            committed = dec.seqs[r][:-1]
            cache, hidden = fresh_prefill(target, committed)
            assert_same_entries(row_entries(dec.cache, b), row_entries(cache, 0))
            if which == "draft_lm":
                seen = int(drafter.seen[b])
                draft_cache, _ = fresh_prefill(drafter.runner, dec.seqs[r][:seen])
                assert_same_entries(row_entries(drafter.cache, b), row_entries(draft_cache, 0))
                partial += seen < len(committed)
            else:  # pairs (h_i, x_{i+1}) from the target's h, for i < committed pairs
                n = int(drafter.committed[b])
                fresh = head_drafter(drafter.head, target)
                fresh.start(1)
                fresh._step(torch.tensor([dec.seqs[r][1:n + 1]]), hidden[None, :n], torch.ones(1, n, dtype=torch.bool))
                assert_same_entries(row_entries(drafter.cache, b), row_entries(fresh.cache, 0))
    assert steps >= 4 and dec.stats.accepted[0] > 0 and dec.stats.accepted[0] < dec.stats.drafted[0]


def test_head_drafts_what_the_training_forward_computes(trained_head, target, prompts):
    """The drafter's q for draft 1 and 2 equals softmax(W ĥ) from `unrolled` (the training forward) at the
    same anchor, fed the target's h and, at depth 2, the drafted token: training and inference place the
    pair (h_i, x_{i+1}) at the same position and see the same keys."""
    prompt = prompts[1]
    dec = SpeculativeDecoder(target, [prompt], drafter=trained_head, k=2, max_new_tokens=8)
    proposal = trained_head.propose(dec.seqs, dec.features, 2, SamplingConfig(temperature=1.0),
                                    torch.Generator().manual_seed(0))
    d1 = int(proposal.tokens[0, 0])
    seq = dec.seqs[0]  # prompt + the pending token x_P
    P = len(prompt)
    _, hidden = fresh_prefill(target, seq)  # h_0 .. h_P
    ids = torch.tensor([seq + [d1]])  # x_{P+1} = d1 for the depth-2 step
    h = torch.cat([hidden, torch.zeros(1, hidden.shape[-1])])[None]
    outs = unrolled(trained_head.head, target.model.get_input_embeddings(), h, ids, torch.tensor([P + 2]), depth=2)
    for j in range(2):  # anchor P-1: the pair (h_{P-1}, x_P) at depth 1, (ĥ, d1) at depth 2
        q = torch.softmax(target.lm_head(outs[j][0, P - 1]).float(), -1)
        torch.testing.assert_close(proposal.probs[0, j], q, atol=1e-5, rtol=1e-4)


def test_tau_is_what_the_acceptance_counts_say(target, draft_lm, prompts, reference):
    """τ from the emitted token counts = 1 + Σ_j (steps whose drafts 1..j were kept) / steps, and the
    acceptance by position is those counts over the steps that drafted position j (no stop tokens here,
    so every step emits its accepted drafts plus one)."""
    out = generate(target, prompts, drafter=draft_lm, k=4, max_new_tokens=24)
    s = out.stats
    assert sum(len(t) for t in out.tokens) == len(prompts) * 24 == s.new_tokens
    assert s.emitted == s.new_tokens - len(prompts)  # the prefill emits each row's first token
    assert s.tau == s.emitted / s.steps
    assert s.tau == pytest.approx(1 + sum(s.accepted) / s.steps, abs=1e-12)
    assert s.acceptance_by_position == [a / d for a, d in zip(s.accepted, s.drafted)]
    assert s.steps - s.drafted[0] <= len(prompts)  # only a row's last step, with one token left, drafts nothing
    assert all(x >= y for x, y in zip(s.accepted, s.accepted[1:]))
    assert 1 < s.tau < 5


def test_tau_matches_the_acceptance_when_stop_tokens_cut_kept_drafts(target, draft_lm, prompts, reference):
    """Stop tokens that the drafter proposes and the target keeps: a row ends at a kept draft, the drafts
    after it are dropped, and the counts still satisfy emitted = steps + Σ accepted (the stop token is the
    step's last token). Greedy output is the reference cut after its first stop token."""
    counts = torch.bincount(torch.tensor([t for r in reference for t in r[1:]]))
    stop = counts.topk(3).indices.tolist()  # the commonest tokens: most rows meet one mid-step
    out = generate(target, prompts, drafter=draft_lm, k=4, max_new_tokens=NEW, stop_tokens=stop)
    expected = [next((r[:i + 1] for i, t in enumerate(r) if t in stop), r) for r in reference]
    assert out.tokens == expected and sum(out.stopped) >= 4
    s = out.stats
    assert s.emitted == s.new_tokens - len(prompts) == s.steps + sum(s.accepted)
    assert s.tau == pytest.approx(1 + sum(s.accepted) / s.steps, abs=1e-12)


def test_stop_tokens_and_max_new_tokens(target, draft_lm, prompts, reference):
    """A row ends at its first stop token (kept), or after exactly max_new_tokens; with speculation too."""
    row = next(r for r in reference if len(r) == NEW)
    prompt = prompts[reference.index(row)]
    stop = row[6]
    cut = row[:row.index(stop) + 1]
    for drafter in (None, draft_lm):
        out = generate(target, [prompt, prompt], drafter=drafter, k=4, max_new_tokens=NEW, stop_tokens=[stop])
        assert out.tokens == [cut, cut] and out.stopped == [True, True]
        out = generate(target, [prompt], drafter=drafter, k=4, max_new_tokens=9)
        assert out.tokens[0] == row[:9] and out.stopped == [False]
        assert generate(target, [prompt], drafter=drafter, k=4, max_new_tokens=1).tokens[0] == row[:1]


def test_bad_arguments_are_refused(target, draft_lm, prompts):
    with pytest.raises(ValueError, match=r"k=0: a drafter must propose at least one token"):
        generate(target, prompts[:1], drafter=draft_lm, k=0)
    with pytest.raises(ValueError, match="no prompt may be empty"):
        generate(target, [prompts[0], []])
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(target, prompts[:1], max_new_tokens=0)


# -- sampled decoding end to end, on a target with a vocabulary of 8 --------------------------------------
VOCAB, ROWS = 8, 3000


def tiny_lm(seed, scale):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=64, head_dim=8)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # sharper distributions
    return model


@pytest.mark.parametrize("which", ["draft", "head"])
def test_sampled_speculative_decoding_reproduces_the_target(which):
    """3000 samples of the first three new tokens (k = 3, T = 1; the first comes from the prefill, the next
    from verification steps) follow the target's own joint distribution p(x1) p(x2 | x1) p(x3 | x1, x2)
    (chi-square, significance 1e-3), with a draft LM or a random head far from it."""
    from test_inference_sampling import chi_square_p_value

    target = CausalLMRunner(tiny_lm(0, 30.0))
    if which == "draft":
        drafter = LMDrafter(CausalLMRunner(tiny_lm(1, 40.0)), VOCAB)
    else:
        torch.manual_seed(2)
        drafter = head_drafter(DraftHead(target.model.config), target)
    prompt = [3, 1, 4]
    out = generate(target, [prompt] * ROWS, drafter=drafter, k=3, max_new_tokens=5,
                   sampling=SamplingConfig(temperature=1.0), generator=torch.Generator().manual_seed(7))
    firsts = torch.tensor([t[:3] for t in out.tokens])
    grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (x1, x2), x1-major
    with torch.no_grad():
        p1 = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(target.model(torch.tensor([prompt + [x] for x in range(VOCAB)])).logits[:, -1], -1)
        p3 = torch.softmax(target.model(torch.cat([torch.tensor(prompt).expand(len(grid), 3), grid], 1)).logits[:, -1], -1)
    joint = (p1[:, None] * p2).reshape(-1, 1) * p3  # [(x1, x2), x3]
    cells = (firsts[:, 0] * VOCAB + firsts[:, 1]) * VOCAB + firsts[:, 2]
    assert chi_square_p_value(torch.bincount(cells, minlength=VOCAB ** 3), joint) > 1e-3
    accept = out.stats.acceptance_by_position
    assert out.stats.drafted[0] >= ROWS and 0.05 < accept[0] < 0.95  # drafts were both kept and rejected


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v2"])
def test_other_families_decode_as_transformers_does(family, tmp_path):
    """The engine on Qwen3 and DeepSeek-V2 (MLA: keys and values of different widths, a rotary embedding that
    views its inputs as complex numbers) targets: target-only greedy output is transformers' own, and with a
    head drafting it is unchanged (a random head, k = 2: its rare accepted drafts and many rejections)."""
    from test_head import tiny_configs

    config = tiny_configs()[family]
    config.initializer_range = 0.3  # peaked logits: no near-ties for the two summation orders to split
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    runner = load_runner(str(tmp_path), TargetConfig(path=str(tmp_path), device="cpu"))
    prompts = [[3, 17, 88, 40, 5], [61, 9, 2, 33, 70, 12, 8, 99, 1, 4, 50]]
    ours = generate(runner, prompts, max_new_tokens=NEW, stop_tokens=set())
    for p, got in zip(prompts, ours.tokens):
        ids = torch.tensor([p])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                            min_new_tokens=NEW)
        assert hf[0, len(p):].tolist() == got
    drafter = head_drafter(DraftHead(config), runner)
    assert generate(runner, prompts, drafter=drafter, k=2, max_new_tokens=NEW, stop_tokens=set()).tokens == ours.tokens
