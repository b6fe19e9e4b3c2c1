"""Step 1 of `make peers`, run with mtp_train's own venv: a small `tiny-eagle3` run on the embedded tiny target
(prepared data and a store holding the aux layers 1, 2, 3 and layer 4, the last layer's output before the final
norm), written in both peers' offline formats by `benchmarks/peers/write.py`. Step 2 (tests/peers, in each
peer's venv, which has no mtp_train) reads only files: the store's shards, the peers' data and `manifest.json`.

    python benchmarks/peers/prepare.py OUT_DIR

Reruns reuse a finished store and rewrite the peers' data.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# tiny-eagle3 cut to about 70 train and 20 val samples (documents are cut into 256-token windows); its store also keeps layer 4 (the pre-norm final state speculators reads)
OVERRIDES = ["data.sources.0.limit=3", "data.sources.1.limit=32", "data.sources.2.limit=1",
             "data.sources.3.limit=8", "store.layers=[4]", "target.device=cpu"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    out = args.out.resolve()
    from mtp_train.config import compose
    from mtp_train.data.prepare import run as prepare
    from mtp_train.store.precompute import run as precompute
    from write import write

    run_dir = out / "run-tiny-eagle3"
    cfg = compose("tiny-eagle3", [f"run_dir={run_dir}", *OVERRIDES])
    if not (run_dir / "data" / "manifest.json").is_file():
        prepare(cfg)
    precompute(cfg)  # skips finished shards
    data = out / "data"
    if data.exists():
        shutil.rmtree(data)
    record = write(cfg, data)
    manifest = {"run_dir": str(run_dir), "store": str(run_dir / "store"), "target": record["target"],
                "peers": str(data / "peers.json"), "overrides": ["recipe=tiny-eagle3", *OVERRIDES]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out / 'manifest.json'}: {record['samples']} samples, {record['draft_vocab_summary']}")


if __name__ == "__main__":
    main()
