import os

import pytest
import torch

# Tests are CPU-only, offline and deterministic.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(min(2, os.cpu_count() or 1))

from mtp_train.config import ASSETS_DIR  # noqa: E402

TINY = ASSETS_DIR / "tiny"


@pytest.fixture(scope="session")
def tiny_dir():
    if not (TINY / "target" / "model.safetensors").is_file():
        pytest.fail(f"the embedded tiny target is missing under {TINY}: run `make assets`")
    return TINY
