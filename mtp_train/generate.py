"""`mtp-train generate`: decode a prompt with the target, speculatively with the trained head or the draft LM.

    mtp-train generate recipe=tiny run_dir=runs/demo prompt='Write `def add(a, b)`.' speculative=head k=4
    mtp-train generate recipe=tiny run_dir=runs/demo tree=[5,4,8]      # a draft tree: steps, topk, num_draft_tokens

The head comes from `run_dir/checkpoints/latest` and is checked against the run's target (a head trained
for another target is refused); `mtp_train.inference.load` builds the drafter, as for `validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mtp_train.inference import SamplingConfig, TreeConfig, generate, load_runner
from mtp_train.inference.tree import tree_label
from mtp_train.inference.load import SPECULATIVE, check_drafter, encode_prompt, load_drafter, stop_tokens

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


@dataclass
class GenerateConfig:
    prompt: str = "Write `def is_palindrome(text)`.\n\nReturn True if text reads the same backwards."
    speculative: str = "head"  # head (run_dir/checkpoints/latest) | draft (target.draft_path) | none
    k: int = 4  # drafted tokens per target forward
    # a draft tree per step instead of the chain of k: [steps, topk, num_draft_tokens] as SGLang names them; [] = chain
    tree: list[int] = field(default_factory=list)
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
        if self.tree and len(self.tree) != 3:
            raise ValueError(f"generate.tree={list(self.tree)}: expected [steps, topk, num_draft_tokens] (or [] for a "
                             "chain of k drafts)")
        try:
            self.tree_config
        except ValueError as e:
            raise ValueError(f"generate.{e}") from None
        try:
            self.sampling
        except ValueError as e:
            raise ValueError(f"generate.{e}") from None

    @property
    def tree_config(self) -> TreeConfig | None:
        return TreeConfig(*map(int, self.tree)) if self.tree else None

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


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
                   stop_tokens=stop_tokens(tokenizer, target), generator=generator,
                   tree=g.tree_config if drafter is not None else None)
    s = out.stats
    text = tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    print(text)
    t = g.tree_config
    how = "target only" if drafter is None else (
        f"{g.speculative}, {tree_label(t)}" if t else f"{g.speculative}, k={g.k}")
    accept = " ".join(f"{a:.2f}" for a in s.acceptance_by_position)
    by = "depth" if t else "position"
    print(f"\n[{s.new_tokens} tokens, {how}: tau {s.tau:.2f} tokens per target forward"
          f"{f', acceptance by {by} {accept}' if accept else ''}; {s.tokens_per_s:.1f} tokens/s]")
    return {"text": text, "tokens": out.tokens[0], "tau": s.tau, "acceptance_by_position": s.acceptance_by_position,
            "tokens_per_s": s.tokens_per_s, "new_tokens": s.new_tokens}
