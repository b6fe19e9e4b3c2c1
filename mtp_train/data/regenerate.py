"""Self-distillation: replace each assistant turn with the target's own reply to the same prompt.

The replies come from this package's own inference engine (`mtp_train.inference`: the target behind its
per-row KV cache, the loop that decodes and serves validation), so what the head is trained on is what the
engine produces when it decodes alone. Turns are regenerated in rounds: round k rewrites the k-th
assistant turn of every conversation, so a later turn's prompt already holds the target's earlier replies
(as it would when the target serves the conversation). Prompts (system and user turns) are kept. Within a
round the prompts are sorted by length and decoded `regen_batch_size` at a time (left-padded; a finished
row leaves the batch); greedy at temperature 0, otherwise sampled, each batch with its own seed (below).

With `data.regen_engine=vllm` (or `auto` where vLLM is found: `regen_engines.py` says which engine and dtype, and
why) the replies come from vLLM run offline in its own venv (`inference/vllm_worker.py`, `data.regen_batch_size` its
max_num_seqs): a round's prompts, longest first, go to it in chunks of `data.regen_chunk`, sampled ones with a seed
per conversation, and each chunk's replies are committed as it comes back. A prompt longer than `data.max_length`
gets an empty reply without being sent (the dataset keeps no token of a reply that starts past max_length). vLLM's
replies may differ from run to run (its batches decide the floats): the manifest's `token_ids_sha256` tells two
builds apart.

With `data.regenerate_server` (an OpenAI-compatible endpoint: vLLM, SGLang, serving the run's target) the
replies come from that server instead, `data.regen_concurrency` requests in flight, the prompt sent as token
ids (the chat template applied here, as for our engine) to `POST /completions`; each request is retried
`data.regen_retries` times with exponential backoff and times out after `data.regen_timeout` seconds. An
unreachable server stops prepare before anything is written, a request that still fails stops it with the
replies finished before kept; both messages name the server and the conversation. Which weights the server
holds is not checked beyond its model name (in the manifest and the journal).

**The journal.** Replies are committed to `run_dir/data/regenerate.jsonl` as they finish: a batch of our
engine, a chunk of vLLM's, or the server's requests that finished together, one JSON line each (written in one
append, then flushed to disk), after a header line with the identity of the run: the conversations to regenerate
(their count and sha256, and the source files they came from), the target and the dtype the replies are decoded
in, the engine (vLLM: its version, dtype, max_num_seqs and chunk), the sampling settings and the seed; and,
beside it, the engine choice and its reason. A killed prepare (SIGKILL, a crash, a full disk) or a stopped one
(SIGTERM / SIGUSR1: the batch, the vLLM chunk or the requests in flight are finished and committed, then exit
75) goes on from the journal: committed replies are not generated again, a last line cut short by the kill is
dropped. What a reply is does not depend on where the run started: our engine's batches are the same (sorted by
length over the whole round, the finished ones skipped) and each batch draws from its own seed (the run's seed,
the round and the batch); a server request carries the run's seed plus the conversation's index, a vLLM one a
seed from the run's, the round and the conversation. So a resumed run of our engine writes the same dataset,
byte for byte, as an uninterrupted one. A journal made for other conversations, another target, dtype, engine or
sampling settings is refused, naming both sides (`data.overwrite=true` discards it). It stays in the finished
dataset's directory: preparing again with other settings that leave the replies as they are (`max_length`,
weights, `val_fraction`, with `data.overwrite=true`) reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from mtp_train.data.regen_engines import choose, commit_replies, stopped, vllm_rounds
from mtp_train.data.sources import Record
from mtp_train.files import data_cache_dir, space_for, write_atomic
from mtp_train.inference.config import SamplingConfig
from mtp_train.inference.load import stop_tokens
from mtp_train.inference.runner import load_runner
from mtp_train.inference.speculative import generate
from mtp_train.model.target import resolve_device, target_fingerprint, tokenizer_hash
from mtp_train.preempt import Preempted, StopRequests

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def batch_order(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """The prompts' indices in batches of `batch_size`, longest first (similar lengths pad little): the same
    batches whatever was finished before, so a resumed run decodes what an uninterrupted one does."""
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    return [order[a:a + batch_size] for a in range(0, len(order), batch_size)]


def batch_seed(seed: int, round_: int, batch: int) -> int:
    """The seed of one batch's sampling: the run's seed, the round and the batch's place in it."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{round_}:{batch}".encode()).digest()[:8], "little") >> 1


