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
# (default "sharp trained moe64 moe128"), PARALLEL=1 runs them at once on the GPU; ARGS the
# experiment's sampling (default 12 prompts x 4 choices x 64 tokens). Each model's rollouts are
# sampled once per dtype (an engine start each) and both trainers read them. SKIP_INSTALL=1
# skips the install (done by an earlier script in the same call). Logs and JSON go to $OUT (or
# /tmp/rr-mismatch). DEV=cpu SKIP_INSTALL=1 PY=.venv/bin/python rehearses it on a CPU machine.
set -u
EXTRA=${EXTRA:-/tmp/stage/extra}
LOGS=${OUT:-/tmp/rr-mismatch}
M=/tmp/rr-models
mkdir -p "$LOGS" $M
export PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # the trimmed bundle has no flashinfer (its README)
unset VLLM_WORKER_MULTIPROC_METHOD
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site "$EXTRA"/*.whl .device/rr/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH="$EXTRA/redis:$PATH"
PY=${PY:-python3}
[[ $PY == */* && $PY != /* ]] && PY=$PWD/$PY  # relative to the checkout, before the cd
cd /tmp  # not the checkout: its routereplay/ folder would shadow the installed package
DEV=${DEV:-cuda}
say() { echo "$*" | tee -a "$LOGS/results-mismatch.log"; }
part() { [[ " ${PARTS:-train rollouts trainers} " == *" $1 "* ]]; }
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
fail=0

if part train; then
  t0=$(date +%s)
  $PY -m routereplay.cli build-model --variant sharp --out $M/sharp >/dev/null || fail=1
  $PY -m routereplay.cli build-model --variant moe --out $M/tiny >/dev/null || fail=1
  pids=()
  for x in trained moe64 moe128; do
    $PY -m routereplay.experiments.train_tiny train --corpus "$EXTRA/corpus.npy" --shape $x \
      --out $M/$x-w --steps "${STEPS:-2000}" --max-seconds "${TRAIN_S:-120}" --device $DEV \
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

# one_model X: X's rollouts in each dtype (an engine start each, so a dtype that fails costs only
# its own rows), then Megatron-Core and transformers on them.
one_model() {
  local x=$1 dt t0
  for dt in bfloat16 float32; do
    t0=$(date +%s)
    if part rollouts; then
      $PY -m routereplay.cli experiment mismatch --model $M/$x --device $DEV --router-fp32 \
        --dtypes $dt $ARGS --save-rollouts "$LOGS/rollouts-$x-$dt.json" \
        --json "$LOGS/mismatch-$x-$dt-megatron.json" >"$LOGS/mismatch-$x-$dt-megatron.txt" 2>&1 ||
        fail=1
    fi
    if part trainers; then
      $PY -m routereplay.cli experiment mismatch --trainer hf --device $DEV \
        --from-rollouts "$LOGS/rollouts-$x-$dt.json" --model-dir $M/$x \
        --json "$LOGS/mismatch-$x-$dt-hf.json" >"$LOGS/mismatch-$x-$dt-hf.txt" 2>&1 || fail=1
    fi
    say "-- $x $dt: rollouts, Megatron-Core, transformers $(( $(date +%s) - t0 ))s"
  done
  return $fail
}

ARGS=${ARGS:---prompts 12 --group 4 --max-tokens 64}
if [ -n "${PARALLEL:-}" ]; then
  # Every model at once on the one GPU: each engine takes a fixed KV cache instead of profiling
  # free memory, which the other engines starting beside it would skew.
  export ROUTEREPLAY_GPU_MEMORY_UTILIZATION=0.15
  export ROUTEREPLAY_ENGINE_ARGS='{"kv_cache_memory_bytes": 8589934592}'
fi
pids=()
part rollouts || part trainers || MODELS=" "  # PARTS=train: nothing to sample
for x in ${MODELS:-sharp trained moe64 moe128}; do
  if [ -n "${PARALLEL:-}" ]; then one_model $x & pids+=($!); else one_model $x || fail=1; fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
for f in "$LOGS"/mismatch-*.txt; do
  [ -e "$f" ] || continue
  say "-- ${f##*/}"
  tail -n 12 "$f" | tee -a "$LOGS/results-mismatch.log"
done
rm -f "$LOGS"/rollouts-*.json  # large; the JSON results hold the figures
say "== exit $fail"
exit $fail
