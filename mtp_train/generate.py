"""`mtp-train generate`: decode a prompt with the target, speculatively with the trained head or the draft LM.

    mtp-train generate recipe=tiny run_dir=runs/demo prompt='Write `def add(a, b)`.' speculative=head k=4

The head comes from `run_dir/checkpoints/latest` and is checked against the run's target (a head trained
for another target is refused). It also holds the loaders `validate` uses, so both stages build the
drafters the same way: the head shares the loaded target's embedding and lm_head (no second copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtp_train.inference import (CausalLMRunner, Drafter, HeadDrafter, LMDrafter, SamplingConfig, generate,
                                 load_runner)

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

SPECULATIVE = ("head", "draft", "none")


@dataclass
class GenerateConfig:
    prompt: str = "Write `def is_palindrome(text)`.\n\nReturn True if text reads the same backwards."
    speculative: str = "head"  # head (run_dir/checkpoints/latest) | draft (target.draft_path) | none
    k: int = 4  # drafted tokens per target forward
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 128
    chat: bool = True  # wrap the prompt in the tokenizer's chat template when it has one

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"generate.speculative={self.speculative!r}: expected one of {', '.join(SPECULATIVE)}")
        if self.k < 1:
            raise ValueError(f"generate.k={self.k}: must be >= 1 (the drafted tokens per target forward); "
                             "speculative=none decodes without drafting")
        if self.max_new_tokens < 1:
            raise ValueError(f"generate.max_new_tokens={self.max_new_tokens}: must be >= 1")
        try:
            self.sampling
        except ValueError as e:
            raise ValueError(f"generate.{e}") from None

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer(text)["input_ids"])


def stop_tokens(tokenizer, runner: CausalLMRunner) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (chat models list end-of-turn too)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(getattr(runner.model, "generation_config", None), "eos_token_id", None)
    ids |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return {int(i) for i in ids}


def checkpoint_path(run_dir: str | Path) -> Path:
    """run_dir/checkpoints/latest, or an error that says to train first."""
    from mtp_train.train.checkpoint import checkpoint_root, latest

    root = checkpoint_root(run_dir)
    path = latest(root)
    if path is None:
        raise FileNotFoundError(f"no trained head in {root} (no `latest` checkpoint): run mtp-train train first, "
                                f"with the same recipe and run_dir={run_dir}")
    return path


def read_head(cfg: "RunConfig", path: Path | None = None):
    """The head of a checkpoint directory (default `run_dir/checkpoints/latest`) as a `DraftHead` in fp32 on
    the CPU, and its head.json with `checkpoint` set. Refuses a checkpoint trained for another target."""
    from transformers import AutoConfig

    from mtp_train.model.head import DraftHead, HeadConfig
    from mtp_train.model.target import target_fingerprint
    from mtp_train.train.checkpoint import load_head_state, load_meta

    path = checkpoint_path(cfg.run_dir) if path is None else Path(path)
    if not (path / "head.safetensors").is_file() or not (path / "head.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no head.safetensors and head.json); name a "
                                f"step-* directory of {Path(cfg.run_dir) / 'checkpoints'}")
    meta = load_meta(path)
    if meta.get("target_fingerprint") != target_fingerprint(cfg.target.path):
        raise ValueError(f"checkpoint {path} was trained for target {meta.get('target_path')}, not for this run's "
                         f"target {cfg.target.path} (their config / weight fingerprints differ)")
    head = DraftHead(AutoConfig.from_pretrained(cfg.target.path), HeadConfig(**meta["head"]))
    head.load_state_dict(load_head_state(path))
    meta["checkpoint"] = str(path)
    return head.eval().requires_grad_(False), meta


def load_head_module(cfg: "RunConfig", device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """The `DraftHead` of `run_dir/checkpoints/latest` (eval mode, frozen) and its head.json. Refuses a
    checkpoint trained for another target."""
    head, meta = read_head(cfg)
    return head.to(device=device, dtype=dtype), meta


def load_head(cfg: "RunConfig", target: CausalLMRunner) -> tuple[HeadDrafter, dict]:
    """The head of `run_dir/checkpoints/latest` as a drafter on the target's device and dtype, and its
    head.json. The head shares the loaded target's embedding and lm_head."""
    head, meta = load_head_module(cfg, target.device, target.dtype)
    return HeadDrafter(head, target.model.get_input_embeddings(), target.lm_head), meta


def check_drafter(cfg: "RunConfig", kind: str) -> None:
    """Fail before loading any weights when the drafter `kind` cannot be built for this run."""
    if kind == "head":
        checkpoint_path(cfg.run_dir)
    elif kind == "draft" and not cfg.target.draft_path:
        raise ValueError("speculative=draft needs a draft LM: set target.draft_path=/path/to/small-causal-lm "
                         "(with the target's tokenizer), or use speculative=head")
    elif kind not in SPECULATIVE:
        raise ValueError(f"unknown drafter {kind!r}: expected one of {', '.join(SPECULATIVE)}")


def load_draft(cfg: "RunConfig", target: CausalLMRunner, tokenizer=None) -> LMDrafter:
    """The draft LM of `target.draft_path`, its tokenizer checked against the target's (`tokenizer`, when
    the caller has it loaded)."""
    from mtp_train.model.target import check_draft_tokenizer

    check_drafter(cfg, "draft")
    check_draft_tokenizer(cfg.target.path, cfg.target.draft_path, tokenizer)
    return LMDrafter(load_runner(cfg.target.draft_path, cfg.target, "draft"), target.vocab_size)


def load_drafter(cfg: "RunConfig", kind: str, target: CausalLMRunner, tokenizer=None) -> Drafter | None:
    if kind == "head":
        return load_head(cfg, target)[0]
    if kind == "draft":
        return load_draft(cfg, target, tokenizer)
    return None


def run(cfg: "RunConfig") -> dict:
    from mtp_train.model.target import load_tokenizer

    g = cfg.generate
    check_drafter(cfg, g.speculative)  # before loading any weights
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_runner(cfg.target.path, cfg.target)
    drafter = load_drafter(cfg, g.speculative, target, tokenizer)
    prompt = encode_prompt(tokenizer, g.prompt, g.chat)
    generator = torch.Generator(target.device).manual_seed(cfg.seed)
    out = generate(target, [prompt], drafter=drafter, k=g.k, sampling=g.sampling, max_new_tokens=g.max_new_tokens,
                   stop_tokens=stop_tokens(tokenizer, target), generator=generator)
    s = out.stats
    text = tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    print(text)
    how = "target only" if drafter is None else f"{g.speculative}, k={g.k}"
    accept = " ".join(f"{a:.2f}" for a in s.acceptance_by_position)
    print(f"\n[{s.new_tokens} tokens, {how}: tau {s.tau:.2f} tokens per target forward"
          f"{f', acceptance by position {accept}' if accept else ''}; {s.tokens_per_s:.1f} tokens/s]")
    return {"text": text, "tokens": out.tokens[0], "tau": s.tau, "acceptance_by_position": s.acceptance_by_position,
            "tokens_per_s": s.tokens_per_s, "new_tokens": s.new_tokens}