def decode_batches(runner, prompts: list[list[int]], batches: list[list[int]], *, max_new_tokens: int,
                   temperature: float, stop: set[int], seeds: list[int]):
    """Yield (batch, the target's replies to its prompts: stop token removed) for each of `batches` (indices
    into `prompts`), batch j sampled with its own generator seeded `seeds[j]`."""
    sampling = SamplingConfig(temperature=temperature)
    for chunk, seed in zip(batches, seeds):
        generator = torch.Generator(runner.device).manual_seed(seed)
        out = generate(runner, [prompts[i] for i in chunk], sampling=sampling, max_new_tokens=max_new_tokens,
                       stop_tokens=stop, generator=generator)
        yield chunk, [tokens[:-1] if tokens and tokens[-1] in stop else tokens for tokens in out.tokens]


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
                          f"{self.retries + 1} attempts ({last})")




JOURNAL = "regenerate.jsonl"  # in run_dir/data
JOURNAL_FORMAT = 1


class Journal:
    """`run_dir/data/regenerate.jsonl`: the header line {"journal": 1, "identity": {...}}, then one line per
    commit {"round": k, "replies": [[conversation, turn, text, tokens], ...]}. Created at the first commit (a
    run that fails before it leaves nothing); each commit is one append of whole lines, flushed to disk, so
    a kill leaves at most a last line cut short, which reading drops."""

    def __init__(self, path: Path, identity: dict, overwrite: bool, say=print, about: dict | None = None):
        self.path, self.identity, self.say, self.about = path, identity, say, about  # about: the engine choice
        self.replies: dict[tuple[int, int, int], tuple[str, int]] = {}  # (round, conversation, turn) -> reply
        self._fd: int | None = None
        if path.is_file():
            self._read(overwrite)

    def _read(self, overwrite: bool) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        try:
            header = json.loads(lines[0])
            theirs = header["identity"]
        except (ValueError, KeyError, TypeError):
            theirs = None
        differ = identity_differences(theirs, self.identity) if theirs is not None else ["its header is unreadable"]
        if differ:
            if overwrite:
                self.say(f"prepare: data.overwrite=true: discarding {self.path}, made for other inputs or settings "
                         f"({'; '.join(differ)})")
                self.path.unlink()
                return
            raise ValueError(f"{self.path} holds replies regenerated for other inputs or settings: "
                             f"{'; '.join(differ)}. Nothing was changed: prepare with the settings it was made with "
                             "to go on from it, or pass data.overwrite=true to discard it and regenerate from the start")
        good = len(lines[0]) + 1
        for n, line in enumerate(lines[1:], start=2):
            if good + len(line) >= len(raw):  # the last piece: no newline after it, a commit cut short
                if line:
                    self.say(f"prepare: {self.path}:{n}: dropping a last line cut short (the run was killed while "
                             "committing it); its replies are generated again")
                    os.truncate(self.path, good)
                break
            try:
                record = json.loads(line)
                for i, t, text, tokens in record["replies"]:
                    self.replies[(int(record["round"]), int(i), int(t))] = (str(text), int(tokens))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.path}:{n} is damaged ({e}): restore the file, or remove it (its replies "
                                 "are then generated again)") from None
            good += len(line) + 1

    def done(self, round_: int) -> dict[tuple[int, int], tuple[str, int]]:
        return {(i, t): r for (k, i, t), r in self.replies.items() if k == round_}

    def commit(self, round_: int, replies: list[tuple[int, int, str, int]]) -> None:
        line = (json.dumps({"round": round_, "replies": [list(r) for r in replies]}) + "\n").encode()
        kept = f"the {len(self.replies)} replies committed before are kept in {self.path}"
        with space_for(self.path, len(line), "the regeneration journal", kept):
            if self._fd is None:
                if not self.path.is_file():
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    header = {"journal": JOURNAL_FORMAT, "identity": self.identity}
                    write_atomic(self.path, json.dumps({**header, **({"engine_choice": self.about} if self.about
                                                                      else {})}) + "\n")
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            size = os.fstat(self._fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(self._fd, view):]
                os.fsync(self._fd)
            except BaseException:
                os.ftruncate(self._fd, size)  # never a part of a line left behind
                raise
        for i, t, text, tokens in replies:
            self.replies[(round_, i, t)] = (text, tokens)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def identity_differences(theirs: dict, mine: dict) -> list[str]:
    """What differs between a journal's identity and this run's, each named with both sides."""
    def describe(key: str, ident: dict) -> str:
        v = ident.get(key)
        if key == "conversations" and isinstance(v, dict):
            sources = ", ".join(s.get("path") or s.get("corpus") or "?" for s in ident.get("sources", []))
            return f"{v.get('count')} conversations (sha256 {str(v.get('sha256'))[:12]}) from {sources or '?'}"
        if key == "target" and isinstance(v, dict):
            return f"{v.get('path')} (fingerprint {str(v.get('fingerprint'))[:12]}, {v.get('dtype')})"
        return json.dumps(v, sort_keys=True)

    def same(key: str) -> bool:
        a, b = theirs.get(key), mine.get(key)
        if key == "conversations":
            return isinstance(a, dict) and a.get("sha256") == b["sha256"]
        if key == "target":  # the same weights, wherever they lie
            return isinstance(a, dict) and (a.get("fingerprint"), a.get("dtype")) == (b["fingerprint"], b["dtype"])
        return a == b

    return [f"{key}: {describe(key, theirs)} there, {describe(key, mine)} here"
            for key in ("conversations", "target", "engine", "sampling", "seed") if not same(key)]


