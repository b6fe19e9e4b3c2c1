"""Self-distillation: replace each assistant turn with the target's own reply to the same prompt.

The replies come from this package's own inference engine (`mtp_train.inference`: the target behind its
per-row KV cache, the loop that decodes and serves validation), so what the head is trained on is what the
engine produces when it decodes alone. Turns are regenerated in rounds: round k rewrites the k-th
assistant turn of every conversation, so a later turn's prompt already holds the target's earlier replies
(as it would when the target serves the conversation). Prompts (system and user turns) are kept. Within a
round the prompts are sorted by length and decoded `regen_batch_size` at a time (left-padded; a finished
row leaves the batch); greedy at temperature 0, otherwise sampled with the run's seed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from mtp_train.data.sources import Record

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def decode_batches(runner, prompts: list[list[int]], *, batch_size: int, max_new_tokens: int,
                   temperature: float, stop: set[int], generator: torch.Generator | None = None,
                   progress=None) -> list[list[int]]:
    """The target's reply to every prompt (stop token removed), decoded `batch_size` prompts at a time in
    order of length (similar lengths pad little), returned in the prompts' order."""
    from mtp_train.inference import SamplingConfig, generate

    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    sampling = SamplingConfig(temperature=temperature)
    replies: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        out = generate(runner, [prompts[i] for i in chunk], sampling=sampling, max_new_tokens=max_new_tokens,
                       stop_tokens=stop, generator=generator)
        for i, tokens in zip(chunk, out.tokens):
            replies[i] = tokens[:-1] if tokens and tokens[-1] in stop else tokens
        if progress is not None:
            progress(len(chunk))
    return replies


def regenerate(cfg: "RunConfig", tokenizer, samples: list[tuple[Record, str]]) -> tuple[list[tuple[Record, str]], dict]:
    from mtp_train.inference.load import stop_tokens
    from mtp_train.inference import load_runner

    data = cfg.data
    runner = load_runner(cfg.target.path, cfg.target)
    stop = stop_tokens(tokenizer, runner)
    if not stop:
        raise ValueError(f"the target at {cfg.target.path} names no end-of-sequence token (tokenizer eos_token, "
                         "generation_config.json eos_token_id): regenerated replies would never end")
    generator = torch.Generator(runner.device).manual_seed(cfg.seed)
    convs = {i: [dict(m) for m in r.messages] for i, (r, _) in enumerate(samples) if r.kind == "chat"}
    turns = {i: [t for t, m in enumerate(msgs) if m["role"] == "assistant"] for i, msgs in convs.items()}
    t0, n_turns, n_tokens = time.perf_counter(), 0, 0
    rounds = max((len(t) for t in turns.values()), default=0)
    with tqdm(total=sum(map(len, turns.values())), desc="regenerate", unit=" turns", leave=False) as bar:
        for k in range(rounds):
            todo = [(i, ts[k]) for i, ts in turns.items() if len(ts) > k]
            prompts = [list(tokenizer.apply_chat_template(convs[i][:t], add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)) for i, t in todo]
            replies = decode_batches(runner, prompts, batch_size=data.regen_batch_size,
                                     max_new_tokens=data.regen_max_new_tokens, temperature=data.regen_temperature,
                                     stop=stop, generator=generator, progress=bar.update)
            for (i, t), reply in zip(todo, replies):
                convs[i][t]["content"] = tokenizer.decode(reply, skip_special_tokens=True)
                n_tokens += len(reply)
            n_turns += len(todo)
    seconds = time.perf_counter() - t0
    out = [(Record(r.kind, r.where, messages=convs[i]) if i in convs else r, split)
           for i, (r, split) in enumerate(samples)]
    report = {"conversations": len(convs), "turns": n_turns, "generated_tokens": n_tokens,
              "seconds": round(seconds, 3), "samples_per_s": round(len(convs) / seconds, 2) if seconds else None,
              "tokens_per_s": round(n_tokens / seconds, 1) if seconds else None,
              "temperature": data.regen_temperature, "max_new_tokens": data.regen_max_new_tokens,
              "engine": "mtp_train.inference"}
    print(f"regenerate: {len(convs)} conversations, {n_turns} turns, {n_tokens} tokens in {seconds:.1f}s "
          f"({report['tokens_per_s']} tokens/s, our inference engine, batches of {data.regen_batch_size})")
    return out, report
