"""A run directory holding one checkpoint of an untrained head (seeded), for the tests and `make test-serving`
cases that need an exportable head but not a trained one."""

from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig

from mtp_train.model.head import DraftHead, HeadConfig
from mtp_train.model.target import target_fingerprint
from mtp_train.train import checkpoint as ckpt


def untrained_head_run(run_dir: Path, target: Path, variant: str, seed: int = 0, step: int = 1) -> DraftHead:
    """Saves `run_dir/checkpoints/step-<step>` (then the latest) with a freshly initialised `variant` head on
    `target`."""
    torch.manual_seed(seed)
    head_cfg = HeadConfig(variant=variant)
    head = DraftHead(AutoConfig.from_pretrained(target), head_cfg)
    meta = {"variant": variant, "head": asdict(head_cfg), "target_path": str(target),
            "target_fingerprint": target_fingerprint(target), "step": step, "depth": 1}
    ckpt.save(ckpt.checkpoint_root(run_dir), step, head.state_dict(), meta, {}, {}, f"train:\n  steps: {step}\n")
    return head
