"""The GPU recipes against their targets' real architectures: `config.json` of each target, written by hand
from the public model configs (tests/fixtures/configs/), builds the recipe's head on the meta device with
the parameter count the architecture implies, and the recipe's memory estimate fits an 80 GB H100 with
room to spare. Nothing is downloaded and no weights exist."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mtp_train.config import RECIPES_DIR, compose
from mtp_train.model.target import TargetArch
from mtp_train.train.distributed import resolve_strategy
from mtp_train.train.memory import GIB, H100_80GB, estimate_memory, load_target_config, meta_head

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "configs"
GPU_RECIPES = ["llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "deepseek-v2-lite"]
NODE = 8  # one node of 8 x H100 80 GB


def expected_parameters(c: dict) -> int:
    """The head's parameters from the architecture, counted by hand: eh_proj (2H x H), one decoder layer,
    five RMSNorms (enorm, hnorm, the layer's two, post_norm)."""
    H, I, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    if c["model_type"] == "deepseek_v2":  # MLA without a query low-rank (V2-Lite): q, compressed kv, expansion
        nope, rope, v, rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        attention = H * heads * (nope + rope) + H * (rank + rope) + rank + rank * heads * (nope + v) + heads * v * H
    else:
        d = c.get("head_dim") or H // heads
        attention = 2 * H * heads * d + 2 * H * c["num_key_value_heads"] * d
    return 2 * H * H + attention + 3 * H * I + 5 * H


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_head_and_memory_on_8_h100(name, capsys):
    fixture = FIXTURES / name
    cfg = compose(name, [f"target.path={fixture}", "run_dir=runs/x"])
    config = load_target_config(cfg.target.path)
    arch = TargetArch.from_pretrained(fixture)
    head = meta_head(config, cfg.head)
    assert all(p.device.type == "meta" for p in head.parameters())
    n = sum(p.numel() for p in head.parameters())
    assert n == expected_parameters(config.to_dict() | arch.as_dict())
    strategy = resolve_strategy(cfg.train.strategy, NODE, torch.device("cuda"))
    assert strategy == "deepspeed" and cfg.train.precision == "bf16" and cfg.target.dtype == "bfloat16"
    est = estimate_memory(config, cfg.train, cfg.data.max_length, NODE, strategy, cfg.head)
    with capsys.disabled():
        print(f"\n{name}: " + est.format(H100_80GB, f"ZeRO-{cfg.train.zero_stage} x {NODE}"))
    assert est.trainable_params == n
    assert est.total < 0.85 * H100_80GB, f"{name}: {est.total / GIB:.1f} GiB leaves too little headroom"
    assert est.activations > est.weights  # the micro-batch, not the head, is what fills these GPUs
    text = (RECIPES_DIR / f"{name}.yaml").read_text().splitlines()
    assert text[1].startswith(f"# Train on one 8xH100 node: launch/train_single_node.sh recipe={name} ")
    assert cfg.train.wandb_project


def test_the_70b_head_is_about_a_billion_parameters():
    config = load_target_config(FIXTURES / "llama3.1-70b")
    n = sum(p.numel() for p in meta_head(config).parameters())
    assert 0.98e9 < n < 1.0e9  # 989,896,704: eh_proj 134 M, attention 151 M, MLP 705 M
    frozen = 2 * config.vocab_size * config.hidden_size * 2  # E and W in bf16
    assert 4.1e9 < frozen < 4.3e9


def test_fixtures_carry_the_architecture_fields():
    for name in GPU_RECIPES:
        arch = TargetArch.from_pretrained(FIXTURES / name)
        assert arch.vocab_size in (128256, 102400) and arch.rope_parameters
    ds = TargetArch.from_pretrained(FIXTURES / "deepseek-v2-lite")
    assert ds.mla == {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                      "q_lora_rank": 0}


def test_zero3_and_checkpointing_lower_the_70b_estimate():
    config = load_target_config(FIXTURES / "llama3.1-70b")
    base = compose("llama3.1-70b", [f"target.path={FIXTURES / 'llama3.1-70b'}", "run_dir=runs/x"])
    tc = base.train
    est = {(stage, ac): estimate_memory(config, dataclasses.replace(tc, zero_stage=stage, activation_checkpointing=ac),
                                        base.data.max_length, NODE, "deepspeed")
           for stage in (1, 2, 3) for ac in (False, True)}
    assert est[(1, False)].gradients > est[(2, False)].gradients == est[(3, False)].gradients
    assert est[(3, False)].weights < est[(2, False)].weights
    assert est[(2, True)].activations < est[(2, False)].activations
