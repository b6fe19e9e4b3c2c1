#!/usr/bin/env bash
# Run the whole pipeline for one recipe, one process per stage (each stage reads the same resolved config).
#   launch/pipeline.sh recipe=tiny run_dir=runs/tiny [key=value ...]
# The same as `mtp-train pipeline ...`, but a failed stage can be rerun alone: `mtp-train <stage> ...`.
set -euo pipefail
MTP_TRAIN=${MTP_TRAIN:-mtp-train}
for stage in prepare precompute train validate export; do
  echo "== $stage"
  "$MTP_TRAIN" "$stage" "$@"
done
