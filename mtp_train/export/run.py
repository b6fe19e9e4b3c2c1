"""`mtp-train export`: the trained head in the layouts serving engines load (docs/design.md §7).

    mtp-train export recipe=tiny run_dir=runs/demo [format=auto|hf-mtp|vllm-mtp|eagle|eagle3|deepseek-nextn]
                     [checkpoint=DIR] [dtype=auto|bf16|fp16|fp32] [overwrite=true]

| format           | head, target           | writes under run_dir/export/                                    |
|------------------|------------------------|-----------------------------------------------------------------|
| `hf-mtp`         | `mtp`, Llama / Qwen    | `hf-mtp/` (the head alone as MTP layer N) and `hf-mtp-stitched/` |
|                  |                        | (the target, linked, plus the head: transformers `use_mtp=True`) |
| `eagle`          | `eagle1`, Llama        | `eagle-vllm/` and `eagle-sglang/` (the engines' EAGLE-1 loaders) |
| `deepseek-nextn` | `mtp`, DeepSeek-V2     | `deepseek-nextn/` (DeepSeek-V3's NextN keys) and `deepseek-eagle/` (vLLM's `EagleDeepSeekMTPModel`) |
| `eagle3`         | `eagle3`, any          | `eagle3/` (vLLM's and SGLang's EAGLE-3 loaders) and               |
|                  |                        | `eagle3-speculators/` (vLLM's speculators format); `eagle3.py`   |
| `vllm-mtp`       | `mtp`, Llama / Qwen    | `vllm-mtp/` (vLLM with our plugin, serving/vllm_plugin: method   |
|                  |                        | `eagle`); also written by `hf-mtp` (and `auto`) for these targets |

`auto` picks the one that fits the head and the target. Key names and config fields per layout, and the
loader files they follow, are in `layouts.py`. Every directory is read back into a `DraftHead` and must
reproduce the trained head's output before it replaces anything, and gets a model card (`card.py`).

A head trained with a draft vocabulary (`head.draft_vocab`) is exported without it except in the EAGLE-3
layouts and `vllm-mtp` (`d2t`, applied by the plugin's compute_logits): the others have none (their engines draft with the target's full lm_head), so `d2t` / `t2d` are left
out and the card says so. The EAGLE-3 directories are read back by loaders that follow each engine
(`eagle3.read_engine`) and must give the trained head's logits over the target vocabulary exactly.

`engine_check.py` serves an export in vLLM (its own venv) beside our engine on the run's held-out prompts and
adds the side-by-side acceptance to the card (`python -m mtp_train.export.engine_check --help`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mtp_train.export.formats import choose_format, export_dtype, export_head
from mtp_train.report import format_table

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

__all__ = ["choose_format", "export_dtype", "run"]


def run(cfg: "RunConfig", root: Path | None = None) -> list[Path]:
    """Write the export directories of `cfg.export.format` under `root` (default `run_dir/export`); returns
    their paths."""
    written, card = export_head(cfg, root or Path(cfg.run_dir) / "export")
    if card.report:
        print(format_table(card.report))
    else:
        print(f"export: no validation report in {Path(cfg.run_dir) / 'validation'} (run mtp-train validate); the "
              "model cards say so")
    return written
