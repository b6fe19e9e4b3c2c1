"""Self-distillation: replace each assistant turn with the target's own reply to the same prompt.

The replies come from this package's own inference engine (`mtp_train.inference`: the target behind its
per-row KV cache, the loop that decodes and serves validation), so what the head is trained on is what the
engine produces when it decodes alone. Turns are regenerated in rounds: round k rewrites the k-th
assistant turn of every conversation, so a later turn's prompt already holds the target's earlier replies
(as it would when the target serves the conversation). Prompts (system and user turns) are kept. Within a
round the prompts are sorted by length and decoded `regen_batch_size` at a time (left-padded; a finished
row leaves the batch); greedy at temperature 0, otherwise sampled with the run's seed.

With `data.regenerate_server` (an OpenAI-compatible endpoint: vLLM, SGLang, serving the run's target) the
replies come from that server instead, `data.regen_concurrency` requests in flight, the prompt sent as token
ids (the chat template applied here, as for our engine) to `POST /completions`; each request is retried
`data.regen_retries` times with exponential backoff and times out after `data.regen_timeout` seconds. An
unreachable server, or a request that still fails, stops prepare before anything is written, naming the server
and the conversation. Which weights the server holds is not checked beyond its model name (in the manifest).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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


class ServerError(ValueError):
    """The regeneration server cannot be reached or keeps failing; the message names it and what failed."""


class Server:
    """A client of an OpenAI-compatible completions API (the standard library's urllib: no extra package)."""

    def __init__(self, url: str, model: str, timeout: float, retries: int, backoff: float = 1.0):
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
            return json.loads(r.read())

    def _first_model(self) -> str:
        try:
            models = self._request("/models", timeout=min(self.timeout, 10.0))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ServerError(f"data.regenerate_server={self.url}: cannot reach it ({e}); start the server (e.g. "
                              f"`vllm serve TARGET --port 8000`), or leave data.regenerate_server unset to "
                              "regenerate with our engine. Nothing was written") from None
        names = [m.get("id") for m in models.get("data", []) if m.get("id")]
        if not names:
            raise ServerError(f"data.regenerate_server={self.url}: GET /models lists no model; set data.regen_model")
        return names[0]

    def complete(self, prompt: list[int], max_tokens: int, temperature: float, seed: int, where: str) -> tuple[str, int]:
        """(the reply's text, its token count) for one prompt of token ids, retried with backoff."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "skip_special_tokens": True}
        last = None
        for attempt in range(self.retries + 1):
            try:
                out = self._request("/completions", body)
                choice = out["choices"][0]
                tokens = (out.get("usage") or {}).get("completion_tokens")
                return choice["text"], int(tokens) if tokens is not None else -1
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                last = f"HTTP {e.code}: {detail}"
                if 400 <= e.code < 500 and e.code not in (408, 429):  # the request itself is wrong: no retry
                    break
            except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as e:
                last = repr(e)
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        raise ServerError(f"data.regenerate_server={self.url}: the reply for {where} failed after "
                          f"{self.retries + 1} attempts ({last}). Nothing was written")


def regenerate(cfg: "RunConfig", tokenizer, samples: list[tuple[Record, str]]) -> tuple[list[tuple[Record, str]], dict]:
    data = cfg.data
    convs = {i: [dict(m) for m in r.messages] for i, (r, _) in enumerate(samples) if r.kind == "chat"}
    turns = {i: [t for t, m in enumerate(msgs) if m["role"] == "assistant"] for i, msgs in convs.items()}
    if data.regenerate_server:
        server = Server(data.regenerate_server, data.regen_model, data.regen_timeout, data.regen_retries)
        engine = f"server {server.url} (model {server.model})"

        def reply_all(todo, prompts, bar):
            def one(args):
                (i, t), prompt = args
                text, n = server.complete(prompt, data.regen_max_new_tokens, data.regen_temperature, cfg.seed + i,
                                          f"{samples[i][0].where}, assistant turn {t}")
                bar.update(1)
                return text, (n if n >= 0 else len(tokenizer.encode(text, add_special_tokens=False)))

            pool = ThreadPoolExecutor(data.regen_concurrency)
            try:
                return list(pool.map(one, zip(todo, prompts)))
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # one failed for good: stop sending the rest
                raise
            finally:
                pool.shutdown()
    else:
        engine, reply_all = "mtp_train.inference", _local(cfg, tokenizer)
    return _rounds(cfg, tokenizer, samples, convs, turns, reply_all, engine)


def _local(cfg: "RunConfig", tokenizer):
    """Our engine: (todo, prompts, bar) -> [(text, tokens)], decoded in batches."""
    from mtp_train.inference import load_runner
    from mtp_train.inference.load import stop_tokens

    data = cfg.data
    runner = load_runner(cfg.target.path, cfg.target)
    stop = stop_tokens(tokenizer, runner)
    if not stop:
        raise ValueError(f"the target at {cfg.target.path} names no end-of-sequence token (tokenizer eos_token, "
                         "generation_config.json eos_token_id): regenerated replies would never end")
    generator = torch.Generator(runner.device).manual_seed(cfg.seed)

    def reply_all(todo, prompts, bar):
        replies = decode_batches(runner, prompts, batch_size=data.regen_batch_size,
                                 max_new_tokens=data.regen_max_new_tokens, temperature=data.regen_temperature,
                                 stop=stop, generator=generator, progress=bar.update)
        return [(tokenizer.decode(r, skip_special_tokens=True), len(r)) for r in replies]

    return reply_all


def _rounds(cfg, tokenizer, samples, convs, turns, reply_all, engine: str):
    """Round k rewrites the k-th assistant turn of every conversation, the replies from `reply_all`."""
    data = cfg.data
    t0, n_turns, n_tokens = time.perf_counter(), 0, 0
    rounds = max((len(t) for t in turns.values()), default=0)
    with tqdm(total=sum(map(len, turns.values())), desc="regenerate", unit=" turns", leave=False) as bar:
        for k in range(rounds):
            todo = [(i, ts[k]) for i, ts in turns.items() if len(ts) > k]
            prompts = [list(tokenizer.apply_chat_template(convs[i][:t], add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)) for i, t in todo]
            for (i, t), (text, n) in zip(todo, reply_all(todo, prompts, bar)):
                convs[i][t]["content"] = text
                n_tokens += n
            n_turns += len(todo)
    seconds = time.perf_counter() - t0
    out = [(Record(r.kind, r.where, messages=convs[i]) if i in convs else r, split)
           for i, (r, split) in enumerate(samples)]
    report = {"conversations": len(convs), "turns": n_turns, "generated_tokens": n_tokens,
              "seconds": round(seconds, 3), "samples_per_s": round(len(convs) / seconds, 2) if seconds else None,
              "tokens_per_s": round(n_tokens / seconds, 1) if seconds else None,
              "temperature": data.regen_temperature, "max_new_tokens": data.regen_max_new_tokens,
              "engine": engine}
    how = (f"our inference engine, batches of {data.regen_batch_size}" if engine == "mtp_train.inference"
           else f"{engine}, {data.regen_concurrency} requests in flight")
    print(f"regenerate: {len(convs)} conversations, {n_turns} turns, {n_tokens} tokens in {seconds:.1f}s "
          f"({report['tokens_per_s']} tokens/s, {how})")
    return out, report
