"""The README's Python runs as written: every ```python block, top to bottom in a fresh
interpreter, against a real ``routereplay serve --backend synthetic`` (a deterministic engine, no
model) on a free loopback port, storing into its own private redis-server.

The blocks name the service and its Redis as a user's would (``http://127.0.0.1:8000``,
``redis://127.0.0.1:6379/0``); the test puts the real addresses in their place before running
them, and refuses a block that would still reach the default ports.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from routereplay.bench.servers import server_process
from routereplay.local_redis import free_port, redis_server

README = Path(__file__).resolve().parent.parent / "README.md"
SERVICE_PLACEHOLDER = "http://127.0.0.1:8000"
REDIS_PLACEHOLDER = "redis://127.0.0.1:6379/0"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)


@dataclass
class Service:
    url: str
    redis_url: str


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with redis_server() as redis_url:
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "routereplay.cli",
            "serve",
            "--backend",
            "synthetic",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
        ]
        url = f"http://127.0.0.1:{port}"
        log = tmp_path_factory.mktemp("readme") / "serve.log"
        # server_process polls /ready until it answers 200 (or the process exits).
        with server_process(argv, f"{url}/ready", log, timeout_s=120):
            yield Service(url, redis_url)


def test_readme_has_python_blocks() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 2, "README.md should show the client and the completion-to-step path"
    assert any(SERVICE_PLACEHOLDER in b for b in blocks)
    assert any(REDIS_PLACEHOLDER in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(index: int, service: Service, tmp_path: Path) -> None:
    code = python_blocks()[index]
    code = code.replace(SERVICE_PLACEHOLDER, service.url)
    code = code.replace(REDIS_PLACEHOLDER, service.redis_url)
    # Never the default ports: a block must name its addresses only through the placeholders.
    assert "127.0.0.1:8000" not in code and ":6379" not in code, code
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"README block {index} failed:\n{code}\n{r.stdout}\n{r.stderr}"
