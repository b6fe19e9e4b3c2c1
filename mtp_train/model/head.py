"""The draft head: one implementation, used by training, validation and inference.

Variant `mtp` (default; docs/design.md §3), the RMSNorm-restored single decoder layer of DeepSeek-V3's MTP module
and transformers' `MtpLayer`:

    u_i = eh_proj([enorm(E[x_{i+1}]); hnorm(h_i)])     2H -> H, no bias, embedding first
    z   = mtp_block(u)                                 the target's own decoder-layer class, both norms,
                                                       causal attention with its own KV cache
    ĥ_i = post_norm(z_i)                               the estimate of h_{i+1}; q_i = softmax(W ĥ_i)

Variant `eagle1`, the original EAGLE head kept as an ablation and export option: `fc([E[x]; h])` into the
decoder layer with its input norm removed and no final norm (ĥ = z).

Variant `eagle3` (EAGLE-3, as SpecForge trains it and vLLM / SGLang serve it): target features from several
layers, fused, into a Llama decoder layer whose attention reads the token and the feature side by side, and a
trainable lm_head over the draft vocabulary:

    g_i = fc([a_i; b_i; c_i])                          k·H -> H, no bias: the residual stream entering the
                                                       target layers `aux_layers` (default 2, L//2, L-3);
                                                       with `norm_before_fc`, fc(input_norm([a; b; c]))
    z_i = midlayer(E[x_{i+1}], g_i)                    attention over [input_layernorm(E x); hidden_norm(g)]
                                                       (2H -> q, k, v), residual from g, then
                                                       post_attention_layernorm + MLP
    z_i = layers.n(z_i)                                with `num_layers` n > 1: plain Llama decoder layers
                                                       after it (1..n-1, vLLM's multi-layer EAGLE-3)
    logits = lm_head(norm(z_i))                        over the draft vocabulary, initialised from W's rows

The chain feeds z (before `norm`) back as the next step's g; with `norm_output`, norm(z) (what the lm_head
read). The layer is Llama's for every target family (what the engines build), sized from the target's config.
Its own parts (which target layers it reads, its layer's config, the layer itself) are `model/eagle3.py`.

Draft vocabulary (`head.draft_vocab = N > 0`, any variant; `eagle3` requires one): the head drafts over N target tokens only (the
most frequent trained tokens of the training data, `train/vocab.py`), with the frozen lm_head's rows for them,
`W[draft_ids] ĥ`. The mapping is part of the head, as EAGLE-3's: persistent buffers `d2t` [N] (int64,
target_id = draft_id + d2t[draft_id], draft ids in ascending target-id order so offsets are >= 0) and `t2d`
[V] (bool, the target ids inside), saved in every checkpoint. `draft_lm_head(W)` is the one place where the
rows are chosen and drafts are mapped back to target ids: the loss, validation and the drafter all call it.

The pair (h_i, x_{i+1}) sits at position i+1 (rotary embeddings, KV cache), as in transformers' MTP
generation. The frozen target tensors (embedding E, lm_head W) are not part of this module: the caller
embeds tokens with `FrozenTarget` and passes the embeddings in, so head checkpoints and optimizers only
ever hold the head's own weights.

Chains (depth D > 1): step j at anchor i consumes the head's own ĥ from step j-1 and the true token
x_{i+1+j} at position i+1+j. At inference the head's KV cache then holds keys made from target features
for every position up to the anchor, plus the chain's own keys from steps 1..j; `unrolled` reproduces
exactly that attention pattern for all anchors at once, through the same cache and mask path that the
step-by-step drafter uses (`tests/test_head.py` checks the two agree).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from mtp_train.model.config import HeadConfig
from mtp_train.model.eagle3 import Eagle3Layer, aux_layer_ids, eagle3_layer_config
from mtp_train.model.frozen import project

DRAFT_VOCAB_BUFFERS = ("d2t", "t2d")  # in the head's state dict with a draft vocabulary (head.draft_vocab > 0)

# model_type -> (modeling module, decoder layer, rotary embedding, RMSNorm). Named explicitly: a family is
# supported when its decoder layer has been checked to accept (hidden, mask, cache, position_embeddings).
FAMILIES = {
    "llama": ("llama", "LlamaDecoderLayer", "LlamaRotaryEmbedding", "LlamaRMSNorm"),
    "qwen2": ("qwen2", "Qwen2DecoderLayer", "Qwen2RotaryEmbedding", "Qwen2RMSNorm"),
    "qwen3": ("qwen3", "Qwen3DecoderLayer", "Qwen3RotaryEmbedding", "Qwen3RMSNorm"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2DecoderLayer", "DeepseekV2RotaryEmbedding", "DeepseekV2RMSNorm"),
}


def family_classes(model_type: str) -> tuple[type, type, type]:
    if model_type not in FAMILIES:
        raise ValueError(f"target model_type {model_type!r} is not supported by the head; supported: "
                         f"{', '.join(FAMILIES)}")
    module, layer, rotary, norm = FAMILIES[model_type]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, layer), getattr(mod, rotary), getattr(mod, norm)


def head_config_for(target_config, cfg: HeadConfig):
    """A copy of the target's transformers config that builds a one-layer, dense head."""
    c = target_config.__class__.from_dict(target_config.to_dict())
    c._attn_implementation = cfg.attn_implementation
    c.num_hidden_layers = 1
    c.use_cache = True
    if target_config.model_type == "deepseek_v2":
        c.first_k_dense_replace = 1  # layer 0 gets DeepSeek-V2's dense MLP (intermediate_size), not the MoE
    if getattr(c, "layer_types", None):
        c.layer_types = ["full_attention"]  # a sliding window would change what the chain can see
    return c


