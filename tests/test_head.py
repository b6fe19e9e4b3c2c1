"""The draft head: parameter layout per variant and family, frozen tensors read by key, and the unrolled
training forward against the step-by-step drafter (same logits)."""

import pytest
import torch
from transformers import DeepseekV2Config, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen3Config

from mtp_train.model.frozen import FrozenTarget, read_tensors
from mtp_train.model.head import DraftHead, HeadCache, HeadConfig, additive_mask, unrolled

H = 64


def tiny_configs():
    common = dict(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=101, max_position_embeddings=64, rms_norm_eps=1e-6)
    return {
        "llama": LlamaConfig(**common, head_dim=16),
        "qwen2": Qwen2Config(**common),
        "qwen3": Qwen3Config(**common, head_dim=16),
        "deepseek_v2": DeepseekV2Config(**{**common, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=None,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                        n_shared_experts=1),
    }


CONFIGS = tiny_configs()


def own_names(head):
    return {n for n, _ in head.named_parameters()}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_mtp_layout(family):
    head = DraftHead(CONFIGS[family], HeadConfig(variant="mtp"))
    names = own_names(head)
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "post_norm.weight",
              "mtp_block.input_layernorm.weight", "mtp_block.post_attention_layernorm.weight"):
        assert n in names, n
    assert head.eh_proj.weight.shape == (H, 2 * H) and head.eh_proj.bias is None
    assert all(n.split(".")[0] in {"enorm", "hnorm", "eh_proj", "mtp_block", "post_norm"} for n in names)
    assert not any("embed" in n or "lm_head" in n for n in names)  # the frozen tensors are not the head's
    if family == "deepseek_v2":  # MLA attention, dense MLP (not the MoE the target's later layers use)
        assert "mtp_block.self_attn.kv_a_proj_with_mqa.weight" in names
        assert "mtp_block.mlp.gate_proj.weight" in names and not any("experts" in n for n in names)
        assert head.mtp_block.mlp.gate_proj.weight.shape == (96, H)
    else:
        assert head.mtp_block.self_attn.k_proj.weight.shape == (2 * 16, H)  # KV heads x head_dim
    if family == "qwen3":
        assert "mtp_block.self_attn.q_norm.weight" in names


@pytest.mark.parametrize("family", list(CONFIGS))
def test_eagle1_layout(family):
    head = DraftHead(CONFIGS[family], HeadConfig(variant="eagle1", fc_bias=True))
    names = own_names(head)
    assert {"fc.weight", "fc.bias"} <= names
    assert not any(n.startswith(("enorm", "hnorm", "eh_proj", "post_norm")) for n in names)
    assert "mtp_block.input_layernorm.weight" not in names  # EAGLE-1 drops the layer's input norm
    assert "mtp_block.post_attention_layernorm.weight" in names


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("variant", ["mtp", "eagle1"])
def test_forward_shapes_and_batching_independence(family, variant):
    """ĥ has the hidden's shape, and a row's outputs are the same alone as in a longer, padded batch."""
    torch.manual_seed(0)
    head = DraftHead(CONFIGS[family], HeadConfig(variant=variant)).eval()
    embed = torch.nn.Embedding(101, H)
    hidden, ids = torch.randn(2, 7, H), torch.randint(0, 101, (2, 7))
    with torch.no_grad():
        outs = unrolled(head, embed, hidden, ids, torch.tensor([7, 4]), depth=2)
        alone = unrolled(head, embed, hidden[1:, :4], ids[1:, :4], torch.tensor([4]), depth=2)
    assert [o.shape for o in outs] == [(2, 7, H)] * 2
    for j in range(2):  # anchors whose chains stay inside the sample
        n = 4 - 1 - j
        torch.testing.assert_close(outs[j][1, :n], alone[j][0, :n], atol=1e-5, rtol=1e-5)


