#!/usr/bin/env bash
# Precompute the target's hidden states on one node: torchrun standalone, each process writing its own
# shards. A target larger than one GPU is spread over GPUS_PER_PROCESS GPUs per process (store.gpus_per_process),
# so the node runs GPUs / GPUS_PER_PROCESS processes: Llama 3.1 70B in bf16 (141 GB) takes 2 H100s per process.
#   mtp-train prepare recipe=llama3.1-70b target.path=/models/Llama-3.1-70B-Instruct run_dir=runs/70b
#   GPUS_PER_PROCESS=2 launch/precompute_single_node.sh recipe=llama3.1-70b target.path=/models/Llama-3.1-70B-Instruct run_dir=runs/70b
# Rerunning after an interruption skips the finished shards.
# Environment: GPUS (default: every GPU nvidia-smi lists, else 8), GPUS_PER_PROCESS (default 1), PYTHON.
set -euo pipefail
PYTHON=${PYTHON:-python}
GPUS_PER_PROCESS=${GPUS_PER_PROCESS:-1}
if [[ -z "${GPUS:-}" ]]; then
  GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
  [[ "$GPUS" -gt 0 ]] || GPUS=8
fi
if (( GPUS % GPUS_PER_PROCESS != 0 )); then
  echo "error: GPUS=$GPUS is not a multiple of GPUS_PER_PROCESS=$GPUS_PER_PROCESS" >&2
  exit 2
fi
NPROC=$(( GPUS / GPUS_PER_PROCESS ))
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m mtp_train precompute \
  "store.gpus_per_process=$GPUS_PER_PROCESS" "$@"