class HeadCache:
    """The head's KV cache: keys and values per decoder layer (one unless eagle3's `num_layers` > 1), appended
    in call order, croppable.

    Implements the `update` that transformers' attention modules call. Entries are kept in the order they
    were written, which is also the key order the attention masks below are built for.
    """

    def __init__(self) -> None:
        self.layer_keys: list[torch.Tensor] = []
        self.layer_values: list[torch.Tensor] = []

    def update(self, keys, values, layer_idx=0, *args, **kwargs):  # [B, heads, S, d] each
        if layer_idx == len(self.layer_keys):
            self.layer_keys.append(keys)
            self.layer_values.append(values)
        elif layer_idx < len(self.layer_keys):
            self.layer_keys[layer_idx] = torch.cat([self.layer_keys[layer_idx], keys], dim=-2)
            self.layer_values[layer_idx] = torch.cat([self.layer_values[layer_idx], values], dim=-2)
        else:
            raise IndexError(f"HeadCache: layer {layer_idx} written before layer {len(self.layer_keys)}")
        return self.layer_keys[layer_idx], self.layer_values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer_keys[layer_idx].shape[-2] if layer_idx < len(self.layer_keys) else 0

    def crop(self, length: int) -> None:
        """Keep the first `length` entries of every layer (drop rejected drafts)."""
        self.layer_keys = [k[..., :length, :] for k in self.layer_keys]
        self.layer_values = [v[..., :length, :] for v in self.layer_values]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep, in order, the entries at `index` (a 1-D LongTensor of cache positions) in every layer."""
        self.layer_keys = [k.index_select(-2, index) for k in self.layer_keys]
        self.layer_values = [v.index_select(-2, index) for v in self.layer_values]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, 1, Q, K] (True = may attend) -> additive float mask (0 / most negative)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


@dataclass(frozen=True)
class DraftLMHead:
    """The output layer a head drafts with. `weight` [N, H]: the rows of the target's lm_head W for the draft
    vocabulary (W itself without one), or an eagle3 head's own trainable lm_head; `ids` [N]: the target id of
    each draft id, ascending, or None when draft ids are target ids (the full vocabulary); `target_rows` [N, H]:
    W's rows for those ids (the target's distribution over the draft vocabulary), `weight` unless the head has
    its own. Draft logits are `logits(ĥ)` [..., N]."""

    weight: torch.Tensor
    ids: torch.Tensor | None = None
    target_rows: torch.Tensor | None = None

    @property
    def target_weight(self) -> torch.Tensor:
        return self.weight if self.target_rows is None else self.target_rows

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., N]
        return project(h, self.weight)

    def to_target(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (any shape)."""
        return tokens if self.ids is None else self.ids[tokens]

    def to_target_probs(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A distribution over draft ids [..., N] -> the same over target ids [..., vocab_size], 0 outside."""
        if self.ids is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], vocab_size)
        out[..., self.ids] = probs
        return out


class DraftHead(nn.Module):
    """The trainable head. Parameter names follow transformers' MtpLayer (`enorm`, `hnorm`, `eh_proj`,
    `mtp_block.*`, `post_norm`) for `mtp`, and `fc`, `mtp_block.*` for `eagle1`; with a draft vocabulary, the
    buffers `d2t` and `t2d` (EAGLE-3's names and convention)."""

    def __init__(self, target_config, cfg: HeadConfig | None = None):
        super().__init__()
        cfg = cfg or HeadConfig()
        self.cfg = cfg
        self.aux_layers = aux_layer_ids(target_config, cfg)
        if cfg.variant == "eagle3":
            self.config = eagle3_layer_config(target_config, cfg)
            rotary_cls = LlamaRotaryEmbedding
        else:
            self.config = head_config_for(target_config, cfg)
            layer_cls, rotary_cls, norm_cls = family_classes(target_config.model_type)
        H, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.hidden_size = H
        self.post_norm = None
        if cfg.variant == "mtp":
            self.enorm = norm_cls(H, eps=eps)
            self.hnorm = norm_cls(H, eps=eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
        elif cfg.variant == "eagle1":
            self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        else:
            self.fc = nn.Linear(len(self.aux_layers) * H, H, bias=False)
            if cfg.norm_before_fc:
                self.input_norm = LlamaRMSNorm(len(self.aux_layers) * H, eps=eps)
        if cfg.variant == "eagle3":
            self.midlayer = Eagle3Layer(self.config, cfg.norm_before_residual)
            if cfg.num_layers > 1:  # named layers.1 .. layers.{n-1}, as the engines name them after layer 0
                self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(self.config, layer_idx=i)
                                             for i in range(1, cfg.num_layers)})
            self.norm = LlamaRMSNorm(H, eps=eps)
            self.lm_head = nn.Linear(H, cfg.draft_vocab, bias=False)
        else:
            self.mtp_block = layer_cls(self.config, layer_idx=0)
            if cfg.variant == "eagle1":
                self.mtp_block.input_layernorm = nn.Identity()
            self.post_norm = norm_cls(H, eps=eps) if cfg.variant == "mtp" else None
        V, N = target_config.vocab_size, cfg.draft_vocab
        if N >= V:
            raise ValueError(f"head.draft_vocab={N} is not below the target's vocabulary size {V}: use "
                             "head.draft_vocab=0 to draft over the full vocabulary")
        if N:  # the first N ids until `set_draft_vocab` (training) or a checkpoint (`load_state_dict`) says otherwise
            self.register_buffer("d2t", torch.zeros(N, dtype=torch.long))  # target id = draft id + d2t[draft id]
            self.register_buffer("t2d", torch.arange(V) < N)  # [V] bool: target ids inside the draft vocabulary
        self.rotary_emb = rotary_cls(config=self.config)  # buffers only, not persistent
        # transformers renamed the decoder layer's cache argument (past_key_values -> cache)
        params = inspect.signature(type(self.layer).forward if cfg.variant != "eagle3"
                                   else type(self.midlayer.self_attn).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def extra_layers(self) -> list[nn.Module]:
        """eagle3's decoder layers after `midlayer` (`head.num_layers` > 1), in order; [] otherwise."""
        return list(self.layers.values()) if hasattr(self, "layers") else []

    @property
    def layer(self) -> nn.Module:
        """The head's decoder layer (`mtp_block`, or eagle3's `midlayer`)."""
        return self.midlayer if self.cfg.variant == "eagle3" else self.mtp_block

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The first step's h from the target's features: eagle3's fc over its aux layers' states [.., k·H]
        (concatenated in `aux_layers` order); the final hidden state itself for the other variants."""
        if self.cfg.variant != "eagle3":
            return features
        return self.fc(self.input_norm(features) if self.cfg.norm_before_fc else features)

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads from a step's output: eagle3's `norm(z)` (with `norm_output` the output is
        norm(z) already); the output itself otherwise (mtp's ĥ is already normalised by post_norm, and is what the
        chain feeds back)."""
        return self.norm(out) if self.cfg.variant == "eagle3" and not self.cfg.norm_output else out

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache: HeadCache | None = None) -> torch.Tensor:
        """token_embeds E[x_{i+1}] [B, T, H], hidden h_i (`fuse`d target features, or the previous step's
        output) [B, T, H], position_ids [B, T], attention_mask additive [B, 1, T, S] over the cache's S entries
        after this call -> the step's output [B, T, H] (ĥ; `readout` gives what the lm_head reads)."""
        before = cache.get_seq_length() if cache is not None else 0
        if self.cfg.variant == "eagle3":
            rotary = self.rotary_emb(hidden, position_ids)
            z = self.midlayer(token_embeds, hidden, attention_mask, rotary, cache)
            for layer in self.extra_layers:
                z = layer(z, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=rotary,
                          **{self._cache_kw: cache})
                z = z[0] if isinstance(z, tuple) else z
        else:
            if self.cfg.variant == "mtp":
                u = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))
            else:
                u = self.fc(torch.cat([token_embeds, hidden], dim=-1))
            z = self.mtp_block(u, attention_mask=attention_mask, position_ids=position_ids,
                               position_embeddings=self.rotary_emb(u, position_ids), **{self._cache_kw: cache})
        if cache is not None and cache.get_seq_length() != before + hidden.shape[1]:
            raise RuntimeError(f"{type(self.layer).__name__} did not write the head's KV cache (passed as "
                               f"{self._cache_kw!r}); this transformers version calls it differently")
        if isinstance(z, tuple):  # older decoder layers return (hidden_states, ...)
            z = z[0]
        if self.cfg.variant == "eagle3" and self.cfg.norm_output:
            return self.norm(z)
        return self.post_norm(z) if self.post_norm is not None else z

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target ids of the draft vocabulary [N], ascending; None without one."""
        if not self.cfg.draft_vocab:
            return None
        return self.d2t + torch.arange(self.cfg.draft_vocab, device=self.d2t.device)

    def set_draft_vocab(self, ids: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> None:
        """Set the draft vocabulary: `ids`, N distinct target ids (any order). An eagle3 head's own lm_head
        starts from the target's lm_head rows for them (`lm_head_weight`, W [V, H])."""
        N, V = self.cfg.draft_vocab, self.t2d.shape[0] if self.cfg.draft_vocab else 0
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().sort().values
        distinct = int(ids.unique().numel())
        if not N or ids.numel() != N or distinct != N or int(ids[0]) < 0 or int(ids[-1]) >= V:
            got = f"{ids.numel()} ids ({distinct} distinct" + (f", from {int(ids[0])} to {int(ids[-1])})"
                                                              if ids.numel() else ")")
            raise ValueError(f"set_draft_vocab: expected {N} distinct target ids in [0, {V}) for "
                             f"head.draft_vocab={N}, got {got}")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(N))
            self.t2d.zero_()
            self.t2d[ids.to(self.t2d.device)] = True
            if self.cfg.variant == "eagle3" and lm_head_weight is not None:
                self.lm_head.weight.copy_(lm_head_weight.index_select(0, ids.to(lm_head_weight.device)))

    def init_fc_identity(self, layer: int) -> None:
        """eagle3's fc as the identity on target layer `layer`'s block of the fused features and zero elsewhere
        (`head.init_fc`): fc(features) is then that layer's residual (after `input_norm` with `norm_before_fc`)."""
        if layer not in self.aux_layers:
            raise ValueError(f"head.init_fc={layer}: not one of the head's aux layers {self.aux_layers} (fc starts "
                             "as the identity on one of the target layers it fuses); set it to one of them or -1")
        H, k = self.hidden_size, self.aux_layers.index(layer)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, k * H:(k + 1) * H].copy_(torch.eye(H))

    def draft_lm_head(self, W: torch.Tensor) -> DraftLMHead:
        """What the head drafts with, given the target's lm_head weight W [V, H]: W's rows for the draft
        vocabulary and their target ids (W itself for the full vocabulary). The training loss, validation
        and the drafter all form draft logits and map drafts back to target ids through this."""
        ids = self.draft_ids
        if ids is None:
            return DraftLMHead(W)
        ids = ids.to(W.device)
        rows = W.index_select(0, ids)
        if self.cfg.variant == "eagle3":
            return DraftLMHead(self.lm_head.weight, ids, rows)
        return DraftLMHead(rows, ids)

    def init_from_target(self, frozen) -> None:
        """Start `post_norm` (eagle3: `norm`) from the target's final norm (the head's ĥ then lives where h
        does), and eagle3's lm_head from W's rows of the draft vocabulary (again at `set_draft_vocab`)."""
        norm = self.norm if self.cfg.variant == "eagle3" else self.post_norm
        with torch.no_grad():
            if norm is not None and frozen.final_norm is not None:
                norm.weight.copy_(frozen.final_norm.to(norm.weight))
            if self.cfg.variant == "eagle3":
                ids = self.draft_ids.to(frozen.lm_head_weight.device)
                self.lm_head.weight.copy_(frozen.lm_head_weight.index_select(0, ids).to(self.lm_head.weight))