def stepwise(head, embed, hidden, ids, length, depth):
    """The inference drafter, one anchor at a time: prefill the cache with target features up to the anchor,
    then feed back the step's output with the next true token, one position per call. Returns {(anchor, j):
    what the lm_head reads}."""
    out = {}
    for a in range(length - 1):
        cache = HeadCache()
        n = a + 1  # pairs (h_k, x_{k+1}) for k = 0..a, at positions 1..a+1
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        h = head(embed(ids[None, 1:n + 1]), head.fuse(hidden[None, :n]), torch.arange(1, n + 1)[None],
                 additive_mask(causal, hidden.dtype), cache)[:, -1:]
        out[(a, 0)] = head.readout(h)[0, 0]
        for j in range(1, depth):
            if a + 1 + j >= length:
                break
            everything = torch.ones(1, 1, 1, cache.get_seq_length() + 1, dtype=torch.bool)
            h = head(embed(ids[None, a + 1 + j:a + 2 + j]), h, torch.tensor([[a + 1 + j]]),
                     additive_mask(everything, hidden.dtype), cache)
            out[(a, j)] = head.readout(h)[0, 0]
    return out


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("variant", ["mtp", "eagle1"])
def test_unrolled_equals_stepwise_drafter(family, variant):
    """Training-time test: the unrolled forward gives, for every anchor and depth, the ĥ (hence the logits)
    that the step-by-step drafter computes with its KV cache."""
    torch.manual_seed(1)
    head = DraftHead(CONFIGS[family], HeadConfig(variant=variant)).eval()
    embed = torch.nn.Embedding(101, H)
    W = torch.randn(101, H)
    hidden, ids, lengths = torch.randn(2, 8, H), torch.randint(0, 101, (2, 8)), torch.tensor([8, 5])
    depth = 3
    with torch.no_grad():
        outs = unrolled(head, embed, hidden, ids, lengths, depth)
        checked = 0
        for b in range(2):
            for (a, j), h in stepwise(head, embed, hidden[b], ids[b], int(lengths[b]), depth).items():
                torch.testing.assert_close(outs[j][b, a] @ W.T, h @ W.T, atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked == (7 + 6 + 5) + (4 + 3 + 2)


def test_chain_does_not_see_other_chains():
    """At depth 2, anchor i's ĥ depends on the target features up to i and on its own chain only: changing
    the hidden state at position 3 leaves anchors 0..2 unchanged and changes anchor 3."""
    torch.manual_seed(2)
    head = DraftHead(CONFIGS["llama"]).eval()
    embed = torch.nn.Embedding(101, H)
    hidden, ids = torch.randn(1, 6, H), torch.randint(0, 101, (1, 6))
    with torch.no_grad():
        base = unrolled(head, embed, hidden, ids, torch.tensor([6]), 2)[1]
        later = hidden.clone()
        later[0, 3] += 1.0
        moved = unrolled(head, embed, later, ids, torch.tensor([6]), 2)[1]
    torch.testing.assert_close(moved[0, :3], base[0, :3])
    assert (moved[0, 3] - base[0, 3]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=101, head_dim=16, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="20KB")
    return model, single, sharded


def test_frozen_tensors_read_by_key(saved_target):
    model, single, sharded = saved_target
    assert (sharded / "model.safetensors.index.json").is_file()
    for path in (single, sharded):
        frozen = FrozenTarget.from_pretrained(path)
        torch.testing.assert_close(frozen.embed_tokens.weight, model.model.embed_tokens.weight)
        torch.testing.assert_close(frozen.lm_head_weight, model.lm_head.weight)
        torch.testing.assert_close(frozen.final_norm, model.model.norm.weight)
        assert not frozen.tied and all(not p.requires_grad for p in frozen.parameters())
    got = read_tensors(sharded, ["model.norm.weight", "no.such.key"])
    assert list(got) == ["model.norm.weight"]  # only what was asked for


def test_tied_target_shares_embedding(tmp_path):
    cfg = LlamaConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=101, head_dim=16, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    frozen = FrozenTarget.from_pretrained(tmp_path)
    assert frozen.tied and frozen.lm_head_weight is frozen.embed_tokens.weight


def test_post_norm_starts_from_target_final_norm(tmp_path):
    cfg = LlamaConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=101, head_dim=16)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    head = DraftHead(model.config)
    head.init_from_target(FrozenTarget.from_pretrained(tmp_path))
    torch.testing.assert_close(head.post_norm.weight, model.model.norm.weight)


