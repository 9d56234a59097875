#!/usr/bin/env bash
# One preparation per TP group on a 2-GPU machine, one command: share_targets with an NCCL default
# group and gloo groups beside it (tests/trainer/_share_check.py nccl: every rank's targets equal
# its own gather, and the ranks' ids gathered over NCCL on their GPUs rebuild the group's rows),
# then `routereplay bench tp` at TP2 and TP8 on the host's CPUs (simulated ranks).
#
# Run from the repository root on the GPU machine. Carried: EXTRA (default /tmp/stage/extra)
# with the service's wheels, pytest, hypothesis (the check imports the alignment tests' records)
# and redis/ (tests/gpu/carry_redis.sh); .device/rr/routereplay-*.whl (this checkout as a wheel).
# SKIP_INSTALL=1 skips the install (done by an earlier script in the same call). Logs go to $OUT
# (or /tmp/rr-share).
set -u
EXTRA=${EXTRA:-/tmp/stage/extra}
LOGS=${OUT:-/tmp/rr-share}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site "$EXTRA"/*.whl .device/rr/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH="$EXTRA/redis:/tmp/site/bin:$PATH"
say() { echo "$*" | tee -a "$LOGS/results-share.log"; }
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ' ')$(nproc) CPUs"
fail=0
port=$((29500 + RANDOM % 1000))
python3 tests/trainer/_share_check.py 1 2 $port nccl >"$LOGS/share-rank1.log" 2>&1 &
python3 tests/trainer/_share_check.py 0 2 $port nccl >"$LOGS/share-rank0.log" 2>&1 || fail=1
wait $! || fail=1
cat "$LOGS"/share-rank*.log | tee -a "$LOGS/results-share.log"
say "-- share_targets on 2 GPUs: $([ $fail = 0 ] && echo pass || echo FAIL)"
cd /tmp  # not the checkout: its routereplay/ folder would shadow the installed package
for tp in 2 8; do
  for threads in 1 2; do
    say "-- bench tp --tp $tp --decode-threads $threads"
    timeout 150 python3 -m routereplay.cli bench tp --tp $tp --decode-threads $threads 2>&1 |
      tee -a "$LOGS/results-share.log" || fail=1
  done
done
say "== exit $fail"
exit $fail
