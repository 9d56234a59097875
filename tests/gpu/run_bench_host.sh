#!/usr/bin/env bash
# The trainer-side benchmarks on a device machine's host CPUs (16+ cores, the size of a trainer
# node's share), one command: on a GPU, tests/gpu/pinned_check.py (page-locked targets); `routereplay
# bench trainer` at several decode-thread counts (the simulated step on the GPU where there is
# one; ROUTES names the workloads, default skewed); tests/gpu/decode_scaling.py (how the chunk
# decode scales with threads); and the codec part of `bench store`. Nothing there is installed: carried wheels in .device/wheels
# (zstandard, blake3, redis, hiredis for its Python), a redis-server with its shared libraries in
# .device/redis (copied from this machine: tests/gpu/carry_redis.sh),.
# DEV=cpu SKIP_INSTALL=1 PY=.venv/bin/python rehearses it here.
set -u -o pipefail  # a failing benchmark fails the run, through tee
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/rr-out}
mkdir -p "$OUT"
. tests/gpu/_common.sh
install_wheels .device/wheels || exit 1
stage_package full
[ -x .device/redis/redis-server ] && export PATH="$PWD/.device/redis:$PATH"
export PYTHONPATH=/tmp/rr:/tmp/site
nproc
fail=0
if [ "$(command -v nvidia-smi)" ]; then
  $PY -P tests/gpu/pinned_check.py | tee "$OUT/pinned-check.txt" || fail=1
fi
# The simulated step computes on the GPU and installs each step's targets there (to_torch),
# where the machine has one.
SD=${STEP_DEVICE:-$(command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)}
for routes in ${ROUTES:-skewed}; do
  for th in ${THREADS:-1 4 8}; do
    $PY -P -m routereplay.cli bench trainer --step-s "${STEP_S:-2}" --repeat 5 --decode-threads "$th" \
      --step-device "$SD" --routes "$routes" --json | tee "$OUT/bench-trainer-$routes-$th.txt" || fail=1
  done
done
$PY -P tests/gpu/decode_scaling.py | tee "$OUT/decode-scaling.txt" || fail=1
if [ -z "${NO_STORE:-}" ]; then
  $PY -P -m routereplay.cli bench store --tokens 4096 --repeat 5 --capacity-groups 2 \
    | tee "$OUT/bench-store.txt" || fail=1
fi
exit $fail
