#!/usr/bin/env bash
# HFRouterReplayer under FSDP2 on 2 GPUs (NCCL), one command: tests/trainer/_hf_fsdp_check.py for
# each supported model family, in float32 with activation checkpointing (gradients against the
# unsharded model), with bf16 mixed precision, and in float32 with the parameters offloaded to the
# CPU (CPUOffloadPolicy; MODES picks among checkpointing, bf16, offload).
# transformers comes with the device image; carried wheels in .whl/ (msgpack, zstandard for
# CPython 3.12). The log goes to /tmp/rr-hf-logs, and into $OUT when the device tool's $OUT is set.
set -u
DEV=${DEV:-cuda}  # DEV=cpu SKIP_INSTALL=1 rehearses this script on a CPU machine
. tests/gpu/_common.sh
gpu_run_setup /tmp/rr-hf-logs .whl
(cd /tmp && python3 -c 'import torch, transformers; print("torch", torch.__version__, "gpus",
  torch.cuda.device_count(), "transformers", transformers.__version__)')
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fail=0
python3 -m torch.distributed.run --nproc-per-node 2 tests/trainer/_hf_fsdp_check.py \
  --device "$DEV" --model-types qwen3_moe,qwen2_moe,olmoe,mixtral,deepseek_v3,gpt_oss \
  --modes "${MODES:-checkpointing,bf16,offload}" >"$LOGS/fsdp2.log" 2>&1 || fail=1
python3 - "$LOGS/fsdp2.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        print(f"rank {r['rank']} {r['model_type']:12} {r['mode']:13} ok={r['ok']} "
              f"routers={r['routers']} targets_exact={r['targets_exact']} "
              f"max_grad_diff={r['max_grad_diff_vs_unsharded']}")
PY
[ $fail = 0 ] || tail -n 30 "$LOGS/fsdp2.log"
[ -n "${OUT:-}" ] && cp "$LOGS/fsdp2.log" "$OUT/"
exit $fail
