"""The precompute stage's settings (`store.*`): how the target's hidden states are stored. A plain dataclass, no
torch: `mtp_train.config` composes it into the run config."""

from __future__ import annotations

from dataclasses import dataclass, field

STORE_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float8_e4m3")  # the keys of dtypes.STORE_DTYPES


@dataclass
class StoreConfig:
    """How hidden states are stored (`store.*`)."""

    dtype: str = "auto"  # auto (= target.dtype) | float32 | bfloat16 | float16 | float8_e4m3 (per-token scale)
    layers: list[int] = field(default_factory=list)  # extra layers i: the residual entering decoder layer i (i = L:
    #   the last layer's output before the final norm, which speculators trains on)
    shard_mb: float = 1024.0  # shard size in MiB
    batch_tokens: int = 4096  # padded tokens per forward batch (padded length × batch size)
    pad_multiple: int = 64  # a sample is padded to a multiple of this and batched only with samples of the same
    #   padded length: its states then do not depend on which samples share its batch (online training and
    #   hybrid stores reproduce precompute's bytes)
    max_bytes: float = 0  # train.features=hybrid: the most bytes of train shards to write (0 = no limit);
    #   samples in shards past it are computed online in every epoch
    gpus_per_process: int = 1  # >1: each process spreads the target over this many GPUs (device_map=auto)
    overwrite: bool = False  # replace a store made with another target, tokenizer, data or store config

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in STORE_DTYPE_NAMES:
            raise ValueError(f"store.dtype={self.dtype!r}; expected auto or one of {', '.join(STORE_DTYPE_NAMES)}")
        if any(i < 0 for i in self.layers) or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"store.layers={list(self.layers)}; expected distinct layer indices >= 0")
        if not self.shard_mb > 0:
            raise ValueError(f"store.shard_mb must be positive, got {self.shard_mb}")
        if self.batch_tokens < 1:
            raise ValueError(f"store.batch_tokens must be at least 1, got {self.batch_tokens}")
        if self.pad_multiple < 1:
            raise ValueError(f"store.pad_multiple must be at least 1, got {self.pad_multiple}")
        if self.max_bytes < 0:
            raise ValueError(f"store.max_bytes must be >= 0 (0: no limit), got {self.max_bytes}")
        if self.gpus_per_process < 1:
            raise ValueError(f"store.gpus_per_process must be at least 1, got {self.gpus_per_process}")

    def storage_dtype(self, target_dtype: str) -> str:
        """`auto` stores in the dtype the target computes in (fp32 on CPUs, bf16 on GPUs)."""
        return target_dtype if self.dtype == "auto" else self.dtype
