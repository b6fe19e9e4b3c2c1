"""`mtp-train generate`: decode a prompt with the target, speculatively with the trained head or the draft LM.

    mtp-train generate recipe=tiny run_dir=runs/demo prompt='Write `def add(a, b)`.' speculative=head k=4
    mtp-train generate recipe=tiny run_dir=runs/demo tree=[5,4,8]      # a draft tree: steps, topk, num_draft_tokens

The head comes from `run_dir/checkpoints/latest` and is checked against the run's target (a head trained
for another target is refused); `mtp_train.inference.load` builds the drafter, as for `validate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mtp_train.inference.config import tree_label
from mtp_train.inference.load import check_drafter, encode_prompt, load_drafter, stop_tokens
from mtp_train.inference.runner import load_runner
from mtp_train.inference.speculative import generate
from mtp_train.model.target import load_tokenizer

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def run(cfg: "RunConfig") -> dict:
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
