"""An HF causal LM behind a croppable, per-row KV cache: the target (and the draft LM) as decoding sees it.

One forward over a batch of new tokens returns their logits and final hidden states. The hidden state is
the decoder's output after its final norm (transformers' `last_hidden_state`, equal to `hidden_states[-1]`
of a full forward): what `lm_head` consumes and what the store holds, so the head sees at inference the
features it was trained on. The logits are `lm_head` applied to it here, only where they are needed (the
last position of a prefill, every position of a verification).

Attention gets an explicit 4-D mask built from the cache's per-row validity, so the model must run with
`sdpa` or `eager` attention (flash-attention kernels take no such mask; `load_runner` falls back to sdpa).
On a GPU, decoding attention runs under `decode_attention()`: SDPA without its cuDNN backend, which PyTorch
prefers for bf16 on Hopper but which builds an execution plan for every new (query, key) length, and decoding
makes a new one at every step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import replace

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtp_train.inference.cache import SlotCache
from mtp_train.model.frozen import project
from mtp_train.model.target import TargetConfig, hook_layer_inputs, load_causal_lm

MASKABLE = ("sdpa", "eager")


def left_pad(rows: list[list[int]], pad: int = 0, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of different lengths -> (ids [B, T], valid [B, T]), right-aligned (padding on the left)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            ids[b, T - len(r):] = torch.tensor(r, dtype=torch.long)
            valid[b, T - len(r):] = True
    return ids.to(device), valid.to(device)


def _projected_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # contiguous, as nn.Linear's output is: `project` may return a transposed view for few rows, and some decoders
    # view their projections' outputs in ways a non-contiguous tensor cannot take (DeepSeek-V2's rotary
    # embedding, `torch.view_as_complex`); a copy of a few rows
    return project(x, module.weight, module.bias).contiguous()


def route_projections(model: nn.Module) -> None:
    """Every `nn.Linear` of a decoder on a CPU computes through `project`: a verification forward (k + 1 rows)
    then takes whichever form reads each weight fastest on this processor, so verifying k drafts costs little
    more than a one-token step. Same function, other summation order; prefills (many rows) keep BLAS's GEMM."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = functools.partial(_projected_linear, module)


DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends decoding may use on `device`: on CUDA every one but cuDNN's (see the module
    docstring; measured on an H200 in bf16, benchmarks/RESULTS.md `gpu`), elsewhere PyTorch's own choice."""
    return sdpa_kernel(DECODE_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


class CausalLMRunner:
    """Wraps `AutoModelForCausalLM`. `forward(cache, ids, valid)` appends to `cache` and returns
    (logits [B, L, V] fp32 for the last L positions, hidden [B, T, H])."""

    def __init__(self, model: nn.Module):
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in MASKABLE:
            raise ValueError(f"the model runs {attn!r} attention; speculative decoding passes explicit masks and "
                             f"needs one of {', '.join(MASKABLE)}")
        self.model = model
        self.base = model.base_model  # the decoder: embeddings, layers, final norm
        self.lm_head = model.get_output_embeddings()
        if self.device.type == "cpu":
            route_projections(self.base)
        params = inspect.signature(self.base.forward).parameters  # transformers renamed past_key_values -> cache
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def new_cache(self, batch: int) -> SlotCache:
        return SlotCache(batch, self.device)

    @torch.inference_mode()
    def forward(self, cache: SlotCache, ids: torch.Tensor, valid: torch.Tensor, logits_last: int | None = None,
                layers: list[int] | None = None, positions: torch.Tensor | None = None,
                tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] right-aligned with `valid [B, T]`; each row continues its own sequence in `cache`.
        Returns logits [B, L, V] (L = logits_last, or T) in fp32 and the features [B, T, H]: the final hidden
        states, or with `layers` (an eagle3 head's) the residual entering each of them, concatenated [B, T, k·H].
        A draft tree passes explicit `positions [B, T]` and its ancestor mask `tree [B, T, W]`
        (`SlotCache.attention_mask`); by default the tokens continue each row causally."""
        mask = cache.attention_mask(valid, self.dtype, tree=tree)
        positions = cache.positions(valid) if positions is None else positions
        caught: dict[int, torch.Tensor] = {}
        hooks = hook_layer_inputs(self.base, layers, caught, "the head's aux_layers") if layers else []
        try:
            with decode_attention(self.device):
                out = self.base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                **{self._cache_kw: cache})
        finally:
            for h in hooks:
                h.remove()
        cache.commit(valid)
        hidden = out.last_hidden_state  # [B, T, H], after the final norm
        tail = hidden if logits_last is None else hidden[:, -logits_last:]
        features = torch.cat([caught[i] for i in layers], dim=-1) if layers else hidden
        return project(tail, self.lm_head.weight, self.lm_head.bias).float(), features


def load_runner(path: str, target: TargetConfig, what: str = "target") -> CausalLMRunner:
    """The causal LM at `path` with the run's dtype and device, on a maskable attention implementation."""
    attn = target.attn_implementation if target.attn_implementation in MASKABLE else "sdpa"
    return CausalLMRunner(load_causal_lm(path, replace(target, attn_implementation=attn), what))
