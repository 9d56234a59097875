#!/usr/bin/env bash
# Serving cost at the production router shape on one H200: `routereplay bench service` with
# Qwen3-30B-A3B's config and vLLM's dummy weights (bf16, CUDA graphs), GRPO groups of 8 with
# prompts of 512-2048 tokens and completions of 256-1024, at 1, 32, 128 and 256 sequences in
# flight; vLLM's own OpenAI server without routes (floor) and with --enable-return-routed-experts
# (peer) against `routereplay serve`, every route read back and checked.
#
# A device call lasts at most 10 minutes, so SERVERS (default all three) names the servers one
# call runs; rows gather in /tmp/rr-bench (kept while the machine stays warm), so calls of
# SERVERS=floor, SERVERS=peer, SERVERS=routereplay back to back make one report. The first call
# installs (unless SKIP_INSTALL=1: an earlier script did), after the vLLM bundle of
# ../shared/gpu/README.md is in /tmp/site. Carried beside it:
#   EXTRA (default /tmp/stage/extra): the service's wheels (zstandard, redis, hiredis,
#     pydantic-settings, python-dotenv) and redis/ (tests/gpu/carry_redis.sh);
#   .device/rr/routereplay-*.whl: this checkout as a wheel (`pip wheel --no-deps -w .device/rr .`),
#     and .device/rr/COMMIT the commit it was built from (`git rev-parse --short HEAD`), which
#     the log's header lines name.
# LEVELS and SEQS override the concurrency levels and the sequences per level, STREAM (also, off,
# only) the streamed pass, RUNS the passes over the levels per server start (`--runs`); PYSPY=1 samples the server's processes with py-spy during each level
# (`--py-spy`, the py-spy wheel carried in EXTRA; with RUNS, the last run only), PYSPY_SECONDS=S
# only its first S seconds.
# Logs, rows and profiles go to LOGS (default $OUT, or /tmp/rr-serving); RESULTS replaces
# /tmp/rr-bench, for two runs at once on two GPUs (CUDA_VISIBLE_DEVICES picks each one's).
set -u -o pipefail
EXTRA=${EXTRA:-/tmp/stage/extra}
R=${RESULTS:-/tmp/rr-bench}
LOGS=${LOGS:-${OUT:-/tmp/rr-serving}}
M=/tmp/rr-models/q30b
mkdir -p "$LOGS" "$R"
export PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # the trimmed bundle has no flashinfer (its README)
unset VLLM_WORKER_MULTIPROC_METHOD
export PYTHONPATH=/tmp/site PATH="$EXTRA/redis:/tmp/site/bin:$PATH"
REPO=$PWD
if [ ! -e $R/installed ]; then
  [ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site "$EXTRA"/*.whl .device/rr/*.whl || exit 1
  mkdir -p $M && cp tests/gpu/qwen3-30b-a3b-config.json $M/config.json
  python3 tests/gpu/vocab_tokenizer.py $M || exit 1
  touch $R/installed
fi
cd /tmp  # not the checkout: its routereplay/ folder would shadow the installed package
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)," \
  "$(nproc) CPUs, wheel of $(cat "$REPO/.device/rr/COMMIT" 2>/dev/null || echo unnamed)" \
  | tee -a "$LOGS/bench-gpu.log"
python3 -m routereplay.cli bench service --model $M --servers "${SERVERS:-floor,peer,routereplay}" \
  --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.85 \
  --engine-args '{"load_format": "dummy"}' --group-size 8 --prompt-tokens 512-2048 \
  --max-tokens 256-1024 --concurrency "${LEVELS:-1,32,128,256}" --sequences "${SEQS:-2,32,128,256}" \
  --stream "${STREAM:-also}" --runs "${RUNS:-1}" --results $R ${PYSPY:+--py-spy "$LOGS/pyspy"} \
  ${PYSPY_SECONDS:+--py-spy-seconds "$PYSPY_SECONDS"} 2>&1 | tee -a "$LOGS/bench-gpu.log"
rc=$?
cp $R/*.json "$LOGS/" 2>/dev/null
tail -n 40 $R/*.log >"$LOGS/server-logs-tail.txt" 2>/dev/null
exit $rc
