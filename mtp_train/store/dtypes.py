"""The store's storage dtypes and how hidden states are encoded in them: fp32, bf16, fp16 as plain casts,
fp8 (e4m3) with one float32 scale per token. `encode` and `decode` are the only conversions between the
float hidden states the stages compute and the bytes a shard holds."""

from __future__ import annotations

import torch

from mtp_train.store.config import STORE_DTYPE_NAMES

STORE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16, "float8_e4m3": torch.float8_e4m3fn}
assert tuple(STORE_DTYPES) == STORE_DTYPE_NAMES
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: the largest e4m3 value
# safetensors dtype names -> torch dtypes, for the tensors a shard may hold
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                              "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I8": torch.int8,
                                              "I64": torch.int64}


def check_dtype(dtype: str) -> None:
    if dtype not in STORE_DTYPES:
        raise ValueError(f"unknown store dtype {dtype!r}; expected one of {', '.join(STORE_DTYPES)}")


def encode(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hidden states [N, H] -> (data [N, H] in the storage dtype, scale [N] float32 for fp8, else None).
    fp8 scales each token so its largest entry maps to e4m3's largest value: one scale per token keeps
    tokens with small activations as precise as tokens with large ones."""
    if dtype != "float8_e4m3":
        check_dtype(dtype)
        return x.to(STORE_DTYPES[dtype]), None
    x = x.float()
    amax = x.abs().amax(dim=-1)  # [N]
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # > 0 even for an all-zero token
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale


def decode(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The inverse of `encode`, in float32: [N, H]."""
    out = data.float()
    return out if scale is None else out * scale[:, None]
