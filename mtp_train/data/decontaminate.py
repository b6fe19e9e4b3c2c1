"""Training data kept apart from the prompts a run is judged on (`data.decontaminate`): before any reply is
regenerated, a conversation whose prompt overlaps a held-out prompt of the run's dev sets (`validate.prompts`) or
test sets (`validate.test_prompts`) is dropped from the train split, and one that overlaps a test prompt from the
val split too (`overlap.py` says what overlaps). Validation refuses a run with such an overlap; this keeps it from
happening. A set that cannot be read without a download (MT-bench or ShareGPT not fetched yet) is left unchecked
and named in the manifest.
"""

from __future__ import annotations

from pathlib import Path

from mtp_train.data import prompt_sets, sharegpt, wheels
from mtp_train.data.overlap import TextIndex
from mtp_train.data.sources import Record

RULE_VERSION = 1  # bump with any change to what is dropped (prepare's config hash holds it)


def held_out(names: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(text, where) of every prompt of the named sets that can be read offline, and the sets left unchecked."""
    out, unchecked = [], []
    for name in names:
        if name == "recipe":  # the val split itself
            continue
        if name.startswith("mt-bench") and prompt_sets.cached() is None:
            unchecked.append(name)
            continue
        if name.startswith("sharegpt-") and wheels.cached(sharegpt.SHAREGPT, sharegpt.data_dir()) is None:
            unchecked.append(name)
            continue
        if name.endswith((".jsonl", ".json")) and not Path(name).expanduser().is_file():
            unchecked.append(name)
            continue
        if name.startswith("mt-bench"):
            records, _ = prompt_sets.mt_bench("dev" if name == "mt-bench" else "test")
        elif name.startswith("sharegpt-"):
            records, _ = prompt_sets.sharegpt_set(name.split("-", 1)[1])
        elif name == "functions-test":
            records, _ = prompt_sets.functions_test()
        else:
            records = prompt_sets.read_conversations(Path(name))
        out += [(p.text, f"{name}: {p.where}") for p in records if p.text]
    return out, unchecked


def _prompt_text(record: Record) -> str:
    return "\n".join(m["content"] for m in record.messages or [] if m["role"] in ("system", "user"))


def decontaminate(samples: list[tuple[int, Record, str]], dev: list[str], test: list[str]
                  ) -> tuple[list[tuple[int, Record, str]], dict]:
    """`samples` without the conversations that overlap a held-out prompt, and what was dropped."""
    dev_prompts, dev_unchecked = held_out(dev)
    test_prompts, test_unchecked = held_out(test)
    index = TextIndex()
    chats = [i for i, (_, r, _) in enumerate(samples) if r.kind == "chat"]
    for i in chats:
        index.add(_prompt_text(samples[i][1]), str(i))
    drop: dict[int, str] = {}
    for prompts, splits in ((dev_prompts, ("train",)), (test_prompts, ("train", "val"))):
        for text, where in prompts:
            for o in index.matches(text, where):
                i = int(o.other)
                if samples[i][2] in splits:
                    drop.setdefault(i, f"{samples[i][1].where} ({samples[i][2]}): {o.kind} "
                                       f"{o.share:.0%} of {where}")
    kept = [s for i, s in enumerate(samples) if i not in drop]
    return kept, {"rule_version": RULE_VERSION, "checked": [n for n in dev + test if n != "recipe" and n not in
                                                           dev_unchecked + test_unchecked],
                  "unchecked": dev_unchecked + test_unchecked, "held_out_prompts": len(dev_prompts) + len(test_prompts),
                  "dropped": len(drop), "dropped_by_source": _by_source(samples, drop),
                  "examples": [drop[i] for i in sorted(drop)[:10]]}


def _by_source(samples: list[tuple[int, Record, str]], drop: dict[int, str]) -> dict[int, int]:
    out: dict[int, int] = {}
    for i in drop:
        out[samples[i][0]] = out.get(samples[i][0], 0) + 1
    return out