def regenerate(cfg: "RunConfig", tokenizer, samples: list[tuple[Record, str]],
               sources: list | None = None) -> tuple[list[tuple[Record, str]], dict]:
    """Every chat sample with its assistant turns regenerated (text records as they are) and the report;
    resumes from, and commits to, the journal in run_dir/data (`sources`: the source files' digests, named
    in it)."""
    data = cfg.data
    convs = {i: [dict(m) for m in r.messages] for i, (r, _) in enumerate(samples) if r.kind == "chat"}
    turns = {i: [t for t, m in enumerate(msgs) if m["role"] == "assistant"] for i, msgs in convs.items()}
    digest = hashlib.sha256(json.dumps(sorted(convs.items()), sort_keys=True).encode()).hexdigest()
    sampling = {"temperature": data.regen_temperature, "max_new_tokens": data.regen_max_new_tokens}
    path = Path(cfg.run_dir) / "data" / JOURNAL
    recorded = _recorded(path)
    choice = choose(data, resolve_device(cfg.target.device).type, cfg.target.dtype, None if data.overwrite else
                    {"engine": _engine_of(recorded), "dtype": (recorded.get("target") or {}).get("dtype")})
    server = None
    if choice.engine == "server":  # the model: data.regen_model, else the journal's, else the server's first
        model = data.regen_model or (recorded.get("engine") if isinstance(recorded.get("engine"), dict)
                                     else {}).get("server_model", "")
        server = Server(data.regenerate_server, model, data.regen_timeout, data.regen_retries)
        engine, how = {"server_model": server.model}, f"server {server.url} (model {server.model})"
        described = f"{how}, {data.regen_concurrency} requests in flight"
    elif choice.engine == "vllm":
        engine = {"vllm": choice.vllm.get("vllm_version"), "dtype": choice.dtype,
                  "max_num_seqs": data.regen_batch_size, "chunk": data.regen_chunk}
        how = f"vLLM {engine['vllm']} offline ({choice.dtype})"
        described = f"{how}, max_num_seqs {data.regen_batch_size}, chunks of {data.regen_chunk}"
    else:
        engine, how = "mtp_train.inference", "mtp_train.inference"
        sampling["batch_size"] = data.regen_batch_size  # rows batched together pad each other: it decides the floats
        described = f"our inference engine ({choice.dtype}), batches of {data.regen_batch_size}"
    if choice.engine != "server":
        print(f"regenerate: {choice.engine} in {choice.dtype}: {choice.reason}")
    identity = {"conversations": {"count": len(convs), "sha256": digest}, "sources": _named(sources or []),
                "target": {"path": str(Path(cfg.target.path).resolve()),
                           "fingerprint": target_fingerprint(cfg.target.path), "dtype": choice.dtype},
                "engine": engine, "sampling": sampling, "seed": cfg.seed}
    cache = cached_journal(identity, cfg) if data.regen_cache else None
    if cache is not None and not path.exists() and cache.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(cache, path)
            print(f"regenerate: replies made before for these inputs, from {cache}")
        except OSError as e:  # e.g. no room for the copy: regenerate instead, as if there were no cache
            path.unlink(missing_ok=True)
            print(f"regenerate: the replies kept in {cache} could not be copied ({e}); regenerating")
    journal = Journal(path, identity, data.overwrite, about=choice.describe())
    try:
        with ExitStack() as closing:
            total = sum(map(len, turns.values()))
            if journal.replies:
                print(f"prepare: {len(journal.replies)} of {total} regenerated replies are in {journal.path}; going "
                      "on from there")
            if server is not None:
                reply_round = _server_rounds(cfg, tokenizer, samples, server)
            elif len(journal.replies) >= total:
                reply_round = None  # every reply is in the journal: no target to load
            elif choice.engine == "vllm":
                reply_round = vllm_rounds(cfg, tokenizer, choice, closing)
            else:
                reply_round = _local(cfg, tokenizer, choice.dtype)
            out, report = _rounds(cfg, tokenizer, convs, turns, samples, journal, reply_round, how, described,
                                  "chunk of replies" if choice.engine == "vllm" else "batch of replies")
        if cache is not None and path.is_file():  # no journal: nothing was regenerated (text sources only)
            keep_in_cache(path, cache)
        return out, {**report, "engine_choice": choice.describe()}
    finally:
        journal.close()


