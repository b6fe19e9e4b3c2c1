#!/usr/bin/env bash
# Train a head on one node: torchrun standalone, one process per GPU (DeepSpeed ZeRO-2 by default on GPUs,
# see the recipe). Run `mtp-train prepare` and launch/precompute_single_node.sh first, with the same arguments.
#   launch/train_single_node.sh recipe=llama3.1-70b target.path=/models/Llama-3.1-70B-Instruct run_dir=runs/70b [key=value ...]
# Resume an interrupted run with the same command plus resume=true (the same number of GPUs: DeepSpeed's
# optimizer partitions are per rank).
# Environment: NPROC processes (default: every GPU nvidia-smi lists, else 8), PYTHON (default: python).
set -euo pipefail
PYTHON=${PYTHON:-python}
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
  [[ "$NPROC" -gt 0 ]] || NPROC=8
fi
# DataLoader workers read the store; the trainer's own math is on the GPU
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m mtp_train train "$@"
