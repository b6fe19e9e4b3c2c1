"""Self-distillation: replace each assistant turn with the target's own reply to the same prompt.

Turns are regenerated in rounds: round k rewrites the k-th assistant turn of every conversation, so a
later turn's prompt already holds the target's earlier replies (as it would when the target serves the
conversation). Prompts (system and user turns) are kept. Batched, left-padded `generate`; greedy at
temperature 0, otherwise sampled with the run's seed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from mtp_train.data.sources import Record
from mtp_train.model.target import load_causal_lm

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def _stop_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def _generate(model, tokenizer, prompts: list[list[int]], cfg, stop: set[int]) -> list[list[int]]:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stop))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    sample = cfg.regen_temperature > 0
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=cfg.regen_max_new_tokens, do_sample=sample,
                         temperature=cfg.regen_temperature if sample else None, top_k=None, top_p=None,
                         pad_token_id=pad, eos_token_id=sorted(stop))
    replies = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), len(row))
        replies.append(row[:cut])
    return replies


def regenerate(cfg: "RunConfig", tokenizer, samples: list[tuple[Record, str]]) -> tuple[list[tuple[Record, str]], dict]:
    data = cfg.data
    model = load_causal_lm(cfg.target.path, cfg.target)
    stop = _stop_ids(model, tokenizer)
    torch.manual_seed(cfg.seed)
    convs = {i: [dict(m) for m in r.messages] for i, (r, _) in enumerate(samples) if r.kind == "chat"}
    turns = {i: [t for t, m in enumerate(msgs) if m["role"] == "assistant"] for i, msgs in convs.items()}
    t0, n_turns, n_tokens = time.perf_counter(), 0, 0
    rounds = max((len(t) for t in turns.values()), default=0)
    with tqdm(total=sum(map(len, turns.values())), desc="regenerate", unit=" turns", leave=False) as bar:
        for k in range(rounds):
            todo = [(i, ts[k]) for i, ts in turns.items() if len(ts) > k]
            for start in range(0, len(todo), data.regen_batch_size):
                batch = todo[start : start + data.regen_batch_size]
                prompts = [list(tokenizer.apply_chat_template(convs[i][:t], add_generation_prompt=True,
                                                              tokenize=True, return_dict=False)) for i, t in batch]
                for (i, t), reply in zip(batch, _generate(model, tokenizer, prompts, data, stop)):
                    convs[i][t]["content"] = tokenizer.decode(reply, skip_special_tokens=True)
                    n_tokens += len(reply)
                n_turns += len(batch)
                bar.update(len(batch))
    seconds = time.perf_counter() - t0
    out = [(Record(r.kind, r.where, messages=convs[i]) if i in convs else r, split)
           for i, (r, split) in enumerate(samples)]
    report = {"conversations": len(convs), "turns": n_turns, "generated_tokens": n_tokens,
              "seconds": round(seconds, 3), "samples_per_s": round(len(convs) / seconds, 2) if seconds else None,
              "tokens_per_s": round(n_tokens / seconds, 1) if seconds else None,
              "temperature": data.regen_temperature, "max_new_tokens": data.regen_max_new_tokens}
    print(f"regenerate: {len(convs)} conversations, {n_turns} turns, {n_tokens} tokens in {seconds:.1f}s "
          f"({report['samples_per_s']} samples/s)")
    return out, report
