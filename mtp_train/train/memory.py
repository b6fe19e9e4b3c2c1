"""How much memory one training process needs at its peak, from the target's `config.json` and the train
config alone (no weights are read): printed when training starts, and what the recipe tests check against
an 80 GB H100.

Per process (one GPU), with P the head's trainable parameters (counted exactly, by building the head on the
meta device) and N the data-parallel world size:

    weights       the head in fp32: 4P (ZeRO-3: 4P/N, plus the layer being computed, gathered whole)
    gradients     fp32: 4P (ZeRO-2/3: 4P/N; the full gradient of one parameter at a time, counted in buffers)
    optimizer     AdamW's two moments 8P (ZeRO: 8P/N, plus DeepSpeed's fp32 master partition 4P/N)
    frozen        the target's embedding E and lm_head W (one matrix when tied): V x H in bf16 under bf16
                  precision, fp32 otherwise; with a draft vocabulary of D tokens also W's D rows (D x H)
    activations   what the unrolled forward keeps for backward, per token of a full micro-batch and per depth
                  (coefficients below, measured on the real forward with saved-tensor hooks); under bf16
                  autocast also the bf16 copies of the head's weights that autocast keeps for backward (2P)
    buffers       at once, the largest of: the loss's chunk buffers (chunk_tokens x V logits, fp32; with a
                  draft vocabulary of D tokens one [chunk_tokens, V] and three [chunk_tokens, D]; one more of
                  the vocabulary's width with the LK term, `train.loss.accept_weight`), the
                  backward's temporaries of one unrolled step (3 x [tokens, I] gradients, and the recomputed
                  MLP under activation checkpointing); plus DeepSpeed's communication buckets and the largest
                  single gradient before it is reduced
    overhead      1 GiB (CUDA context, cuBLAS workspace, NCCL) + 10% of the rest (allocator fragmentation)
    target        online / hybrid training (`train.features`) only: the frozen target this process holds, its
                  weights in target.dtype (counted by building it on the meta device), and one inference forward
                  of store.batch_tokens tokens (the residual, one layer's widest temporaries, the states kept)

Activation bytes per token at unrolled step j (keys S_j = (j + 1) T, a = bytes of the compute dtype: 2 under
bf16 autocast, 4 in fp32), for a decoder layer with query width q = heads x head_dim, key width k (after
grouped-query heads are repeated to the query heads, as SDPA with an explicit mask needs), value width v:

    a x (11 H + q + (j + 1)(k + v) + 4 I + 3 S_j)    inputs of eh_proj (2H), norms, projections, attention,
                                                     MLP (gate, up, act, product: 4 I), the additive masks
    + 4 x 4 H                                        fp32 inputs of the four RMSNorms
    + 4 x 3 H                                        the loss: ĥ and h_next of each counted position, and
                                                     the gradient the chunked loss forms in its forward
DeepSeek-V2's MLA adds its compressed KV (kv_lora_rank + rope dim), that vector normed (and its fp32 norm
input) and its expansion heads x (nope + v dim). With `train.activation_checkpointing` the MLP keeps only its
input: 4 I becomes H. `tests/test_memory.py` checks these against the bytes the forward really saves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModel

from mtp_train.model.eagle3 import aux_layer_ids
from mtp_train.model.head import DraftHead
from mtp_train.model.target import TargetArch, torch_dtype
from mtp_train.train.distributed import ZERO_BUCKET

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

GIB = 1 << 30
H100_80GB = 79 * GIB  # what torch reports as total on an 80 GB H100 (81,559 MiB), rounded down
CUDA_OVERHEAD = 1 * GIB
FRAGMENTATION = 0.10


def load_target_config(target):
    """A transformers config from a model directory or a config.json path (no weights read); configs pass."""
    if not isinstance(target, (str, Path)):
        return target
    path = Path(target)
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}: the memory estimate reads the target's architecture "
                                "from it")
    return AutoConfig.from_pretrained(path)


def meta_head(target_config, head_cfg=None):
    """The draft head built on the meta device: exact shapes and parameter count, no memory."""
    with torch.device("meta"):
        return DraftHead(load_target_config(target_config), head_cfg)


@dataclass(frozen=True)
class AttentionWidths:
    q: int  # heads x query head dim
    k: int  # heads x key head dim (grouped KV heads repeated to the query heads)
    v: int  # heads x value head dim


def attention_widths(config) -> AttentionWidths:
    heads = config.num_attention_heads
    if config.model_type == "deepseek_v2":  # MLA: keys and queries carry the no-rope and rope parts
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        return AttentionWidths(heads * qk, heads * qk, heads * config.v_head_dim)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionWidths(heads * head_dim, heads * head_dim, heads * head_dim)


def activation_bytes_per_token(config, step: int, seq_len: int, compute_bytes: int,
                               activation_checkpointing: bool) -> int:
    """Bytes kept for backward per token at unrolled step `step` (0-based); see the module docstring."""
    H, I = config.hidden_size, config.intermediate_size
    w = attention_widths(config)
    mlp = H if activation_checkpointing else 4 * I
    keys = (step + 1) * seq_len
    kept = 11 * H + w.q + (step + 1) * (w.k + w.v) + mlp + 3 * keys
    fp32 = 4 * H + 3 * H
    if config.model_type == "deepseek_v2":  # MLA: the compressed KV, its norm and its expansion per new token
        rank, heads = config.kv_lora_rank, config.num_attention_heads
        kept += 2 * rank + config.qk_rope_head_dim + heads * (config.qk_nope_head_dim + config.v_head_dim)
        fp32 += rank
    return compute_bytes * kept + 4 * fp32


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process (per GPU) at the peak of a training step."""

    trainable_params: int
    frozen_params: int
    tokens: int  # per micro-batch
    weights: int
    gradients: int
    optimizer: int
    frozen: int
    activations: int
    buffers: int
    overhead: int
    target: int = 0  # online features: the frozen target and its forward

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self)
                   if f.name not in ("trainable_params", "frozen_params", "tokens"))

    def fits(self, device_bytes: int) -> bool:
        return self.total <= device_bytes

    def format(self, device_bytes: int | None = None, what: str = "") -> str:
        rows = [("head weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("frozen E / W", self.frozen), ("activations", self.activations), ("buffers", self.buffers),
                ("overhead", self.overhead)] + ([("target (online)", self.target)] if self.target else [])
        head = (f"memory per GPU (estimate{', ' + what if what else ''}): {self.trainable_params / 1e6:,.1f} M "
                f"trainable head parameters, {self.frozen_params / 1e6:,.1f} M frozen, {self.tokens:,} tokens "
                "per micro-batch")
        lines = [head] + [f"  {name:<16}{b / GIB:>8.2f} GiB" for name, b in rows]
        total = f"  {'total':<16}{self.total / GIB:>8.2f} GiB"
        if device_bytes:
            total += f" of {device_bytes / GIB:.1f} GiB ({self.total / device_bytes:.0%})"
        return "\n".join(lines + [total])


def online_target_bytes(config, dtype_bytes: int, batch_tokens: int, streams: int) -> int:
    """The frozen target of online training: weights + one inference forward of `batch_tokens` tokens keeping
    `streams` [tokens, H] states (the final one and the aux layers)."""
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    H, I = config.hidden_size, config.intermediate_size
    w = attention_widths(config)
    per_token = 2 * H + max(3 * I, w.q + w.k + w.v + H) + streams * H
    return dtype_bytes * (params + batch_tokens * per_token)


def estimate_memory(target_config, train, seq_len: int, world: int, strategy: str, head_cfg=None,
                    zero_bucket: int | None = None, online_target: int = 0) -> MemoryEstimate:
    """Per-process memory of training the head of `target_config` (a transformers config, a model directory
    or a config.json) with `train` (a TrainConfig), samples of `seq_len` tokens, `world` processes and a
    resolved strategy (single | ddp | deepspeed; ZeRO stage from train.zero_stage). `online_target`: the
    bytes of the target an online run holds (`online_target_bytes`)."""
    config = load_target_config(target_config)
    head = meta_head(config, head_cfg)
    P = sum(p.numel() for p in head.parameters())
    bucket = ZERO_BUCKET if zero_bucket is None else zero_bucket
    bf16 = train.precision == "bf16"
    a = 2 if bf16 else 4
    V, H = config.vocab_size, config.hidden_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    frozen_params = V * H * (1 if tied else 2)
    D = getattr(head_cfg, "draft_vocab", 0) if head_cfg is not None else 0
    frozen = (frozen_params + D * H) * a  # the draft vocabulary's rows of W, selected once per step
    stage = train.zero_stage if strategy == "deepspeed" else 0
    n = max(1, world)
    largest_param = max(p.numel() for p in head.parameters())
    modules = [head.layer.self_attn, head.layer.mlp, getattr(head, "eh_proj", None) or head.fc]
    largest_module = max(sum(p.numel() for p in m.parameters()) for m in modules)
    if stage == 0:  # single, DDP (gradients are DDP's bucket views: no second copy)
        weights, grads, optim, comm = 4 * P, 4 * P, 8 * P, 0
    elif stage == 1:
        weights, grads, optim, comm = 4 * P, 4 * P, 12 * P // n, 2 * 4 * bucket
    elif stage == 2:
        weights, grads, optim, comm = 4 * P, 4 * P // n, 12 * P // n, 2 * 4 * bucket + 4 * largest_param
    else:
        weights, grads, optim = 4 * P // n + 4 * largest_module, 4 * P // n, 12 * P // n
        comm = 2 * 4 * bucket + 4 * largest_param
    if train.ema_decay:  # the weight average: a whole fp32 copy on every rank (never under ZeRO-3)
        optim += 4 * P
    tokens = train.micro_batch * seq_len
    layers = 1 + len(head.extra_layers)  # eagle3 with head.num_layers > 1 keeps each layer's activations
    per_token = layers * sum(activation_bytes_per_token(config, j, seq_len, a, train.activation_checkpointing)
                             for j in range(train.depth))
    activations = tokens * per_token + (2 * P if bf16 else 0)
    b = 2 if bf16 else 0  # the bf16 logits of a matmul before their fp32 copy
    lk = 4 if train.loss.accept_weight else 0  # the LK term's [chunk, vocab] buffer
    per_row = V * (8 + b + lk) if not D else V * (4 + b) + D * (12 + b + lk)
    loss_chunk = min(train.loss.chunk_tokens, tokens) * per_row
    # one unrolled step's backward temporaries: gradients of the MLP's [tokens, I] activations and of the norms'
    # fp32 inputs, and with activation checkpointing the MLP's recomputed activations
    backward = tokens * ((3 + (4 if train.activation_checkpointing else 0)) * config.intermediate_size * a + 16 * H)
    buffers = max(loss_chunk, backward) + comm
    rest = weights + grads + optim + frozen + activations + buffers + online_target
    overhead = CUDA_OVERHEAD + int(FRAGMENTATION * rest)
    return MemoryEstimate(P, frozen_params, tokens, weights, grads, optim, frozen, activations, buffers, overhead,
                          online_target)


def online_bytes(cfg: "RunConfig") -> int:
    """`online_target_bytes` of a run config: 0 unless train.features is online or hybrid."""
    if cfg.train.features == "store":
        return 0
    config = load_target_config(cfg.target.path)
    streams = 1 + len(set(cfg.store.layers) | set(aux_layer_ids(TargetArch.from_pretrained(cfg.target.path), cfg.head)))
    dtype_bytes = torch_dtype(cfg.target.dtype).itemsize
    return online_target_bytes(config, dtype_bytes, cfg.store.batch_tokens, streams)


if __name__ == "__main__":  # the command composes a run config, which this module does not import: memory_check.py
    import runpy

    runpy.run_module("mtp_train.train.memory_check", run_name="__main__")
