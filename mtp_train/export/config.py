"""The export stage's settings (`export.*`) and the names of the serving layouts it writes. Plain dataclasses and
constants, no torch: `mtp_train.config` composes them into the run config."""

from __future__ import annotations

from dataclasses import dataclass

# the layouts (directories under run_dir/export/); layouts.py and eagle3.py hold their key names and config fields
HF_MTP, EAGLE, NEXTN, VLLM_MTP = "hf-mtp", "eagle", "deepseek-nextn", "vllm-mtp"
DEEPSEEK_EAGLE = "deepseek-eagle"  # written by format=deepseek-nextn beside it
EAGLE3, EAGLE3_SPECULATORS = "eagle3", "eagle3-speculators"
FORMATS = ("auto", HF_MTP, VLLM_MTP, EAGLE, EAGLE3, NEXTN)  # export.format
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class ExportConfig:
    format: str = "auto"  # auto | hf-mtp | vllm-mtp | eagle | eagle3 | deepseek-nextn (auto: what fits head, target)
    checkpoint: str | None = None  # a checkpoint directory (run_dir/checkpoints/step-N); none: the latest
    dtype: str = "auto"  # auto (the target's config.json dtype) | bf16 | fp16 | fp32
    overwrite: bool = False  # replace export directories made from other inputs

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"export.format={self.format!r}: expected one of {', '.join(FORMATS)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"export.dtype={self.dtype!r}: expected auto, {', '.join(DTYPES)}")
