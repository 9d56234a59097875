#!/usr/bin/env bash
# The experiments' GPU half, one command (megatron-core 0.19.2, carried wheels in .device/wheels):
#   MODE=train     train each of SHAPES (default "trained"; "trained moe64" trains both at once on
#                  one GPU) of routereplay/experiments/train_tiny.py on .device/corpus.npy (made
#                  here by `train_tiny prepare`), STEPS steps or MAX_S seconds; weights -> $OUT/x
#   MODE=mismatch  the Megatron side of the mismatch experiment from rollouts made here, for each
#                  of MODELS (x: .device/rollouts-x.json, model in .device/models/x: a checkpoint
#                  directory or train_tiny's output) -> $OUT
# MISMATCH_ARGS adds arguments to the mismatch runs (e.g. --deterministic), SUFFIX to the names
# of their files. MODE may list both ("train mismatch"). DEV=cpu SKIP_INSTALL=1
# PY=.venv/bin/python rehearses it on a CPU machine.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
DEV=${DEV:-cuda}
PY=${PY:-python3}
OUT=${OUT:-/tmp/rr-out}
SUFFIX=${SUFFIX:-}
mkdir -p "$OUT"
. tests/gpu/_common.sh
install_wheels .device/wheels || exit 1
stage_package
export PYTHONPATH=/tmp/rr:/tmp/site
$PY -c 'import torch, megatron.core as m; print("torch", torch.__version__, "cuda",
  torch.cuda.is_available(), "megatron-core", m.__version__)'
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fail=0
for mode in ${MODE:-train mismatch}; do
  t0=$(date +%s)
  if [ "$mode" = train ]; then
    pids=()
    for x in ${SHAPES:-trained}; do
      $PY -P -m routereplay.experiments.train_tiny train --corpus .device/corpus.npy \
        --shape "$x" --out "$OUT/$x" --steps "${STEPS:-2000}" --max-seconds "${MAX_S:-420}" \
        --device "$DEV" 2>&1 | grep -v -i warn | sed "s/^/$x: /" &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || fail=1; done
    for x in ${SHAPES:-trained}; do [ -s "$OUT/$x/weights.pt" ] || fail=1; done
  else
    # MODELS: names x; rollouts in .device/rollouts-x.json, the model in .device/models/x.
    for x in ${MODELS:-sharp}; do
      $PY -P -m routereplay.experiments.mismatch --from-rollouts ".device/rollouts-$x.json" \
        --model-dir ".device/models/$x" --device "$DEV" --router-fp32 ${MISMATCH_ARGS:-} \
        --json "$OUT/mismatch-$x-gpu$SUFFIX.json" 2>&1 | grep -v -i warn \
        | tee "$OUT/mismatch-$x-gpu$SUFFIX.txt" \
        || fail=1
    done
  fi
  echo "$mode: $(( $(date +%s) - t0 )) s"
done
exit $fail
