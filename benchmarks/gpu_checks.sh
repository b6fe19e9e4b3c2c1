#!/usr/bin/env bash
# The GPU checks, as one script for a single lent GPU (an H100/H200 with torch preinstalled and no network):
#
#   1. benchmarks/gpu_train_step.py: the llama3.1-8b head's training step (micro-batch 8 x 2048, depth 3,
#      bf16 autocast): tokens/s, MFU, peak memory against the memory estimate; then the same with
#      activation checkpointing at micro-batch 16.
#   1b. the same step with train.features=online (a Llama-3.1-8B-shaped target's forward on the GPU every step):
#      tokens/s against the offline step.
#   2. the whole pipeline on the embedded tiny target on the GPU in bf16 (prepare, precompute with a bf16 store,
#      train with train.precision=bf16, validate: speculative decoding on the GPU, export), then validate again
#      with the target in fp32 to tell bf16 near-tie flips from bugs (greedy_identical).
#   3. benchmarks/decode_profile.py on that run in bf16: ms per speculative step against the target alone, greedy
#      and sampled, and the ops that take the time (the attention backend among them).
#   4. the EAGLE-3 pipeline (recipe tiny-eagle3) on the GPU in bf16; eagle3_init_bf16: the same with the start
#      options SmolLM2's best eagle3 head trains with (head.init_fc / head.init_layer, norm_output, the LK term).
#   5. benchmarks/gpu_forward_time.py: a Llama-3.1-8B-shaped target's forward over n new tokens at batch b and
#      context c, and a one-layer model beside it (the speed predictor's ground truth).
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]       # default: $OUT, else benchmarks/results/gpu
#   CHECKS="forward_time eagle3_bf16" bash benchmarks/gpu_checks.sh   # only these steps, in the order given
#
# Missing pure-Python dependencies travel as wheels in .whl/ (hydra-core, omegaconf, antlr4-python3-runtime,
# datasets, dill, multiprocess); they are installed into /tmp/site first when .whl/ exists. Every step has its
# own time limit, and a failing step does not stop the next one; the exit status counts the failures.
set -u
OUT_DIR=${1:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$OUT_DIR"
ALL="train_step train_step_ac train_step_online pipeline_bf16 decode_profile validate_fp32 eagle3_bf16 eagle3_init_bf16 forward_time"
CHECKS=${CHECKS:-$ALL}
for c in $CHECKS; do case " $ALL " in *" $c "*) ;; *) echo "unknown check $c (known: $ALL)"; exit 2;; esac; done
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
PY=${PYTHON:-python3}
fails=0
step() {  # step NAME SECONDS CMD...: run, log to $OUT_DIR/log.txt, count a failure
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T), limit ${secs}s): $*" | tee -a "$OUT_DIR/log.txt"
  local t0=$SECONDS
  timeout "$secs" "$@" >>"$OUT_DIR/log.txt" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0))s" | tee -a "$OUT_DIR/log.txt"
  [ $rc -eq 0 ] || { fails=$((fails + 1)); tail -25 "$OUT_DIR/log.txt"; }
}

nvidia-smi -L | tee -a "$OUT_DIR/log.txt"
$PY -c "import torch, transformers, datasets, omegaconf, hydra; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'transformers', transformers.__version__, 'datasets', datasets.__version__)" 2>&1 \
  | tee -a "$OUT_DIR/log.txt"

RUN=/tmp/tiny-gpu
# validate.retimes=0: the tiny target is launch-bound on a GPU and its timing rounds spread 20-55% there, so the
# default re-timing (up to 2 more rounds per row) tripled validate's time (third H200 session) for speeds that are
# noise around 1x on this target anyway.
GPU="target.device=cuda target.dtype=bfloat16 train.precision=bf16 validate.retimes=0"
eagle3() {  # eagle3 NAME RUN REPORT [OVERRIDES...]: the tiny-eagle3 pipeline in /tmp/RUN, its report as $OUT_DIR/REPORT
  local name=$1 run=/tmp/$2 report=$3; shift 3
  step "$name" 220 $PY -m mtp_train.cli pipeline recipe=tiny-eagle3 run_dir="$run" $GPU "$@"
  [ -f "$run/validation/report.json" ] && cp "$run/validation/report.json" "$OUT_DIR/$report"
}
check() {  # check NAME: one step and the files it leaves
  case $1 in
  train_step)
    step train_step 120 $PY benchmarks/gpu_train_step.py
    [ -f benchmarks/results/gpu_train_step.json ] && cp benchmarks/results/gpu_train_step.json "$OUT_DIR/gpu_train_step.json";;
  train_step_ac)
    step train_step_ac 100 $PY benchmarks/gpu_train_step.py --activation-checkpointing --micro-batch 16 --steps 20
    [ -f benchmarks/results/gpu_train_step.json ] && cp benchmarks/results/gpu_train_step.json "$OUT_DIR/gpu_train_step_ac.json";;
  train_step_online)
    step train_step_online 150 $PY benchmarks/gpu_train_step.py --online --steps 20
    [ -f benchmarks/results/gpu_train_step_online.json ] && cp benchmarks/results/gpu_train_step_online.json "$OUT_DIR/";;
  pipeline_bf16)
    step pipeline_bf16 260 $PY -m mtp_train.cli pipeline recipe=tiny run_dir=$RUN $GPU
    [ -f $RUN/validation/report.json ] && cp $RUN/validation/report.json "$OUT_DIR/tiny_report_bf16.json"
    tar czf "$OUT_DIR/tiny_run.tgz" --exclude=store --exclude='checkpoints' -C /tmp tiny-gpu 2>/dev/null;;
  decode_profile)
    step decode_profile 200 $PY benchmarks/decode_profile.py --run-dir $RUN --device cuda --dtype bfloat16 --prompts 6
    [ -f benchmarks/results/decode_profile-cuda-bfloat16.json ] && cp benchmarks/results/decode_profile-cuda-bfloat16.json "$OUT_DIR/";;
  validate_fp32)
    step validate_fp32 90 $PY -m mtp_train.cli validate recipe=tiny run_dir=$RUN target.device=cuda \
      target.dtype=float32 train.precision=bf16 validate.retimes=0
    [ -f $RUN/validation/report.json ] && cp $RUN/validation/report.json "$OUT_DIR/tiny_report_fp32.json";;
  eagle3_bf16) eagle3 eagle3_bf16 tiny-eagle3-gpu tiny_eagle3_report_bf16.json;;
  eagle3_init_bf16)
    eagle3 eagle3_init_bf16 tiny-eagle3-init-gpu tiny_eagle3_init_report_bf16.json \
      head.init_fc=2 head.init_layer=3 head.norm_output=true train.loss.accept_weight=0.5;;
  forward_time)
    step forward_time 150 $PY benchmarks/gpu_forward_time.py
    [ -f benchmarks/results/gpu_forward_time.json ] && cp benchmarks/results/gpu_forward_time.json "$OUT_DIR/";;
  esac
}
for c in $CHECKS; do check $c; done
echo "failures: $fails" | tee -a "$OUT_DIR/log.txt"
exit $fails