def target_layer_keys(head: DraftHead, layer: int, num_layers: int) -> dict[str, str]:
    """head parameter name -> the target checkpoint key it starts from with `head.init_layer` (the target's
    decoder layer `layer`): every weight of the head's decoder layer that the target's layer has, by name
    (eagle3's `hidden_norm` from the target's `input_layernorm`, its 2H-wide q, k, v from the target's H-wide
    ones); an eagle3 head's further layers (`head.num_layers` > 1) from the target's next layers, `layers.j` from
    `layer + j`. Raises for a layer index outside the target."""
    last = layer + len(head.extra_layers)
    if not 0 <= layer <= last < num_layers:
        more = f" and its {len(head.extra_layers)} next" if head.extra_layers else ""
        raise ValueError(f"head.init_layer={layer}: the target has {num_layers} decoder layers (0..{num_layers - 1}); "
                         f"the head's {1 + len(head.extra_layers)} layers start from layer {layer}{more}")
    prefix, src = ("midlayer." if head.cfg.variant == "eagle3" else "mtp_block."), f"model.layers.{layer}."
    out = {}
    for name, _ in head.layer.named_parameters():
        out[prefix + name] = src + ("input_layernorm.weight" if name == "hidden_norm.weight" else name)
    for j, extra in enumerate(head.extra_layers, start=1):
        for name, _ in extra.named_parameters():
            out[f"layers.{j}.{name}"] = f"model.layers.{layer + j}.{name}"
    return out


