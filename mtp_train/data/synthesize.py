"""Prompts the target writes itself (Magpie, arXiv 2406.08464): a source `{path: NAME, format: target_prompts,
limit: N}` in `data.sources`.

The chat template is rendered up to and including the user's header (found by rendering a conversation whose
user message is a sentinel and cutting there; `data.synth_system` is the system prompt before it, "" the
template's own default), and the target continues it, sampled at `data.synth_temperature`, until its end-of-turn
token: the text is a user prompt. Its reply comes from regeneration (`data.regenerate=true`, required), as for any
other prompt. Prompts are sampled `data.regen_batch_size` at a time through our inference engine (the batches of
regenerate.py), batch j from its own seed (the run's seed and j), and kept in order when they pass the filters
below and are not near-duplicates of a prompt kept before, until `limit` are kept or `ATTEMPTS_PER_PROMPT *
limit` were sampled. The manifest's `target_prompts` entry counts the prompts dropped by each filter.

**Resumable.** Every sampled batch (all its rows, before filtering) is committed to
`run_dir/data/target_prompts.jsonl`, regenerate.py's `Journal` (a commit's "round" is the batch, a reply's
"conversation" its row): a killed prepare goes on from it, and since the filters run over the batches in order, a
resumed run keeps the same prompts, byte for byte, as an uninterrupted one. A journal made with another target,
seed, temperature, length, batch size or system prompt is refused (`data.overwrite=true` discards it); a larger
`limit` goes on from it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import TemplateError
from tqdm.auto import tqdm

from mtp_train.data import overlap
from mtp_train.data.regenerate import Journal, decode_batches
from mtp_train.data.sources import Record
from mtp_train.inference.load import stop_tokens
from mtp_train.inference.runner import load_runner
from mtp_train.model.target import target_fingerprint
from mtp_train.preempt import Preempted, StopRequests

if TYPE_CHECKING:
    from mtp_train.config import RunConfig
    from mtp_train.data.config import DataConfig, SourceConfig

FORMAT = "target_prompts"
JOURNAL = "target_prompts.jsonl"  # in run_dir/data, beside regenerate.jsonl
SENTINEL = "\ue000mtp-train user turn\ue000"  # private-use characters: text no template writes by itself
ATTEMPTS_PER_PROMPT = 4  # give up after sampling 4 x limit prompts (a warning, the prompts kept so far are used)

# The filters, in the order they are tried (a dropped prompt is counted under the first that fails):
# unfinished      no end-of-turn token within data.synth_max_new_tokens: cut off, or rambling on (too long)
# special_tokens  holds a special or added token of the tokenizer (a role header, another turn's start)
# too_short       fewer than MIN_CHARS characters once stripped
# no_letters      no letter at all (digits, punctuation, code symbols only)
# repetitive      over MAX_REPEATED of its word NGRAM-grams repeat an earlier one (a degenerate loop)
# near_duplicate  the Jaccard similarity of its word NGRAM-gram set with a prompt kept before is >= NEAR_DUPLICATE
FILTERS = ("unfinished", "special_tokens", "too_short", "no_letters", "repetitive", "near_duplicate")
MIN_CHARS = 10
NGRAM = 3
MAX_REPEATED = 0.5  # checked on prompts of at least MIN_NGRAMS word n-grams
MIN_NGRAMS = 6
NEAR_DUPLICATE = 0.7


def wanted(src: "SourceConfig") -> bool:
    return src.format == FORMAT


def check_sources(data: "DataConfig") -> None:
    """Refuse, before any work, target_prompts sources that cannot be made."""
    found = [i for i, src in enumerate(data.sources) if wanted(src)]
    for i in found:
        if not data.regenerate:
            raise ValueError(f"data.sources[{i}] ({data.sources[i].path}): format {FORMAT} writes user prompts only; "
                             "their replies come from regeneration: set data.regenerate=true")
        if data.sources[i].limit is None or data.sources[i].limit < 1:
            raise ValueError(f"data.sources[{i}] ({data.sources[i].path}): format {FORMAT} needs limit: N, the number "
                             f"of prompts the target writes (got {data.sources[i].limit})")
    if len(found) > 1:
        raise ValueError(f"data.sources[{found[0]}] and [{found[1]}]: more than one {FORMAT} source (they would write "
                         "the same prompts); keep one and raise its limit")


def describe(src: "SourceConfig") -> list[dict]:
    """What stands for the source's files in the manifest and the config hash (the settings are in data.*)."""
    return [{"path": src.path, "format": FORMAT}]


# -- the prompt prefix ------------------------------------------------------------------------------------------
def _cut(tokenizer, messages: list[dict], where: str) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if text.count(SENTINEL) != 1:
        raise ValueError(f"{where}: the chat template does not write a {messages[-1]['role']} message as given (a "
                         f"sentinel message appears {text.count(SENTINEL)} times): format {FORMAT} needs a "
                         "template that renders user turns")
    return text[:text.index(SENTINEL)]


