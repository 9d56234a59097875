# Sourced by the tests/gpu/run_*.sh scripts, from the repository root. What every GPU run needs
# on a device machine where routereplay is not installed and nothing can be downloaded.

# install_wheels DIR: the carried wheels into /tmp/site (skipped with SKIP_INSTALL=1, for a
# rehearsal on a machine that has them installed).
install_wheels() {
  [ -n "${SKIP_INSTALL:-}" ] && return 0
  ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$1"/*.whl
}

# stage_package [full]: lay out routereplay under /tmp/rr: the client without its network modules
# (they need redis and httpx; the checks round-trip records through the codec instead), the
# trainer adapter and the experiments. "full": the whole client and the benchmarks.
stage_package() {
  rm -rf /tmp/rr && mkdir -p /tmp/rr/routereplay/client
  cp routereplay/*.py /tmp/rr/routereplay/
  cp -r routereplay/experiments /tmp/rr/routereplay/experiments
  cp -r trainer_adapter /tmp/rr/routereplay/trainer_adapter
  if [ "${1:-}" = full ]; then
    cp -r routereplay/bench /tmp/rr/routereplay/bench
    cp client/*.py /tmp/rr/routereplay/client/
    return 0
  fi
  cp client/_errors.py client/_record.py client/_codec.py client/_threads.py client/_frame.py \
    client/_body.py client/_transforms.py client/_zstd.py client/_weights.py client/_limits.py \
    client/_schema.py \
    /tmp/rr/routereplay/client/
  cat > /tmp/rr/routereplay/client/__init__.py <<'PY'
"""routereplay.client (the GPU subset: records and their codec)."""
from ._codec import decode_record, encode_record  # noqa: F401
from ._errors import *  # noqa: F403
from ._record import RouteRecord, WeightSpan, expert_dtype  # noqa: F401
from ._threads import default_decode_threads  # noqa: F401
PY
}

# gpu_run_setup LOGDIR WHEELDIR: what a GPU run starts with: LOGDIR empty (as $LOGS), NCCL and
# torch without NVLink multicast (KINDS.md), the carried wheels installed, routereplay staged and
# both on PYTHONPATH.
gpu_run_setup() {
  LOGS=$1
  rm -rf "$LOGS" && mkdir -p "$LOGS"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONUNBUFFERED=1
  install_wheels "$2" || exit 1
  stage_package
  export PYTHONPATH=/tmp/rr:/tmp/site
}

# run_check NAME NPROC ARGS...: one tests/gpu/replay_check.py configuration on $DEV, its log in
# $LOGS/NAME.log, a line and the summary printed; sets fail=1 when it fails. ONLY=regex runs a
# subset. PYTHONPATH is the caller's.
run_check() {
  local name=$1 n=$2; shift 2
  [[ -z "${ONLY:-}" || "$name" =~ $ONLY ]] || return 0
  local t0; t0=$(date +%s.%N)
  if [ "$n" = 1 ]; then
    python3 tests/gpu/replay_check.py --device "$DEV" "$@" >"$LOGS/$name.log" 2>&1
  else
    python3 -m torch.distributed.run --nproc-per-node "$n" tests/gpu/replay_check.py \
      --device "$DEV" "$@" >"$LOGS/$name.log" 2>&1
  fi
  local rc=$?
  [ $rc = 0 ] || fail=1
  printf '%-30s rc=%s %5.1fs  %s\n' "$name" "$rc" "$(awk "BEGIN{print $(date +%s.%N) - $t0}")" "$*"
  python3 tests/gpu/summarize.py <"$LOGS/$name.log"
  [ $rc = 0 ] || tail -n 25 "$LOGS/$name.log"
}
