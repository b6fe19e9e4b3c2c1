"""The target's forward pass over prepared samples, as the store computes it: where the target runs in this
process (`Ranks`, `placement`), loading its decoder (`load_decoder`), the hidden states one forward yields
(`HiddenStates`), and samples batched through it by padded length (`sample_states`). precompute writes what it
yields into shards; online and hybrid training (`train/features.py`) compute their features through the same
calls, so the states are the same bits.

The inference path: the decoder alone (`AutoModel`, so the `lm_head` is never loaded and no logits are
computed), `inference_mode`, no KV cache, the configured attention implementation and dtype. Samples are
batched by length and right-padded without an attention mask: under causal attention a real token never sees
the padding that follows it, so its states equal an unpadded forward's, SDPA takes its causal fast path (flash
kernels on GPUs), and the padded positions are simply dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoModel
from transformers.utils import logging as hf_logging

from mtp_train.model.config import TargetConfig
from mtp_train.model.target import check_model_dir, hook_layer_inputs, resolve_device, torch_dtype
from mtp_train.store.config import StoreConfig


# ------------------------------------------------------------------------------------------ placement


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Ranks":
        """torchrun's RANK / WORLD_SIZE / LOCAL_RANK; one process otherwise."""
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def gpu_indices(local_rank: int, gpus_per_process: int, device_count: int) -> list[int]:
    """The GPUs of one process: local rank r gets [r·g, (r+1)·g)."""
    gpus = list(range(local_rank * gpus_per_process, (local_rank + 1) * gpus_per_process))
    if gpus[-1] >= device_count:
        raise ValueError(f"local rank {local_rank} with store.gpus_per_process={gpus_per_process} needs GPUs "
                         f"{gpus[0]}..{gpus[-1]}, but this node has {device_count}: launch "
                         f"nproc_per_node = GPUs / store.gpus_per_process")
    return gpus


def placement(target: TargetConfig, store: StoreConfig, ranks: Ranks) -> tuple[str, dict[int, int] | None]:
    """(device_map, max_memory) for loading the target in this process."""
    device = resolve_device(target.device)
    if device.type == "cpu":
        if store.gpus_per_process > 1:
            raise ValueError(f"store.gpus_per_process={store.gpus_per_process} needs GPUs; the target runs on the CPU")
        return "cpu", None
    if target.device.startswith("cuda:"):
        if ranks.world > 1 or store.gpus_per_process > 1:
            raise ValueError(f"target.device={target.device} pins the target to one GPU; under torchrun or with "
                             "store.gpus_per_process > 1 use target.device=auto")
        return target.device, None
    gpus = gpu_indices(ranks.local_rank, store.gpus_per_process, torch.cuda.device_count())
    if len(gpus) == 1:
        return f"cuda:{gpus[0]}", None
    # only these GPUs (no CPU or disk offload), each filled to 85% of its free memory: the rest is for activations
    return "auto", {g: int(torch.cuda.mem_get_info(g)[0] * 0.85) for g in gpus}


def load_decoder(target: TargetConfig, device_map: str, max_memory: dict[int, int] | None) -> torch.nn.Module:
    """The target's decoder (embeddings, layers, final norm) without its lm_head, ready for inference."""
    path = check_model_dir(target.path)
    verbosity = hf_logging.get_verbosity()
    # the load report would call the skipped lm_head "unexpected"; missing keys are checked below instead
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModel.from_pretrained(path, dtype=torch_dtype(target.dtype),
                                                attn_implementation=target.attn_implementation,
                                                trust_remote_code=target.trust_remote_code, device_map=device_map,
                                                max_memory=max_memory, output_loading_info=True)
    except OSError as e:
        raise FileNotFoundError(f"target at {path} could not be loaded: {str(e).splitlines()[0]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
    if missing:
        raise ValueError(f"target at {path}: decoder weights missing or of the wrong shape in the checkpoint: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    offloaded = sorted(k for k, v in (getattr(model, "hf_device_map", None) or {}).items() if v in ("cpu", "disk"))
    if device_map == "auto" and offloaded:
        raise ValueError(f"target at {path} does not fit on this process's {len(max_memory or {})} GPUs "
                         f"({', '.join(offloaded[:3])} would go to CPU/disk): raise store.gpus_per_process")
    return model.eval().requires_grad_(False)


class HiddenStates:
    """Runs the decoder on a batch: its final hidden states (after the final norm) and the residual stream
    entering each requested layer, caught by forward pre-hooks so no other layer's states are kept."""

    def __init__(self, decoder: torch.nn.Module, layers: list[int]):
        self.decoder, self.layers = decoder, list(layers)
        self._captured: dict[int, torch.Tensor] = {}
        hook_layer_inputs(decoder, self.layers, self._captured)
        self.device = decoder.get_input_embeddings().weight.device

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [B, T] -> final [B, T, H], [layer i input [B, T, H] for i in layers].

        On CPUs a batch of one row is run as two (the second all padding, dropped): PyTorch's CPU kernels take
        another path for one row, whose rounding differs from a batch's, and a sample's states must not depend
        on how many samples share its batch (the store's bytes and online training's features must agree)."""
        B = input_ids.shape[0]
        if B == 1 and self.device.type == "cpu":
            input_ids = torch.cat([input_ids, torch.zeros_like(input_ids)])
        out = self.decoder(input_ids=input_ids.to(self.device), use_cache=False)
        return out.last_hidden_state[:B], [self._captured.pop(i)[:B] for i in self.layers]


# -------------------------------------------------------------------------------------------- batches


def padded_length(n: int, multiple: int) -> int:
    """A sample of n tokens is computed padded to the next multiple of `multiple`."""
    return -(-n // multiple) * multiple


def length_batches(lengths: list[int], batch_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Sample indices grouped by padded length (`padded_length`), longest first, into batches of at most
    `batch_tokens` padded tokens (one sample per batch at least): samples share a batch only with samples of
    their padded length, so each one is computed at the same shape whatever its batch-mates; the largest batch
    runs first, so a batch that does not fit in memory fails at once. Empty samples need no forward."""
    padded = {j: padded_length(n, multiple) for j, n in enumerate(lengths) if n > 0}
    order = sorted(padded, key=lambda j: (-padded[j], -lengths[j], j))
    batches: list[list[int]] = []
    for j in order:
        if batches and padded[batches[-1][0]] == padded[j] and (len(batches[-1]) + 1) * padded[j] <= batch_tokens:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def sample_states(hidden_states: HiddenStates, input_ids: torch.Tensor, offsets: torch.Tensor, batch_tokens: int,
                  multiple: int):
    """The target's states for the samples input_ids[offsets[j]:offsets[j+1]], batch by batch (`length_batches`):
    yields (token rows [n] of the batch's samples, in the flat order of `input_ids`, [final, *layers] each
    [n, H] on the target's device, the batch's padded tokens). precompute and online training both compute
    through this."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    for group in length_batches(lengths, batch_tokens, multiple):
        t = padded_length(lengths[group[0]], multiple)
        batch = torch.zeros(len(group), t, dtype=torch.long)  # [B, T] right-padded; padded positions are dropped
        for r, j in enumerate(group):
            batch[r, : lengths[j]] = input_ids[offsets[j] : offsets[j + 1]]
        rows = torch.cat([torch.arange(offsets[j], offsets[j + 1]) for j in group])  # the tokens' rows
        valid = torch.arange(t)[None, :] < torch.tensor([lengths[j] for j in group])[:, None]  # [B, T]
        final, extra = hidden_states(batch)
        yield rows, [x[valid.to(x.device)] for x in (final, *extra)], len(group) * t  # [n, H], as `rows`
