"""Write `mtp_train/data/functions_test.json`: the function-writing test draw (`validate.test_prompts`
`functions-test`), record keys of function-writing conversations from the standard library's `validation` split
that no recipe reads.

    python data_prep/build_functions_test.py [--n 48]

The recipes' seeded subsets of that split (every `stdlib_chat` source on `validation`, with its seed and place)
are left out; of the rest, the `n` with the smallest sha256 of their key are listed (a choice no figure saw),
then sorted by key. The list, its sha256 and the Python version it was made on are committed; run it again
only to make a new test set (and say so in benchmarks/RESULTS.md: figures on the old list do not compare).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp_train.config import available_recipes, compose  # noqa: E402
from mtp_train.data.config import SourceConfig  # noqa: E402
from mtp_train.data.prepare import _subset  # noqa: E402
from mtp_train.data.prompt_sets import FUNCTIONS_TEST  # noqa: E402
from mtp_train.data.sources import BadRecord, read_source  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=48)
    args = ap.parse_args(argv)
    records, seen = [], set()
    for r in read_source(SourceConfig(path="validation", format="stdlib_chat")):
        if not isinstance(r, BadRecord) and r.key() not in seen:
            seen.add(r.key())
            records.append(r)
    used = set()
    for name in available_recipes():
        cfg = compose(name, ["target.path=/nonexistent"] if name not in ("tiny", "tiny-eagle3") else [])
        for index, src in enumerate(cfg.data.sources):
            if src.format == "stdlib_chat" and src.path == "validation":
                chosen = _subset(records, src.limit, f"{cfg.seed}:{index}") if src.limit is not None else records
                used |= {r.key() for r in chosen}
                print(f"{name}: data.sources[{index}] reads {len(chosen)} of the split's {len(records)}")
    pool = sorted((r.key() for r in records if r.key() not in used), key=lambda k: hashlib.sha256(k.encode()).hexdigest())
    keys = sorted(pool[:args.n])
    out = {"about": "function-writing test prompts: stdlib validation split, record keys (mtp_train/data/sources.py "
                    "Record.key); made by data_prep/build_functions_test.py",
           "python": platform.python_version(), "split": "validation", "records_in_split": len(records),
           "read_by_recipes": len(used), "keys": keys, "sha256": hashlib.sha256("\n".join(keys).encode()).hexdigest()}
    FUNCTIONS_TEST.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{FUNCTIONS_TEST}: {len(keys)} of {len(pool)} unread prompts (split {len(records)}, read by recipes "
          f"{len(used)}), Python {out['python']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
