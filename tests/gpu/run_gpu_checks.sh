#!/usr/bin/env bash
# The GPU replay checks (megatron-core 0.19.2, carried wheel) on a 2-GPU machine, one command.
# Run from the repository root with the wheels in .whl/ (megatron-core, msgpack, zstandard for
# CPython 3.12). Writes one log per configuration under /tmp/rr-gpu-logs, tarred into $OUT
# when the device tool's $OUT is set.
set -u
DEV=${DEV:-cuda}  # DEV=cpu SKIP_INSTALL=1 rehearses this script on a CPU machine
. tests/gpu/_common.sh
gpu_run_setup /tmp/rr-gpu-logs .whl
(cd /tmp && python3 -c 'import torch, megatron.core as m, routereplay.client as c; print("torch",
  torch.__version__, "gpus", torch.cuda.device_count(), "megatron-core", m.__version__, c.__file__)')
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

fail=0
finish() {
  [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-logs.tgz" -C /tmp rr-gpu-logs
  exit $fail
}
run() { run_check "$@"; }  # name nproc args...   (ONLY=regex runs a subset)
run gpu1_thd_full_extras     1 --recompute full --extras
run gpu1_thd_selective       1 --recompute selective
run gpu1_padded_left         1 --layout padded-left
run gpu2_tp2_sp_thd          2 --tp 2 --sp
run gpu2_tp2_sp_padded       2 --tp 2 --sp --layout padded --recompute selective
run gpu2_cp2_thd             2 --cp 2
run gpu2_pp2_1f1b            2 --pp 2 --micro-batches 4
run gpu2_pp2_vpp2_selective  2 --pp 2 --vpp 2 --micro-batches 4 --recompute selective
run gpu2_pp2_vpp2_padded     2 --pp 2 --vpp 2 --micro-batches 4 --layout padded
# Per-sample replay policy (a stale and a missing record): own_routing rows take the router's own
# top-k and recompute repeats them although the router weights change before the backwards
# (--perturb-router); drop re-packs the kept samples. ONLY=policy runs just these.
run gpu1_policy_own_thd_full     1 --policy own_routing --recompute full --perturb-router
run gpu1_policy_own_legacy_left  1 --policy own_routing --replay-path legacy --layout padded-left \
  --recompute selective --perturb-router
run gpu2_policy_own_tp2_sp_thd   2 --tp 2 --sp --policy own_routing --recompute full --perturb-router
run gpu2_policy_own_legacy_tp2   2 --tp 2 --sp --policy own_routing --replay-path legacy \
  --layout padded --recompute selective --perturb-router
run gpu2_policy_own_pp2_1f1b     2 --pp 2 --micro-batches 4 --policy own_routing --recompute selective
run gpu2_policy_drop_cp2_thd     2 --cp 2 --policy drop
run gpu2_policy_drop_tp2_sp_pad  2 --tp 2 --sp --policy drop --layout padded --recompute selective
[ "$DEV" = cuda ] && run gpu2_policy_own_ep2_alltoall 2 --ep 2 --dispatcher alltoall \
  --policy own_routing --layout padded --recompute selective --perturb-router
# Engine routing weights (--weights engine): every replayed row's gates are the records' weights
# bit for bit, in the forward and the recompute; own rows keep the router's. ONLY=weights runs these.
run gpu1_weights_thd_full        1 --weights engine --recompute full
run gpu1_weights_legacy_left     1 --weights engine --replay-path legacy --layout padded-left \
  --recompute selective
run gpu2_weights_tp2_sp_thd      2 --tp 2 --sp --weights engine --recompute full
run gpu2_weights_own_tp2_sp_pad  2 --tp 2 --sp --weights engine --policy own_routing \
  --layout padded --recompute selective --perturb-router
run gpu2_weights_cp2_thd         2 --cp 2 --weights engine
run gpu2_weights_pp2_1f1b        2 --pp 2 --micro-batches 4 --weights engine --recompute selective
[ "$DEV" = cuda ] && run gpu2_weights_ep2_alltoall 2 --ep 2 --dispatcher alltoall --weights engine \
  --layout padded --recompute selective
[ "$DEV" = cuda ] || { echo "CPU rehearsal: alltoall and pinned targets need CUDA, skipped"; finish; }
# Targets gathered into page-locked memory (gather_targets(pin_memory=True)), installed from it.
run gpu1_thd_pinned_sel      1 --recompute selective --pin-memory
run gpu2_tp2_sp_pinned       2 --tp 2 --sp --layout padded --pin-memory
run gpu2_ep2_alltoall_thd    2 --ep 2 --dispatcher alltoall
run gpu2_ep2_alltoall_sel    2 --ep 2 --dispatcher alltoall --recompute selective --layout padded
# Issue 5: four GPUs (skipped on fewer).
if [ "$DEV" = cuda ] && [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
  run gpu4_tp2_pp2_vpp2_sp     4 --tp 2 --sp --pp 2 --vpp 2 --micro-batches 4 --recompute selective
  run gpu4_tp2_pp2_vpp2_sp_pad 4 --tp 2 --sp --pp 2 --vpp 2 --micro-batches 4 --layout padded
  run gpu4_ep4_alltoall_pad    4 --ep 4 --dispatcher alltoall --layout padded --recompute selective
  run gpu4_ep4_alltoall_thd    4 --ep 4 --dispatcher alltoall
fi
finish
