import os

import pytest
import torch

# Tests are CPU-only, offline and deterministic.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# the engine's few-row CPU projections in one form, not the one a timing probe picks (tests/test_projection.py
# tests the probe): the same summation order on every run and machine
os.environ.setdefault("MTP_TRAIN_PROJECTION", "stream")
torch.set_num_threads(min(2, os.cpu_count() or 1))

from mtp_train.config import ASSETS_DIR  # noqa: E402

TINY = ASSETS_DIR / "tiny"


@pytest.fixture(autouse=True)
def _own_data_cache(tmp_path, monkeypatch):
    """Each test its own $MTP_TRAIN_DATA: no test reuses another's regenerated replies, none writes to ~/.cache."""
    monkeypatch.setenv("MTP_TRAIN_DATA", str(tmp_path / "data-cache"))


@pytest.fixture(scope="session")
def tiny_dir():
    if not (TINY / "target" / "model.safetensors").is_file():
        pytest.fail(f"the embedded tiny target is missing under {TINY}: run `make assets`")
    return TINY


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tiny_dir):
    """A small trained run on the tiny target, made without the slow stages: stdlib function-writing
    conversations (head-train files to train on, validation files to validate), the target's hidden
    states written as a store, `run_dir/data/val` as prepare writes it, and a head trained 24 steps with
    the real trainer (d1 accuracy ~0.4). Returns the run directory (`tiny_run_config` composes its config)."""
    import datasets

    from mtp_train.data.chat import tokenize_conversation
    from mtp_train.data.stdlib import function_conversations, list_files
    from mtp_train.model.target import TargetConfig, load_causal_lm, load_tokenizer
    from mtp_train.store.format import identity_for, write_split
    from mtp_train.train.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("trained_run")
    target = tiny_dir / "target"
    tokenizer = load_tokenizer(target)
    model = load_causal_lm(target, TargetConfig(path=str(target), dtype="float32", device="cpu"))

    def samples(split: str, n: int) -> list[dict]:
        out = []
        for f in list_files(split):
            for conv in function_conversations(f.read(), max_chars=400):
                t = tokenize_conversation(tokenizer, conv)
                if len(t.input_ids) <= 128 and sum(t.loss_mask) >= 8:
                    out.append(t)
                if len(out) == n:
                    break
            if len(out) == n:
                break
        ids = torch.zeros(len(out), max(len(t.input_ids) for t in out), dtype=torch.long)
        for i, t in enumerate(out):
            ids[i, :len(t.input_ids)] = torch.tensor(t.input_ids)
        with torch.inference_mode():  # right padding, causal attention: no token sees the padding after it
            hidden = model.model(ids).last_hidden_state
        return [{"hidden": hidden[i, :len(t.input_ids)].clone(), "input_ids": ids[i, :len(t.input_ids)].clone(),
                 "loss_mask": torch.tensor(t.loss_mask, dtype=torch.int8)} for i, t in enumerate(out)]

    train, val = samples("head-train", 96), samples("validation", 16)
    identity = identity_for(target)
    write_split(run_dir / "store" / "train", train, identity=identity)
    write_split(run_dir / "store" / "val", val, identity=identity)
    for name, split in (("train", train), ("val", val)):  # as prepare writes them (validation checks against train)
        datasets.Dataset.from_dict({"input_ids": [s["input_ids"].tolist() for s in split],
                                    "loss_mask": [s["loss_mask"].tolist() for s in split]}).save_to_disk(run_dir / "data" / name)
    Trainer(run_config(run_dir)).fit()
    return run_dir


@pytest.fixture(scope="session")
def tiny_run_config():
    """`run_config(run_dir, *overrides)`: the config `trained_run` was made with, plus overrides."""
    return run_config


RUN_OVERRIDES = ("target.device=cpu", "train.steps=24", "train.micro_batch=8", "train.lr=3e-3",
                 "train.warmup_steps=2", "train.eval_every=0", "train.save_every=0", "train.log_every=4",
                 "validate.num_prompts=2", "validate.max_new_tokens=10", "validate.max_k=2",
                 "validate.trees=[{steps:2,topk:2,num_draft_tokens:3}]")


def run_config(run_dir, *overrides):
    """The tiny recipe for `trained_run`'s directory, with small training and validation settings."""
    from mtp_train.config import compose

    return compose("tiny", [f"run_dir={run_dir}", *RUN_OVERRIDES, *overrides])


@pytest.fixture(scope="session")
def validated_run(trained_run):
    """`trained_run` after `mtp-train validate` (2 prompts, 10 new tokens, k = 1, 2 and a tree 2/2/3, greedy
    and T = 1, head and draft LM). Returns (run_dir, what the command printed)."""
    import contextlib
    import io

    from mtp_train.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["validate", "recipe=tiny", f"run_dir={trained_run}", *RUN_OVERRIDES])
    assert code == 0, out.getvalue()
    return trained_run, out.getvalue()
