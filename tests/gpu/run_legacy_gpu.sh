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
. tests/gpu/_common.sh
install_wheels .device/wheels || exit 1
stage_package
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fail=0
run() {  # name megatron-dir nproc args...   (ONLY=regex runs a subset)
  local name=$1 mdir=$2 n=$3; shift 3
  PYTHONPATH=/tmp/rr:${mdir:+$mdir:}/tmp/site run_check "$name" "$n" "$@"
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