def user_prefix(tokenizer, system: str = "", where: str = "the target's tokenizer") -> str:
    """The chat template rendered up to and including the user's header: (the system turn, or the template's default
    one,) then what the template writes before a user message's content."""
    if not tokenizer.chat_template:
        raise ValueError(f"{where} has no chat template: format {FORMAT} needs one that renders user turns")
    head = [{"role": "system", "content": system}] if system else []
    try:
        prefix = _cut(tokenizer, [*head, {"role": "user", "content": SENTINEL}], where)
    except TemplateError as e:
        raise ValueError(f"{where}: the chat template refused a conversation that starts with a user turn ({e}): "
                         f"format {FORMAT} needs one that renders it") from None
    try:
        other = _cut(tokenizer, [*head, {"role": "assistant", "content": SENTINEL}], where)
    except (TemplateError, ValueError):
        other = None
    if prefix == other:
        raise ValueError(f"{where}: the chat template writes the same text before a user message as before an "
                         f"assistant one ({prefix!r}): it has no user header to continue; format {FORMAT} needs one")
    return prefix


# -- the filters -----------------------------------------------------------------------------------------------
def shingles(text: str) -> frozenset:
    """The prompt's word NGRAM-grams, as the overlap check reads words (case-folded); a shorter prompt: its words
    as one."""
    return frozenset(overlap.shingles(text, NGRAM) or {overlap.normalise(text)})


def drop_reason(text: str, ended: bool, special: list[str]) -> str | None:
    """The first filter (FILTERS) a prompt fails, near_duplicate aside; None if it passes them all."""
    if not ended:
        return "unfinished"
    if any(s in text for s in special):
        return "special_tokens"
    if len(text.strip()) < MIN_CHARS:
        return "too_short"
    if not any(c.isalpha() for c in text):
        return "no_letters"
    w = overlap.normalise(text).split()
    grams = [tuple(w[i:i + NGRAM]) for i in range(len(w) - NGRAM + 1)]
    if len(grams) >= MIN_NGRAMS and 1 - len(set(grams)) / len(grams) > MAX_REPEATED:
        return "repetitive"
    return None


class NearDuplicates:
    """The prompts kept so far, by shingle: a new prompt is compared only with those sharing a shingle with it
    (O(its shingles x their postings), not O(kept))."""

    def __init__(self, threshold: float = NEAR_DUPLICATE):
        self.threshold = threshold
        self.sizes: list[int] = []
        self.index: dict[tuple, list[int]] = {}

    def add_if_new(self, text: str) -> bool:
        """Keep `text` unless its Jaccard similarity with a kept prompt is >= threshold; True if kept."""
        mine = shingles(text)
        shared = Counter(k for s in mine for k in self.index.get(s, ()))
        if any(n / (len(mine) + self.sizes[k] - n) >= self.threshold for k, n in shared.items()):
            return False
        for s in mine:
            self.index.setdefault(s, []).append(len(self.sizes))
        self.sizes.append(len(mine))
        return True