def test_missing_embedding_is_named(tmp_path):
    from safetensors.torch import save_file

    LlamaConfig(hidden_size=H, num_attention_heads=4, vocab_size=101).save_pretrained(tmp_path)
    save_file({"lm_head.weight": torch.zeros(101, H)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        FrozenTarget.from_pretrained(tmp_path)


def test_unknown_family_is_refused():
    cfg = LlamaConfig(hidden_size=H, num_attention_heads=4)
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match="gpt2.*supported: llama"):
        DraftHead(cfg)


def test_bad_variant_is_refused():
    with pytest.raises(ValueError, match="head.variant='eagle9'"):
        HeadConfig(variant="eagle9")


@pytest.mark.parametrize("variant", ["mtp", "eagle1", "eagle3"])
def test_init_layer_starts_from_the_target_layer(saved_target, variant):
    """head.init_layer=1: the head's decoder layer computes what the target's layer 1 computes (eagle3 with its
    token half of q, k, v zeroed: that half stays at its random start, the same as without init_layer); the rest
    of the head is untouched."""
    from mtp_train.train.trainer import build_head

    model, single, _ = saved_target
    extra = {"draft_vocab": 50, "aux_layers": [0, 1]} if variant == "eagle3" else {}
    head, _, _ = build_head(str(single), HeadConfig(variant=variant, init_layer=1, **extra), "cpu", seed=5)
    plain, _, _ = build_head(str(single), HeadConfig(variant=variant, **extra), "cpu", seed=5)
    layer = model.model.layers[1]
    outside = {n: p for n, p in plain.named_parameters() if not n.startswith(("mtp_block.", "midlayer."))}
    for n, p in head.named_parameters():
        if n in outside:
            torch.testing.assert_close(p, outside[n], rtol=0, atol=0)
    torch.manual_seed(6)
    x, pos = torch.randn(1, 5, H), torch.arange(5)[None]
    mask = additive_mask(torch.ones(5, 5, dtype=torch.bool).tril()[None, None], x.dtype)
    with torch.no_grad():
        want = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        want = want[0] if isinstance(want, tuple) else want
        if variant == "eagle3":
            for name in ("q_proj", "k_proj", "v_proj"):
                w, w0 = getattr(head.layer.self_attn, name).weight, getattr(plain.layer.self_attn, name).weight
                torch.testing.assert_close(w[:, :H], w0[:, :H], rtol=0, atol=0)  # the token half: untouched
                w[:, :H] = 0
            got = head.layer(torch.randn(1, 5, H), x, mask, head.rotary_emb(x, pos))
        else:
            got = head.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=head.rotary_emb(x, pos))
            got = got[0] if isinstance(got, tuple) else got
    if variant == "eagle1":  # its layer has no input norm, so it computes something else: every weight it has
        target = dict(layer.named_parameters())
        assert "input_layernorm.weight" not in dict(head.layer.named_parameters())
        for n, p in head.layer.named_parameters():
            torch.testing.assert_close(p, target[n], rtol=0, atol=0)
        return
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_init_fc_passes_one_aux_layer_through(saved_target):
    """head.init_fc=1: eagle3's fc maps the fused features [layer 0 | layer 1] to layer 1's block exactly (with
    or without its input norm); every other parameter is the random start's; a layer it does not fuse, a
    negative index and another variant are refused."""
    from mtp_train.train.trainer import build_head

    _, single, _ = saved_target
    base = {"variant": "eagle3", "draft_vocab": 50, "aux_layers": [0, 1]}
    plain, _, _ = build_head(str(single), HeadConfig(**base), "cpu", seed=5)
    torch.manual_seed(7)
    feats = torch.randn(2, 5, 2 * H) * 3
    for extra in ({}, {"norm_before_fc": True}):
        head, _, _ = build_head(str(single), HeadConfig(init_fc=1, **base, **extra), "cpu", seed=5)
        fused = head.input_norm(feats) if extra else feats
        with torch.no_grad():
            torch.testing.assert_close(head.fc(fused), fused[..., H:], rtol=0, atol=0)
        if not extra:
            others = dict(plain.named_parameters())
            for n, p in head.named_parameters():
                if n != "fc.weight":
                    torch.testing.assert_close(p, others[n], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"head.init_fc=2: not one of the head's aux layers \[0, 1\]"):
        build_head(str(single), HeadConfig(init_fc=2, **base), "cpu", seed=0)
    with pytest.raises(ValueError, match="head.init_fc=-2"):
        HeadConfig(init_fc=-2, **base)
    with pytest.raises(ValueError, match="head.init_fc=0: for head.variant=eagle3 only"):
        HeadConfig(variant="mtp", init_fc=0)