CACHE = "regenerated"  # under the data cache ($MTP_TRAIN_DATA): journals by the sha256 of their identity


def cached_journal(identity: dict, cfg: "RunConfig") -> Path:
    """Where a finished journal of these inputs is kept for another run directory on this machine
    (`data.regen_cache`): keyed by its identity (conversations, sources, target, engine, sampling, seed) and what
    else shapes a reply that the identity leaves to the run directory: the tokenizer and its chat template, the
    target's generation config (its stop tokens), its weight files' bytes' dates, and data.max_length (vLLM sends
    no prompt longer)."""
    target = Path(cfg.target.path)
    weights = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in target.glob("*.safetensors"))
    generation = target / "generation_config.json"
    extra = {"tokenizer": tokenizer_hash(cfg.target.path), "max_length": cfg.data.max_length, "weights": weights,
             "generation_config": generation.read_text() if generation.is_file() else None}
    key = hashlib.sha256(json.dumps([identity, extra], sort_keys=True, default=str).encode()).hexdigest()
    return data_cache_dir() / CACHE / f"{key}.jsonl"


def keep_in_cache(path: Path, cache: Path) -> None:
    """A copy of the finished journal in the cache (written beside it, then renamed: never half a file)."""
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, tmp)
        os.replace(tmp, cache)
    except OSError as e:  # the dataset does not depend on the cache: say so and go on
        tmp.unlink(missing_ok=True)
        print(f"regenerate: could not keep a copy of {path} in {cache.parent} ({e}); the dataset is not affected")


