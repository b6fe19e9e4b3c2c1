"""Run with mtp_train's venv: how many samples of two prepared datasets (run_dir/data) are token for token the
same, per split, and each manifest's regeneration figures. Prints JSON.

    python tests/serving/same_replies.py DATA_A DATA_B
"""
import json
import sys
from pathlib import Path

import datasets

a, b = Path(sys.argv[1]), Path(sys.argv[2])
out = {}
for split in ("train", "val"):
    if not (a / split).exists():
        continue
    x, y = datasets.load_from_disk(str(a / split)), datasets.load_from_disk(str(b / split))
    xs, ys = sorted(map(tuple, x["input_ids"])), sorted(map(tuple, y["input_ids"]))
    out[split] = {"samples": len(xs), "other": len(ys), "identical": len(set(xs) & set(ys))}
out["regenerate"] = [json.loads((d / "manifest.json").read_text())["regenerate"] for d in (a, b)]
print(json.dumps(out))
