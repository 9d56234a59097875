#!/usr/bin/env bash
# The mismatch experiment with GPU-served rollouts, one H200: `routereplay serve` on vLLM's CUDA
# engine samples the rollouts (bf16 and float32), then the same weights in Megatron-Core and in
# transformers on the same GPU compute their logprobs with replay off, ids, ids + weights (and
# the float32 router). Models: the sharp tiny variant (built here), and `trained`, `moe64` and
# `moe128` (128 experts, top-8, 16 MoE layers) trained here at once, STEPS steps (the learning
# rate schedule's length) or TRAIN_S seconds each, whichever ends first.
#
# Run from the repository root on the GPU machine after the vLLM bundle of
# ../shared/gpu/README.md is installed into /tmp/site. Carried beside it: EXTRA (default
# /tmp/stage/extra) with the service's wheels, megatron-core 0.19.2, corpus.npy (`train_tiny
# prepare`) and redis/ (tests/gpu/carry_redis.sh); .device/rr/routereplay-*.whl (this checkout as
# a wheel). PARTS (default "train rollouts trainers") picks the steps; MODELS the models
# (default "sharp trained moe64 moe128"). Each model's rollouts are sampled once (one engine
# start per dtype) and both trainers read them. Logs and JSON go to $OUT (or /tmp/rr-mismatch).
set -u
EXTRA=${EXTRA:-/tmp/stage/extra}
LOGS=${OUT:-/tmp/rr-mismatch}
M=/tmp/rr-models
mkdir -p "$LOGS" $M
export PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # the trimmed bundle has no flashinfer (its README)
unset VLLM_WORKER_MULTIPROC_METHOD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$EXTRA"/*.whl .device/rr/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH="$EXTRA/redis:$PATH"
cd /tmp  # not the checkout: its routereplay/ folder would shadow the installed package
PY=python3
say() { echo "$*" | tee -a "$LOGS/results-mismatch.log"; }
part() { [[ " ${PARTS:-train rollouts trainers} " == *" $1 "* ]]; }
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
fail=0

if part train; then
  t0=$(date +%s)
  $PY -m routereplay.cli build-model --variant sharp --out $M/sharp >/dev/null || fail=1
  $PY -m routereplay.cli build-model --variant moe --out $M/tiny >/dev/null || fail=1
  pids=()
  for x in trained moe64 moe128; do
    $PY -m routereplay.experiments.train_tiny train --corpus "$EXTRA/corpus.npy" --shape $x \
      --out $M/$x-w --steps "${STEPS:-2000}" --max-seconds "${TRAIN_S:-120}" --device cuda \
      >"$LOGS/train-$x.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || fail=1; done
  for x in trained moe64 moe128; do
    $PY -m routereplay.experiments.train_tiny finish --weights $M/$x-w --out $M/$x \
      >>"$LOGS/train-$x.log" 2>&1 || fail=1
    cp $M/tiny/chat_template.jinja $M/$x/  # train_tiny's checkpoints have no chat template
    say "-- $x trained: $(grep -i loss "$LOGS/train-$x.log" | tail -1)"
  done
  say "-- training $(( $(date +%s) - t0 ))s"
fi

for x in ${MODELS:-sharp trained moe64 moe128}; do
  if part rollouts; then
    t0=$(date +%s)
    $PY -m routereplay.cli experiment mismatch --model $M/$x --device cuda --router-fp32 \
      --dtypes bfloat16,float32 --save-rollouts "$LOGS/rollouts-$x.json" \
      --json "$LOGS/mismatch-$x-megatron.json" >"$LOGS/mismatch-$x-megatron.txt" 2>&1 || fail=1
    say "-- $x: rollouts + Megatron $(( $(date +%s) - t0 ))s"
    tail -n 14 "$LOGS/mismatch-$x-megatron.txt" | tee -a "$LOGS/results-mismatch.log"
  fi
  if part trainers; then
    t0=$(date +%s)
    $PY -m routereplay.cli experiment mismatch --trainer hf --device cuda \
      --from-rollouts "$LOGS/rollouts-$x.json" --model-dir $M/$x \
      --json "$LOGS/mismatch-$x-hf.json" >"$LOGS/mismatch-$x-hf.txt" 2>&1 || fail=1
    say "-- $x: transformers $(( $(date +%s) - t0 ))s"
    tail -n 10 "$LOGS/mismatch-$x-hf.txt" | tee -a "$LOGS/results-mismatch.log"
  fi
done
rm -f "$LOGS"/rollouts-*.json  # large; the JSON results hold the figures
say "== exit $fail"
exit $fail
