"""Whether two sets of prompts share a prompt: by the dedup key (the same text once whitespace and case are
set aside, or one contained in the other) and by a word n-gram near-duplicate test (most of a prompt's word
n-grams found in one other text). Validation uses it to refuse a run whose dev or test prompts overlap the
training data or each other; prompt synthesis uses it to drop near-duplicate prompts.

The rule (the one place it lives):

    normalised text   = the words (runs of letters and digits), case-folded, joined by one space
    prompt key        = sha256 of the normalised text
    same              = equal keys
    shingles          = the set of NGRAM consecutive normalised words (a text shorter than NGRAM words: none)
    contained         = the prompt's normalised text found whole (at word boundaries) in the other's, and
                        near-duplicate as below
    near-duplicate    = |shingles(prompt) ∩ shingles(other)| >= CONTAINMENT * |shingles(prompt)|

Containment, not Jaccard: a prompt copied into a longer conversation (a system turn, other turns around it)
is still found. A prompt of fewer than NGRAM words ("hi", "write a python script") only counts when it is the
same text: a short phrase inside a longer request is not that request.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass

NGRAM = 5  # words per shingle
CONTAINMENT = 0.5  # share of a prompt's shingles found in one other text that makes it a near-duplicate
_WORD = re.compile(r"\w+", re.UNICODE)


def normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.casefold()))


def prompt_key(text: str) -> str:
    """The dedup key of a prompt's text."""
    return hashlib.sha256(normalise(text).encode("utf-8", errors="surrogatepass")).hexdigest()


def shingles(text: str, n: int = NGRAM) -> set[str]:
    words = normalise(text).split()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass
class Overlap:
    prompt: str  # where the prompt comes from (its set and place)
    other: str  # where the text it overlaps comes from
    kind: str  # "same" (equal normalised text), "contained" (inside the other) or "near" (n-gram containment)
    share: float  # the share of the prompt's shingles found in the other text

    def __str__(self) -> str:
        what = {"same": "the same text as", "contained": "contained in",
                "near": f"a near-duplicate ({self.share:.0%} of its {NGRAM}-word shingles) of"}[self.kind]
        return f"{self.prompt} is {what} {self.other}"


class TextIndex:
    """Texts indexed by shingle, to find for a prompt the text holding most of its shingles."""

    def __init__(self) -> None:
        self.where: list[str] = []
        self.normalised: list[str] = []
        self.keys: dict[str, int] = {}
        self.by_shingle: dict[str, list[int]] = defaultdict(list)

    def add(self, text: str, where: str) -> None:
        i = len(self.where)
        self.where.append(where)
        norm = normalise(text)
        self.normalised.append(norm)
        self.keys.setdefault(prompt_key(text), i)
        for s in shingles(text):
            self.by_shingle[s].append(i)

    def __len__(self) -> int:
        return len(self.where)

    def find(self, text: str, where: str, containment: float = CONTAINMENT) -> Overlap | None:
        """The overlap of `text` with an indexed text, or None: equal keys first, then the indexed text that
        holds the largest share of its shingles (the text itself contained in it, or a near-duplicate)."""
        if (i := self.keys.get(prompt_key(text))) is not None:
            return Overlap(where, self.where[i], "same", 1.0)
        found = self.matches(text, where, containment)
        return max(found, key=lambda o: o.share) if found else None

    def matches(self, text: str, where: str, containment: float = CONTAINMENT) -> list[Overlap]:
        """Every indexed text that `text` overlaps (equal keys, or the shingle share; in index order)."""
        same = [i for i, n in enumerate(self.normalised) if n == normalise(text)] \
            if prompt_key(text) in self.keys else []
        mine = shingles(text)
        hits: dict[int, int] = defaultdict(int)
        for s in mine:
            for i in set(self.by_shingle.get(s, ())):
                hits[i] += 1
        norm = f" {normalise(text)} "
        out = [Overlap(where, self.where[i], "same", 1.0) for i in same]
        for i in sorted(hits):
            share = hits[i] / len(mine)
            if i not in same and share >= containment:
                kind = "contained" if norm in f" {self.normalised[i]} " else "near"
                out.append(Overlap(where, self.where[i], kind, share))
        return out


def overlaps(prompts: list[tuple[str, str]], index: TextIndex, limit: int = 0) -> list[Overlap]:
    """Every (text, where) of `prompts` that overlaps an indexed text (the first `limit` when > 0)."""
    found = []
    for text, where in prompts:
        if (o := index.find(text, where)) is not None:
            found.append(o)
            if limit and len(found) >= limit:
                break
    return found