def special_strings(tokenizer) -> list[str]:
    """Every special or added token's text (template markers: a prompt holding one is not a plain user message)."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values()]
    return sorted({s for s in [*tokenizer.all_special_tokens, *added] if s})


# -- sampling --------------------------------------------------------------------------------------------------
def synth_seed(seed: int, batch: int) -> int:
    """The seed of batch `batch`'s sampling: the run's seed and the batch (regeneration's batches draw others)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{FORMAT}:{batch}".encode()).digest()[:8], "little") >> 1


def _identity(cfg: "RunConfig", src: "SourceConfig", prefix: str, ids: list[int]) -> dict:
    """The journal's header, in regenerate.Journal's terms: the one "conversation" continued is the prefix."""
    data = cfg.data
    return {"conversations": {"count": 1, "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()},
            "sources": [{"path": f"{src.path} ({FORMAT})"}], "prefix": prefix,
            "target": {"path": str(Path(cfg.target.path).resolve()),
                       "fingerprint": target_fingerprint(cfg.target.path), "dtype": cfg.target.dtype},
            "engine": "mtp_train.inference",
            "sampling": {"temperature": data.synth_temperature, "max_new_tokens": data.synth_max_new_tokens,
                         "batch_size": data.regen_batch_size, "system": data.synth_system},
            "seed": cfg.seed}


class _Sampler:
    """Batch j's rows [(text, tokens)], from the journal or sampled (the target loaded at the first need) and
    committed; a stop request is honoured after the commit."""

    def __init__(self, cfg: "RunConfig", tokenizer, ids: list[int], journal: Journal, requests: StopRequests):
        self.cfg, self.tokenizer, self.ids, self.journal, self.requests = cfg, tokenizer, ids, journal, requests
        self.runner, self.stop, self.new_rows, self.new_tokens = None, set(), 0, 0

    def __call__(self, j: int) -> list[tuple[str, int]]:
        size = self.cfg.data.regen_batch_size
        done = self.journal.done(j)
        if len(done) < size:
            done = self._sample(j, size)
        return [done[(r, 0)] for r in range(size)]

    def _sample(self, j: int, size: int) -> dict:
        data = self.cfg.data
        if self.runner is None:
            self.runner = load_runner(self.cfg.target.path, self.cfg.target)
            self.stop = stop_tokens(self.tokenizer, self.runner)
            if not self.stop:
                raise ValueError(f"the target at {self.cfg.target.path} names no end-of-sequence token: the prompts "
                                 "it writes would never end")
        _, rows = next(decode_batches(self.runner, [self.ids] * size, [list(range(size))],
                                      max_new_tokens=data.synth_max_new_tokens, temperature=data.synth_temperature,
                                      stop=self.stop, seeds=[synth_seed(self.cfg.seed, j)]))
        self.journal.commit(j, [(r, 0, self.tokenizer.decode(t, skip_special_tokens=False), len(t))
                                for r, t in enumerate(rows)])
        self.new_rows, self.new_tokens = self.new_rows + size, self.new_tokens + sum(map(len, rows))
        if self.requests.requested:
            raise Preempted(f"prepare: stopped on request ({self.requests.requested}) after the batch of prompts in "
                            f"flight; {len(self.journal.replies)} sampled prompts are committed to "
                            f"{self.journal.path}: the same command goes on from there")
        return self.journal.done(j)


def synthesize(cfg: "RunConfig", tokenizer, src: "SourceConfig") -> tuple[list[Record], dict]:
    """`src.limit` prompts the target wrote (as conversations whose assistant turn regeneration fills) and the
    report; resumes from, and commits to, run_dir/data/target_prompts.jsonl."""
    data, n = cfg.data, src.limit
    prefix = user_prefix(tokenizer, data.synth_system, f"the tokenizer of {cfg.target.path}")
    ids = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    journal = Journal(Path(cfg.run_dir) / "data" / JOURNAL, _identity(cfg, src, prefix, ids), data.overwrite)
    if journal.replies:
        print(f"prepare: {len(journal.replies)} sampled prompts are in {journal.path}; going on from there")
    kept, drops, seen, special = [], Counter(), NearDuplicates(), special_strings(tokenizer)
    attempts, cap, t0 = 0, ATTEMPTS_PER_PROMPT * n, time.perf_counter()
    try:
        with StopRequests("prepare", "batch of prompts") as requests, \
                tqdm(total=n, desc=f"{FORMAT} {src.path}", unit=" prompts", leave=False) as bar:
            sample = _Sampler(cfg, tokenizer, ids, journal, requests)
            j = 0
            while len(kept) < n and attempts < cap:
                for text, tokens in sample(j):
                    if len(kept) == n or attempts == cap:
                        break
                    attempts += 1
                    prompt = text.strip()
                    why = drop_reason(prompt, tokens < data.synth_max_new_tokens, special)
                    if why is None and not seen.add_if_new(prompt):
                        why = "near_duplicate"
                    if why is None:
                        kept.append(prompt)
                        bar.update(1)
                    else:
                        drops[why] += 1
                j += 1
    finally:
        journal.close()
    seconds = time.perf_counter() - t0
    report = _report(n, journal, sample, kept, drops, attempts, seconds)
    head = [{"role": "system", "content": data.synth_system}] if data.synth_system else []
    return [Record("chat", f"{FORMAT} {src.path}[{k}]", messages=[*head, {"role": "user", "content": p},
                                                                   {"role": "assistant", "content": ""}])
            for k, p in enumerate(kept)], report


def _report(n: int, journal: Journal, sample: _Sampler, kept: list[str], drops: Counter, attempts: int,
            seconds: float) -> dict:
    report = {"requested": n, "written": len(kept), "attempts": attempts, "dropped": {k: drops[k] for k in FILTERS},
              "sampled_now": sample.new_rows, "generated_tokens": sample.new_tokens, "seconds": round(seconds, 3),
              "prompts_per_s": round(len(kept) / seconds, 2) if seconds and sample.new_rows else None,
              "tokens_per_s": round(sample.new_tokens / seconds, 1) if seconds and sample.new_rows else None,
              "journal": str(journal.path), "identity": journal.identity}
    print(f"{FORMAT}: {len(kept)} of {n} prompts kept of {attempts} sampled ({sample.new_rows} sampled now, "
          f"{sample.new_tokens} tokens in {seconds:.1f}s, {report['tokens_per_s']} tokens/s); dropped "
          + ", ".join(f"{k} {v}" for k, v in report["dropped"].items()))
    if len(kept) < n:
        print(f"{FORMAT}: warning: only {len(kept)} of {n} prompts after {attempts} attempts (the cap: "
              f"{ATTEMPTS_PER_PROMPT} per prompt); the dataset goes on with them. See the drops above: a higher "
              "data.synth_max_new_tokens or another data.synth_system may help")
    return report