def load_target_layer(head: DraftHead, tensors: dict[str, torch.Tensor], keys: dict[str, str]) -> list[str]:
    """Copy the target layer's `tensors` into the head per `keys` (from `target_layer_keys`); returns the head
    parameters the target had none for (left as they were). A shape that differs is an error,
    except eagle3's q, k, v [out, 2H], whose feature half [:, H:] takes the target's [out, H]."""
    params = dict(head.named_parameters())
    missing = []
    with torch.no_grad():
        for name, key in keys.items():
            if key not in tensors:
                missing.append(name)
                continue
            p, t = params[name], tensors[key].to(params[name])
            if p.shape == t.shape:
                p.copy_(t)
            elif head.cfg.variant == "eagle3" and p.dim() == 2 and p.shape == (t.shape[0], 2 * t.shape[1]):
                p[:, t.shape[1]:].copy_(t)
                if head.cfg.init_token_half == "zero":
                    p[:, :t.shape[1]].zero_()
            else:
                raise ValueError(f"head.init_layer: the target's {key} is {tuple(t.shape)}, the head's {name} "
                                 f"is {tuple(p.shape)}: this target's layer cannot start this head")
    return missing


def chain_masks(valid: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask for unrolled step `step` over T anchors: keys are [step-0 block | step-1 | ...].

    valid [B, T] marks real (non-padding) anchors. The step-0 block is causal over anchors (keys from target
    features up to the anchor); each later block is the anchor's own chain entry (the diagonal).
    Returns [B, 1, T, (step+1)*T].
    """
    B, T = valid.shape
    idx = torch.arange(T, device=valid.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]: anchor i sees k <= i
    blocks = [causal] + [torch.eye(T, dtype=torch.bool, device=valid.device)] * step
    allowed = torch.cat(blocks, dim=1)[None, None] & valid.repeat(1, step + 1)[:, None, None, :]
    return additive_mask(allowed, dtype)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, i] <- x[:, i + n], filled past the end. Works on [B, T] and [B, T, H]."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-n] = x[:, n:]
    return out


def unrolled(head: DraftHead, embed, hidden: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
             depth: int, detach_chain: bool = False) -> list[torch.Tensor]:
    """The training forward for all anchors at once, `depth` steps deep.

    hidden [B, T, H] are the target's h (eagle3: its aux layers' states [B, T, k·H], `fuse`d first), input_ids
    [B, T], lengths [B] real tokens per row (right padding). `embed` maps ids to the frozen embeddings. Returns
    [ĥ_0, ..., ĥ_{depth-1}], each [B, T, H] (what the lm_head reads: `readout` of each step's output), where
    ĥ_j[:, i] is the head's estimate of h_{i+1+j} for the chain anchored at i (valid where i+1+j < length).
    With `detach_chain` the state step j hands to step j+1 carries no gradient: a later depth's loss trains the
    weights on the state it is given, not the earlier steps that made it (the cache's keys and values still do).
    """
    B, T, _ = hidden.shape
    pos = torch.arange(T, device=hidden.device)[None].expand(B, T)
    valid = pos < lengths[:, None]
    cache = HeadCache()
    outputs, h = [], head.fuse(hidden)
    for j in range(depth):
        tokens = shift_left(input_ids, 1 + j)  # x_{i+1+j}
        mask = chain_masks(valid, j, hidden.dtype)
        if j and detach_chain:
            h = h.detach()
        h = head(embed(tokens), h, pos + 1 + j, mask, cache)
        outputs.append(head.readout(h))
    return outputs
