#!/usr/bin/env bash
# The service on vLLM's CUDA engine, one command: `routereplay serve` of three models under CUDA
# graphs and torch.compile (and eager, as a control), every stored route checked
# (tests/gpu/serving_check.py), and `routereplay bench service` on the GPU host.
#
# Run from the repository root on the GPU machine after the vLLM bundle of
# ../shared/gpu/README.md is installed into /tmp/site (its install.sh). Carried beside it:
#   EXTRA (default /tmp/stage/extra): the service's wheels (zstandard, redis, hiredis,
#     pydantic-settings, python-dotenv), megatron-core (to train moe64), corpus.npy
#     (`train_tiny prepare`), and redis/ (a redis-server >= 7 with liblzf and libjemalloc, from
#     tests/gpu/carry_redis.sh);
#   .device/rr/routereplay-*.whl: this checkout as a wheel (`pip wheel --no-deps -w .device/rr .`),
#     installed so that vLLM finds its plugins' entry points.
# PARTS (default all, in this order) names what runs: graphs (the tiny model under CUDA graphs,
# torch.compile alone and eager, compared), preempt (a KV cache small enough to force
# preemption), offload (vLLM's CPU KV offloading: prefix hits served from the CPU copy; vLLM
# 0.33+), shapes (the Qwen3-30B-A3B shape with dummy weights, and moe64 trained here for
# TRAIN_S seconds; q30b alone: the first), bench (`routereplay bench service`). The vLLM bundle
# may be 0.33.0's instead (tests/gpu/make_vllm033_bundle.sh, installed the same way). Logs go to $OUT (or /tmp/rr-serving); the summary lines to
# $OUT/results-serving.log.
set -u
EXTRA=${EXTRA:-/tmp/stage/extra}
LOGS=${OUT:-/tmp/rr-serving}
mkdir -p "$LOGS"
SUMMARY=$LOGS/results-serving.log
export PYTHONUNBUFFERED=1
# The trimmed bundle does not carry flashinfer (see ../shared/gpu/README.md): a bundle matter,
# not something the service needs.
export VLLM_USE_FLASHINFER_SAMPLER=0
unset VLLM_WORKER_MULTIPROC_METHOD  # the service must start without it
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$EXTRA"/*.whl .device/rr/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH="$EXTRA/redis:$PATH"
REPO=$PWD
cd /tmp  # not the checkout: its routereplay/ folder would shadow the installed package
PY=python3
say() { echo "$*" | tee -a "$SUMMARY"; }
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)," \
  "commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)$(git -C "$REPO" diff --quiet || echo +)"
$PY -c 'import torch, vllm, routereplay.client as c; print("torch", torch.__version__, "vllm",
  vllm.__version__, "routereplay", c.__file__)' | tee -a "$SUMMARY"
redis-server --version | tee -a "$SUMMARY"
# What the service finds in this vLLM (docs/deploy.md, vLLM releases), and that it serves it.
$PY -c 'from routereplay.service.engines.vllm_release import check_release, probe
r = probe(); print(r.features()); check_release(r)' 2>&1 | tail -n 1 | tee -a "$SUMMARY"
fail=0
M=/tmp/rr-models
mkdir -p $M

check() {  # name args...: one serving_check configuration
  local name=$1; shift
  local t0; t0=$(date +%s)
  $PY "$REPO/tests/gpu/serving_check.py" --name "$name" --out "$LOGS" "$@" \
    >"$LOGS/check-$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || fail=1
  say "-- $name rc=$rc $(( $(date +%s) - t0 ))s"
  grep '^RESULT' "$LOGS/check-$name.log" | tee -a "$SUMMARY"
  [ $rc = 0 ] || tail -n 30 "$LOGS/check-$name.log"
}

part() { [[ " ${PARTS:-graphs preempt offload shapes bench} " == *" $1 "* ]]; }
GMU='"gpu_memory_utilization": 0.3'
# vLLM's float32 on a GPU is not IEEE float32 throughout (its Triton attention and fused-MoE
# kernels multiply in TF32): stored weights are compared with transformers' float32 router
# within 2e-3, and each id that differs must be a near tie.
F32="--dtype float32 --weight-tol 2e-3"
$PY -m routereplay.cli build-model --variant moe --out $M/tiny >/dev/null || fail=1