def test_init_token_half_zero_starts_eagle3_as_the_target_layer(saved_target):
    """head.init_layer=1 head.init_token_half=zero: eagle3's layer computes the target's layer 1 on the features
    whatever the token embedding is (the token half of q, k, v is zero, the feature half the target's); with the
    default the token half is the random start's. Another value is refused."""
    from mtp_train.train.trainer import build_head

    model, single, _ = saved_target
    base = {"variant": "eagle3", "draft_vocab": 50, "aux_layers": [0, 1], "init_layer": 1}
    head, _, _ = build_head(str(single), HeadConfig(init_token_half="zero", **base), "cpu", seed=5)
    plain, _, _ = build_head(str(single), HeadConfig(**base), "cpu", seed=5)
    for name in ("q_proj", "k_proj", "v_proj"):
        w, w0 = getattr(head.layer.self_attn, name).weight, getattr(plain.layer.self_attn, name).weight
        assert not w[:, :H].any() and w0[:, :H].abs().sum() > 0
        torch.testing.assert_close(w[:, H:], w0[:, H:], rtol=0, atol=0)
    torch.manual_seed(6)
    x, pos = torch.randn(1, 5, H), torch.arange(5)[None]
    mask = additive_mask(torch.ones(5, 5, dtype=torch.bool).tril()[None, None], x.dtype)
    layer = model.model.layers[1]
    with torch.no_grad():
        want = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        want = want[0] if isinstance(want, tuple) else want
        for emb in (torch.randn(1, 5, H), torch.randn(1, 5, H) * 10):
            got = head.layer(emb, x, mask, head.rotary_emb(x, pos))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="head.init_token_half='ones'"):
        HeadConfig(init_token_half="ones", **base)
    with pytest.raises(ValueError, match="head.init_token_half=zero is for head.variant=eagle3 with head.init_layer"):
        HeadConfig(init_token_half="zero", **{**base, "init_layer": -1})


def test_init_layer_starts_more_layers_from_the_next_target_layers(saved_target):
    """eagle3 with head.num_layers=2 and init_layer=0: its midlayer starts from the target's layer 0 and its
    layer 1 is the target's layer 1, weight for weight; init_layer=1 would need a layer 2 and is refused."""
    from mtp_train.train.trainer import build_head

    model, single, _ = saved_target
    base = {"variant": "eagle3", "draft_vocab": 50, "aux_layers": [0, 1], "num_layers": 2}
    head, _, _ = build_head(str(single), HeadConfig(init_layer=0, **base), "cpu", seed=5)
    target = dict(model.model.layers[1].named_parameters())
    got = dict(head.layers["1"].named_parameters())
    assert got.keys() == target.keys()
    for n, p in got.items():
        torch.testing.assert_close(p, target[n], rtol=0, atol=0)
    w = head.layer.self_attn.q_proj.weight
    torch.testing.assert_close(w[:, H:], model.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"head.init_layer=1: the target has 2 decoder layers \(0..1\); the "
                                         r"head's 2 layers start from layer 1 and its 1 next"):
        build_head(str(single), HeadConfig(init_layer=1, **base), "cpu", seed=5)


def test_init_layer_out_of_range_or_mismatched_is_refused(saved_target, tmp_path):
    from mtp_train.train.trainer import build_head

    _, single, _ = saved_target
    with pytest.raises(ValueError, match=r"head.init_layer=2: the target has 2 decoder layers \(0..1\)"):
        build_head(str(single), HeadConfig(init_layer=2), "cpu", seed=0)
    with pytest.raises(ValueError, match="head.init_layer=-2"):
        HeadConfig(init_layer=-2)
    from transformers import DeepseekV2ForCausalLM

    DeepseekV2ForCausalLM(CONFIGS["deepseek_v2"]).save_pretrained(tmp_path)
    build_head(str(tmp_path), HeadConfig(init_layer=0), "cpu", seed=0)  # layer 0 is dense, as the head's
    with pytest.raises(ValueError, match=r"has no model.layers.1.mlp.gate_proj.weight.*mixture of experts"):
        build_head(str(tmp_path), HeadConfig(init_layer=1), "cpu", seed=0)
