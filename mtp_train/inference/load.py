"""What decoding needs from a run, built the same way by `validate`, `generate` and the benchmarks: the trained
head (`run_dir/checkpoints/latest`) or the draft LM as a drafter over the loaded target, sharing its embedding
and lm_head (no second copy), the stop tokens, a prompt's ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mtp_train.inference.config import SPECULATIVE
from mtp_train.inference.drafters import Drafter, HeadDrafter, LMDrafter
from mtp_train.inference.runner import CausalLMRunner, load_runner
from mtp_train.model.checkpoint import read_head, trained_head
from mtp_train.model.target import check_draft_tokenizer

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer(text)["input_ids"])


def stop_tokens(tokenizer, runner: CausalLMRunner) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (chat models list end-of-turn too)."""
    return eos_ids(tokenizer, getattr(runner.model, "generation_config", None))


def eos_ids(tokenizer, generation_config) -> set[int]:
    """`stop_tokens` from a generation config (`GenerationConfig.from_pretrained`, None if there is none): what
    another engine is told to stop at, with no model loaded here."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(generation_config, "eos_token_id", None)
    ids |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return {int(i) for i in ids}


def load_head_module(cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """The `DraftHead` of `run_dir/checkpoints/latest` (eval mode, frozen) and its head.json. Refuses a
    checkpoint trained for another target."""
    head, meta = read_head(cfg)
    return head.to(device=device, dtype=dtype), meta


def load_head(cfg: RunConfig, target: CausalLMRunner) -> tuple[HeadDrafter, dict]:
    """The head of `run_dir/checkpoints/latest` as a drafter on the target's device and dtype, and its
    head.json. The head shares the loaded target's embedding and lm_head."""
    head, meta = load_head_module(cfg, target.device, target.dtype)
    return HeadDrafter(head, target.model.get_input_embeddings(), target.lm_head), meta


def check_drafter(cfg: RunConfig, kind: str) -> None:
    """Fail before loading any weights when the drafter `kind` cannot be built for this run."""
    if kind == "head":
        trained_head(cfg.run_dir)
    elif kind == "draft" and not cfg.target.draft_path:
        raise ValueError("speculative=draft needs a draft LM: set target.draft_path=/path/to/small-causal-lm "
                         "(with the target's tokenizer), or use speculative=head")
    elif kind not in SPECULATIVE:
        raise ValueError(f"unknown drafter {kind!r}: expected one of {', '.join(SPECULATIVE)}")


def load_draft(cfg: RunConfig, target: CausalLMRunner, tokenizer=None) -> LMDrafter:
    """The draft LM of `target.draft_path`, its tokenizer checked against the target's (`tokenizer`, when
    the caller has it loaded)."""
    check_drafter(cfg, "draft")
    check_draft_tokenizer(cfg.target.path, cfg.target.draft_path, tokenizer)
    return LMDrafter(load_runner(cfg.target.draft_path, cfg.target, "draft"), target.vocab_size)


def load_drafter(cfg: RunConfig, kind: str, target: CausalLMRunner, tokenizer=None) -> Drafter | None:
    if kind == "head":
        return load_head(cfg, target)[0]
    if kind == "draft":
        return load_draft(cfg, target, tokenizer)
    return None
