"""EAGLE-3's own parts of the draft head (`head.variant=eagle3`, described in `model/head.py`): which target
layers it reads (`aux_layer_ids`), the Llama config its layer is sized from (`eagle3_layer_config`), and its
decoder layer `Eagle3Layer` (`midlayer`), whose attention reads the token and the fused target features side by
side. The layer is Llama's for every target family, as the engines build it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as llama

from mtp_train.model.config import HeadConfig


def aux_layer_ids(target_config, cfg: HeadConfig) -> list[int]:
    """The target layers an eagle3 head reads (the residual entering each), ascending; [] for other variants."""
    if cfg.variant != "eagle3":
        return []
    L = target_config.num_hidden_layers
    ids = list(cfg.aux_layers) or [2, L // 2, L - 3]
    if any(not 0 <= i < L for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        given = "head.aux_layers=" + str(list(cfg.aux_layers)) if cfg.aux_layers else f"the default (2, L//2, L-3) = {ids}"
        raise ValueError(f"{given}: expected ascending, distinct layer indices in 0..{L - 1} for a target of {L} "
                         "layers; set head.aux_layers=[i,j,k] (small targets: e.g. [1,2,3])")
    return ids


def eagle3_layer_config(target_config, cfg: HeadConfig):
    """The LlamaConfig of an eagle3 head's layer: the target's width, heads, KV heads, MLP width, norm epsilon
    and rotary settings (a DeepSeek-V2 target's MLA becomes plain attention over hidden / heads)."""
    t = target_config
    heads = t.num_attention_heads
    mla = t.model_type == "deepseek_v2"
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if mla or not rope:
        rope = {"rope_type": "default", "rope_theta": rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))}
    c = LlamaConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                    num_hidden_layers=cfg.num_layers, num_attention_heads=heads,
                    num_key_value_heads=heads if mla else getattr(t, "num_key_value_heads", None) or heads,
                    head_dim=t.hidden_size // heads if mla else getattr(t, "head_dim", None) or t.hidden_size // heads,
                    hidden_act=getattr(t, "hidden_act", "silu"), rms_norm_eps=t.rms_norm_eps,
                    max_position_embeddings=t.max_position_embeddings, rope_parameters=rope, attention_bias=False,
                    mlp_bias=False, tie_word_embeddings=False, use_cache=True)
    c._attn_implementation = cfg.attn_implementation
    return c


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (`midlayer`): Llama attention whose q, k, v read [input_layernorm(E x);
    hidden_norm(g)] (2H wide), the residual from g, then post_attention_layernorm and the MLP. Returns the
    output before any final norm."""

    def __init__(self, config, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual

        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = llama.LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self.self_attn, name, nn.Linear(2 * H, getattr(self.self_attn, name).out_features, bias=False))
        self.mlp = llama.LlamaMLP(config)
        self.input_layernorm = llama.LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = llama.LlamaRMSNorm(H, eps=eps)
        self.post_attention_layernorm = llama.LlamaRMSNorm(H, eps=eps)
        params = inspect.signature(llama.LlamaAttention.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, embeds, hidden, attention_mask, position_embeddings, cache=None) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        a = self.self_attn(hidden_states=x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                           **{self._cache_kw: cache})[0]
        h = (normed if self.norm_before_residual else hidden) + a
        return h + self.mlp(self.post_attention_layernorm(h))
