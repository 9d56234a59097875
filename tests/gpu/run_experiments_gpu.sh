#!/usr/bin/env bash
# The experiments' GPU half, one command (megatron-core 0.19.2, carried wheels in .device/wheels):
#   MODE=train     train the small Qwen3-MoE of routereplay/experiments/train_tiny.py on
#                  .device/corpus.npy (made here by `train_tiny prepare`); weights -> $OUT/trained
#   MODE=mismatch  the Megatron side of the mismatch experiment from rollouts made here, for each
#                  of MODELS (x: .device/rollouts-x.json, model in .device/models/x) -> $OUT
# MODE may list both ("train mismatch"). DEV=cpu SKIP_INSTALL=1 PY=.venv/bin/python rehearses it
# on a CPU machine.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
DEV=${DEV:-cuda}
PY=${PY:-python3}
OUT=${OUT:-/tmp/rr-out}
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
    $PY -P -m routereplay.experiments.train_tiny train --corpus .device/corpus.npy \
      --out "$OUT/trained" --steps "${STEPS:-2000}" --device "$DEV" || fail=1
  else
    # MODELS: names x; rollouts in .device/rollouts-x.json, the model in .device/models/x.
    for x in ${MODELS:-sharp}; do
      $PY -P -m routereplay.experiments.mismatch --from-rollouts ".device/rollouts-$x.json" \
        --model-dir ".device/models/$x" --device "$DEV" --router-fp32 \
        --json "$OUT/mismatch-$x-gpu.json" 2>&1 | grep -v -i warn | tee "$OUT/mismatch-$x-gpu.txt" \
        || fail=1
    done
  fi
  echo "$mode: $(( $(date +%s) - t0 )) s"
done
exit $fail