def _recorded(path: Path) -> dict:
    """The identity in a journal's header; {} when there is no readable one."""
    try:
        with open(path, "rb") as f:
            ident = json.loads(f.readline())["identity"]
        return ident if isinstance(ident, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _engine_of(identity: dict) -> str | None:
    """ours | vllm | server: which engine wrote a journal with this identity (None: no journal)."""
    engine = identity.get("engine")
    if engine == "mtp_train.inference":
        return "ours"
    return None if not isinstance(engine, dict) else "vllm" if "vllm" in engine else "server"


def _named(sources: list) -> list[dict]:
    """The source files as the journal names them: path (or corpus) and sha256."""
    out = []
    for src in sources:
        for f in (src if isinstance(src, list) else [src]):
            out.append({k: f[k] for k in ("path", "corpus", "sha256") if k in f})
    return out


def _local(cfg: "RunConfig", tokenizer, dtype: str):
    """Our engine: reply_round(k, todo, prompts, done, journal, requests, bar), decoded in batches."""
    data = cfg.data
    runner = load_runner(cfg.target.path, replace(cfg.target, dtype=dtype))
    stop = stop_tokens(tokenizer, runner)
    if not stop:
        raise ValueError(f"the target at {cfg.target.path} names no end-of-sequence token (tokenizer eos_token, "
                         "generation_config.json eos_token_id): regenerated replies would never end")

    def reply_round(k, todo, prompts, done, journal, requests, bar):
        batches = batch_order(prompts, data.regen_batch_size)
        left = [j for j, b in enumerate(batches) if not all(todo[i] in done for i in b)]
        for b, replies in decode_batches(runner, prompts, [batches[j] for j in left],
                                         max_new_tokens=data.regen_max_new_tokens, temperature=data.regen_temperature,
                                         stop=stop, seeds=[batch_seed(cfg.seed, k, j) for j in left]):
            commit_replies(journal, k, [todo[i] for i in b], replies, tokenizer, bar, requests, "the batch in flight")

    return reply_round


def _server_rounds(cfg: "RunConfig", tokenizer, samples, server: Server):
    """The server: reply_round(...) with data.regen_concurrency requests in flight, those that finished together
    committed together."""
    data = cfg.data

    def one(i, t, prompt):
        text, n = server.complete(prompt, data.regen_max_new_tokens, data.regen_temperature, cfg.seed + i,
                                  f"{samples[i][0].where}, assistant turn {t}")
        return i, t, text, (n if n >= 0 else len(tokenizer.encode(text, add_special_tokens=False)))

    def reply_round(k, todo, prompts, done, journal, requests, bar):
        pool = ThreadPoolExecutor(data.regen_concurrency)
        pending = {pool.submit(one, i, t, p) for (i, t), p in zip(todo, prompts) if (i, t) not in done}
        try:
            while pending:
                # woken at least every 0.2 s: a stop request drops the requests not sent yet at once
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                if requests.requested or any(f.exception() is not None for f in finished):
                    # stopping: the requests not sent yet are dropped, those in flight finished and kept
                    finished |= wait({f for f in pending if not f.cancel()})[0]
                    pending = set()
                replies = sorted(f.result() for f in finished if f.exception() is None)  # in a fixed order
                if replies:
                    journal.commit(k, replies)
                    bar(len(replies), sum(r[3] for r in replies))
                failed = next((f.exception() for f in finished if f.exception() is not None), None)
                if isinstance(failed, ServerError):
                    kept = (f"The {len(journal.replies)} replies finished before are kept in {journal.path}: the "
                            "same command goes on from there" if journal.replies else "Nothing was written")
                    raise ServerError(f"{failed}. {kept}") from None
                if failed is not None:
                    raise failed
                if requests.requested:
                    raise Preempted(stopped(requests, journal, "the requests in flight"))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    return reply_round


def _rounds(cfg, tokenizer, convs, turns, samples, journal: Journal, reply_round, how: str, described: str,
            unit: str):
    """Round k rewrites the k-th assistant turn of every conversation: the journal's replies taken, the others
    from `reply_round`, committed as they come; a stop request is honoured after each commit (of a `unit`)."""
    data = cfg.data
    t0, n_new, new_tokens = time.perf_counter(), 0, 0
    rounds = max((len(t) for t in turns.values()), default=0)
    total = sum(map(len, turns.values()))
    with tqdm(total=total, initial=len(journal.replies), desc="regenerate", unit=" turns", dynamic_ncols=True,
              leave=False) as progress, StopRequests("prepare", unit) as requests:
        def bar(turns_done: int, tokens: int) -> None:
            nonlocal n_new, new_tokens
            n_new, new_tokens = n_new + turns_done, new_tokens + tokens
            progress.update(turns_done)
            progress.set_postfix(tok_s=f"{new_tokens / max(1e-9, time.perf_counter() - t0):,.1f}")

        for k in range(rounds):
            todo = [(i, ts[k]) for i, ts in turns.items() if len(ts) > k]
            done = journal.done(k)
            unknown = set(done) - set(todo)
            if unknown:
                raise ValueError(f"{journal.path} holds replies for turns this run does not regenerate (round {k}: "
                                 f"conversation, turn {sorted(unknown)[:3]}): it is damaged; remove it")
            if len(done) < len(todo):
                prompts = [list(tokenizer.apply_chat_template(convs[i][:t], add_generation_prompt=True,
                                                              tokenize=True, return_dict=False)) for i, t in todo]
                reply_round(k, todo, prompts, done, journal, requests, bar)
                done = journal.done(k)
            for i, t in todo:
                convs[i][t]["content"] = done[(i, t)][0]
    seconds = time.perf_counter() - t0
    out = [(Record(r.kind, r.where, messages=convs[i]) if i in convs else r, split)
           for i, (r, split) in enumerate(samples)]
    n_tokens = sum(n for _, n in journal.replies.values())
    report = {"conversations": len(convs), "turns": total, "generated_tokens": n_tokens,
              "turns_from_journal": total - n_new, "seconds": round(seconds, 3),
              "samples_per_s": round(len(convs) / seconds, 2) if seconds else None,
              "tokens_per_s": round(new_tokens / seconds, 1) if seconds and n_new else None,
              "temperature": data.regen_temperature, "max_new_tokens": data.regen_max_new_tokens,
              "engine": how, "journal": str(journal.path)}
    print(f"regenerate: {len(convs)} conversations, {total} turns ({total - n_new} from the journal), "
          f"{new_tokens} tokens generated in {seconds:.1f}s ({report['tokens_per_s']} tokens/s, {described})")
    return out, report
