#!/usr/bin/env bash
# The legacy replay path (megatron-core releases without RouterReplay) on GPUs, one command.
# Run from the repository root on the device machine with
#   .device/wheels/        megatron-core 0.19.2, msgpack, zstandard for CPython 3.12
#   .device/legacy/<ver>/  an unpacked megatron-core 0.12.3 / 0.15.3 (pure Python; PyPI has no
#                          cp312 wheel of 0.12.3, and the part of it that is compiled, the dataset
#                          helpers, is not used here)
# Each release goes first on PYTHONPATH; replay_check.py proves every router row replays, with
# every torch.cuda call from routereplay's code made to raise (--no-cuda) on the world-1 runs.
set -u
LOGS=/tmp/rr-legacy-logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
DEV=${DEV:-cuda}  # DEV=cpu SKIP_INSTALL=1 rehearses this script on a CPU machine
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device/wheels/*.whl || exit 1
fi
rm -rf /tmp/rr && mkdir -p /tmp/rr/routereplay/client
cp routereplay/*.py /tmp/rr/routereplay/
cp client/_errors.py client/_record.py client/_codec.py /tmp/rr/routereplay/client/
printf '%s\n' '"""routereplay.client (GPU check subset: no Redis or HTTP modules)."""' \
  'from ._errors import *  # noqa: F403' 'from ._record import RouteRecord, WeightSpan, expert_dtype' \
  'from ._codec import decode_record, encode_record' > /tmp/rr/routereplay/client/__init__.py
cp -r trainer_adapter /tmp/rr/routereplay/trainer_adapter
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fail=0
run() {  # name megatron-dir nproc args...   (ONLY=regex runs a subset)
  local name=$1 mdir=$2 n=$3; shift 3
  [[ -z "${ONLY:-}" || "$name" =~ $ONLY ]] || return 0
  export PYTHONPATH=/tmp/rr:${mdir:+$mdir:}/tmp/site
  local t0; t0=$(date +%s.%N)
  if [ "$n" = 1 ]; then
    python3 tests/gpu/replay_check.py --device $DEV "$@" >"$LOGS/$name.log" 2>&1
  else
    python3 -m torch.distributed.run --nproc-per-node "$n" tests/gpu/replay_check.py \
      --device $DEV "$@" >"$LOGS/$name.log" 2>&1
  fi
  local rc=$?
  [ $rc = 0 ] || fail=1
  printf '%-30s rc=%s %5.1fs  %s\n' "$name" "$rc" "$(awk "BEGIN{print $(date +%s.%N) - $t0}")" "$*"
  python3 tests/gpu/summarize.py <"$LOGS/$name.log"
  [ $rc = 0 ] || tail -n 25 "$LOGS/$name.log"
}
for v in 0.12.3 0.15.3; do
  d=$PWD/.device/legacy/$v
  run "mcore${v}_w1_full_extras" "$d" 1 --recompute full --extras --no-cuda
  run "mcore${v}_tp2_sp" "$d" 2 --tp 2 --sp --recompute selective
  run "mcore${v}_pp2_1f1b" "$d" 2 --pp 2 --micro-batches 4
  [ "$DEV" = cuda ] && run "mcore${v}_ep2_alltoall" "$d" 2 --ep 2 --dispatcher alltoall
done
run "mcore0.19.2_forced_legacy" "" 1 --replay-path legacy --recompute full --extras --no-cuda
[ -n "${OUT:-}" ] && tar czf "$OUT/legacy-gpu-logs.tgz" -C /tmp rr-legacy-logs
exit $fail