if part graphs; then
  # CUDA graphs + torch.compile (the default), torch.compile alone, and eager: every row against
  # transformers; then the same greedy requests compared across the three, bit for bit.
  check tiny-graphs --model $M/tiny $F32 --engine-args "{$GMU}"
  check tiny-nographs --model $M/tiny $F32 \
    --engine-args "{$GMU, \"compilation_config\": {\"cudagraph_mode\": \"NONE\"}}"
  check tiny-eager --model $M/tiny $F32 --engine-args "{$GMU, \"enforce_eager\": true}"
  for other in nographs eager; do
    say "-- greedy requests, CUDA graphs against $other"
    $PY "$REPO/tests/gpu/serving_check.py" compare "$LOGS/greedy-tiny-graphs.npz" \
      "$LOGS/greedy-tiny-$other.npz" | tee -a "$SUMMARY"
  done
fi

if part preempt; then
  # 80 KV blocks of 16 tokens for 64 concurrent requests: the scheduler must preempt.
  check tiny-preempt --model $M/tiny $F32 --max-model-len 1024 --expect-preemption \
    --engine-args "{$GMU, \"num_gpu_blocks_override\": 80}"
fi

if part offload; then
  # vLLM's CPU KV offloading (kv_offloading_size, 0.33+): 160 GPU blocks of 16 tokens, so four
  # other 862-token prompts between the cold and the warm request push the cold one's blocks out
  # of the GPU; the warm request's hit must come from the CPU copy (external prefix-cache hits)
  # and its cached rows equal the cold run's, weights bit for bit.
  check tiny-offload --model $M/tiny $F32 --max-model-len 2048 --evict-between 4 \
    --engine-args "{$GMU, \"num_gpu_blocks_override\": 160, \"kv_offloading_size\": 1}"
fi

if part shapes || part q30b; then
  # The production router shape: Qwen3-30B-A3B's config, vLLM's dummy weights, the tiny
  # model's tokenizer; sampled tokens kept inside that tokenizer's vocabulary.
  mkdir -p $M/q30b && cp "$REPO/tests/gpu/qwen3-30b-a3b-config.json" $M/q30b/config.json
  cp $M/tiny/tokenizer* $M/tiny/chat_template.jinja $M/q30b/
  vocab=$($PY -c "from transformers import AutoTokenizer as A; print(len(A.from_pretrained('$M/tiny')))")
  allowed=$($PY -c "import json; print(json.dumps({'allowed_token_ids': list(range($vocab))}))")
  check q30b-dummy-graphs --model $M/q30b --dtype bfloat16 --reference engine \
    --request-extra "$allowed" --engine-args '{"load_format": "dummy", "gpu_memory_utilization": 0.85}'
fi

if part shapes; then
  t0=$(date +%s)
  $PY -m routereplay.experiments.train_tiny train --corpus "$EXTRA/corpus.npy" --shape moe64 \
    --out $M/moe64-w --steps 2000 --max-seconds "${TRAIN_S:-60}" --device cuda \
    >"$LOGS/train-moe64.log" 2>&1 || fail=1
  $PY -m routereplay.experiments.train_tiny finish --weights $M/moe64-w --out $M/moe64 \
    >>"$LOGS/train-moe64.log" 2>&1 || fail=1
  cp $M/tiny/chat_template.jinja $M/moe64/  # train_tiny's checkpoints have no chat template
  say "-- moe64 trained $(( $(date +%s) - t0 ))s: $(grep -i loss "$LOGS/train-moe64.log" | tail -1)"
  # bf16 against transformers bf16, a mismatch measurement: the two compute the hidden states
  # with other kernels and accumulation orders, which part after a few layers, so an id that
  # differs must be a near tie (router probability gap < 0.02) and the weights of agreeing ids
  # are reported (up to 0.054 on an H200) within a loose bound. The stored routes' exactness is
  # what the engine reference checks (q30b above).
  check moe64-bf16-graphs --model $M/moe64 --dtype bfloat16 --ref-dtype bfloat16 --tie 0.02 \
    --weight-tol 0.1 --engine-args "{$GMU}"
fi

if part bench; then
  say "-- bench service (vLLM's server and routereplay serve, tiny model, this GPU host)"
  $PY -m routereplay.cli bench service --model $M/tiny --concurrency 1,8 --sequences 8,32 \
    >"$LOGS/bench-service.log" 2>&1 || fail=1
  tail -n 12 "$LOGS/bench-service.log" | tee -a "$SUMMARY"
fi
say "== exit $fail"
exit $fail
