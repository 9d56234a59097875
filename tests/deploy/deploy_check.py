"""The deployment, for real: build the CPU image, `docker compose up service`, use it as a client
would, restart Redis under it, require API keys, `docker compose down`.

Run through tests/deploy/run_deploy_checks.sh (which installs docker and compose when missing);
this file needs a running dockerd, `docker compose` (v2) and buildx. Containers use host
networking (deploy/compose.host-network.yaml) and are reached on 127.0.0.1 only.

Environment:
  BASE_IMAGE           base of the CPU image (default: the Dockerfile's, python:3.11-slim-bookworm)
  REDIS_IMAGE          the Redis image (default: compose.yaml's)
  PIP_EXTRA_INDEX_URL  passed to the build (empty when docker/wheels/ holds torch)
  PIP_CERT_FILE        a CA bundle given to the build as the pip_cert secret
  REDIS_PORT, SERVICE_PORT   host ports (defaults: free ones)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from routereplay.client import RouteNotFoundError, RoutesClient, RouteStore

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("ROUTEREPLAY_IMAGE", "routereplay:cpu")
FILES = ["-f", "compose.yaml", "-f", "deploy/compose.host-network.yaml"]
MODEL = "tiny-qwen3-moe-moe"
report: dict[str, Any] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REDIS_PORT = int(os.environ.get("REDIS_PORT") or free_port())
SERVICE_PORT = int(os.environ.get("SERVICE_PORT") or free_port())
URL = f"http://127.0.0.1:{SERVICE_PORT}"
REDIS_URL = f"redis://127.0.0.1:{REDIS_PORT}/0"


def sh(
    *cmd: str, env: dict[str, str] | None = None, check: bool = True, quiet: bool = False
) -> subprocess.CompletedProcess[str]:
    if not quiet:
        print("+", " ".join(cmd), flush=True)
    out = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, text=True, capture_output=quiet
    )
    if check and out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr or ''}")
    return out


def compose_env(**extra: str) -> dict[str, str]:
    return {
        "REDIS_PORT": str(REDIS_PORT),
        "SERVICE_PORT": str(SERVICE_PORT),
        "ROUTEREPLAY_IMAGE": IMAGE,
        **extra,
    }


def compose(
    *args: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return sh("docker", "compose", *FILES, *args, env=env or compose_env(), check=check)


def wait_for(what: str, ok: Callable[[], bool], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if ok():
                return time.monotonic() - t0
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what}: not within {timeout:.0f} s")


def status(path: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(URL + path, headers=headers, timeout=5).status_code


def restart_count(container: str = "routereplay-redis-1") -> int:
    out = sh("docker", "inspect", "-f", "{{.RestartCount}}", container, quiet=True)
    return int(out.stdout.strip())


def build() -> None:
    """The CPU image, timed: once as it comes, once more after touching only the code."""
    args = ["docker", "build", "--network", "host", "-f", "docker/Dockerfile.cpu"]
    if os.environ.get("BASE_IMAGE"):
        args += ["--build-arg", f"BASE={os.environ['BASE_IMAGE']}"]
    if "PIP_EXTRA_INDEX_URL" in os.environ:
        args += ["--build-arg", f"PIP_EXTRA_INDEX_URL={os.environ['PIP_EXTRA_INDEX_URL']}"]
    if os.environ.get("PIP_CERT_FILE"):
        args += ["--secret", f"id=pip_cert,src={os.environ['PIP_CERT_FILE']}"]
    t0 = time.monotonic()
    sh(*args, "-t", IMAGE, ".", env={"DOCKER_BUILDKIT": "1"})
    report["build_s"] = round(time.monotonic() - t0, 1)
    inspect = json.loads(sh("docker", "image", "inspect", IMAGE, quiet=True).stdout)[0]
    report["image_bytes"] = inspect["Size"]
    report["image_layers"] = len(inspect["RootFS"]["Layers"])
    cfg = inspect["Config"]
    assert cfg["User"] == "10001:10001", cfg["User"]
    assert cfg["Entrypoint"] == ["routereplay", "serve"], cfg["Entrypoint"]
    assert cfg["Healthcheck"]["Test"][0] == "CMD", cfg["Healthcheck"]
    assert not any(e.startswith("PIP_CERT") for e in cfg["Env"]), "a build secret leaked into ENV"
    hist = sh("docker", "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", IMAGE,
              quiet=True).stdout  # fmt: skip
    report["layers"] = [ln.split("\t")[0] for ln in hist.splitlines() if not ln.startswith("0B")]
    # The build's CA bundle (a secret) must not be in any layer.
    if os.environ.get("PIP_CERT_FILE"):
        probe = sh("docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", IMAGE, "-c",
                   "ls /run/secrets 2>/dev/null; env | grep -i pip_cert || true",
                   quiet=True).stdout  # fmt: skip
        assert not probe.strip(), f"build secret visible in the image: {probe!r}"
    # Touch only the code: the multi-GB dependency layer must come from the cache.
    marker = ROOT / "routereplay" / "_deploy_check_marker.py"
    # Unique content: BuildKit's cache is content-addressed, so a marker seen before would hit it.
    marker.write_text(f"# written by tests/deploy/deploy_check.py: {os.urandom(8).hex()}\n")
    try:
        t0 = time.monotonic()
        sh(*args, "-t", f"{IMAGE}-rebuild", ".", env={"DOCKER_BUILDKIT": "1"})
        report["code_only_rebuild_s"] = round(time.monotonic() - t0, 1)
    finally:
        marker.unlink()
    a = json.loads(sh("docker", "image", "inspect", IMAGE, quiet=True).stdout)[0]
    b = json.loads(sh("docker", "image", "inspect", f"{IMAGE}-rebuild", quiet=True).stdout)[0]
    shared = len(set(a["RootFS"]["Layers"]) & set(b["RootFS"]["Layers"]))
    report["layers_shared_after_code_change"] = f"{shared}/{len(b['RootFS']['Layers'])}"
    assert shared >= len(b["RootFS"]["Layers"]) - 2, report["layers_shared_after_code_change"]
    sh("docker", "image", "rm", f"{IMAGE}-rebuild", quiet=True)


def gpu_image_on_a_stand_in() -> None:
    """docker/Dockerfile (the GPU image) cannot be built here: its base, vLLM's CUDA image, is not
    reachable. Build it on a stand-in with the same contract (python3 that imports vllm, pip,
    `vllm serve` as entrypoint: the CPU image's build stage), then check the entrypoint answers
    and the settings deploy/compose.gpu.yaml passes parse inside it."""
    args = ["docker", "build", "--network", "host"]
    if os.environ.get("PIP_CERT_FILE"):
        args += ["--secret", f"id=pip_cert,src={os.environ['PIP_CERT_FILE']}"]
    env = {"DOCKER_BUILDKIT": "1"}
    base = (
        ["--build-arg", f"BASE={os.environ['BASE_IMAGE']}"] if os.environ.get("BASE_IMAGE") else []
    )
    if "PIP_EXTRA_INDEX_URL" in os.environ:
        base += ["--build-arg", f"PIP_EXTRA_INDEX_URL={os.environ['PIP_EXTRA_INDEX_URL']}"]
    try:
        _gpu_image_checks(args, base, env)
    finally:
        # The stand-ins and the image built on them exist for this check only.
        sh("docker", "image", "rm", "routereplay:gpu-standin", "local/vllm-standin",
           "local/vllm-standin-base", quiet=True, check=False)  # fmt: skip


def _gpu_image_checks(args: list[str], base: list[str], env: dict[str, str]) -> None:
    sh(*args, *base, "--target", "build", "-f", "docker/Dockerfile.cpu", "-t",
       "local/vllm-standin-base", ".", env=env)  # fmt: skip
    standin = (
        'FROM local/vllm-standin-base\nENV PATH=/opt/venv/bin:$PATH\nENTRYPOINT ["vllm", "serve"]\n'
    )
    subprocess.run(
        ["docker", "build", "-q", "-t", "local/vllm-standin", "-"],
        input=standin, text=True, check=True, env={**os.environ, **env}, capture_output=True,
    )  # fmt: skip
    t0 = time.monotonic()
    sh(*args, "--build-arg", "VLLM_IMAGE=local/vllm-standin", "-f", "docker/Dockerfile",
       "-t", "routereplay:gpu-standin", ".", env=env)  # fmt: skip
    report["gpu_dockerfile_on_stand_in_build_s"] = round(time.monotonic() - t0, 1)
    cfg = json.loads(sh("docker", "image", "inspect", "routereplay:gpu-standin",
                        quiet=True).stdout)[0]["Config"]  # fmt: skip
    assert cfg["Entrypoint"] == ["routereplay", "serve"] and cfg["User"] == "10001:10001", cfg
    out = sh("docker", "run", "--rm", "--network", "none", "routereplay:gpu-standin", "--help",
             quiet=True).stdout  # fmt: skip
    assert "--gpu-memory-utilization" in out and "--redis-url" in out, out[:500]
    gpu = subprocess.run(
        ["docker", "compose", "-f", "compose.yaml", "-f", "deploy/compose.gpu.yaml", "config",
         "--format", "json"], cwd=ROOT, env={**os.environ, "MODEL_DIR": "/tmp"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    environment = json.loads(gpu.stdout)["services"]["service"]["environment"]
    flags = [f"{k}={v}" for k, v in environment.items() if k.startswith("ROUTEREPLAY_")]
    check = "from routereplay.service.settings import Settings; print(Settings().model)"
    env_args = [a for f in flags for a in ("-e", f)]
    out = sh("docker", "run", "--rm", "--network", "none", *env_args, "--entrypoint", "python3",
             "routereplay:gpu-standin", "-c", check, quiet=True).stdout  # fmt: skip
    assert out.strip() == "/model", out


def up(env: dict[str, str]) -> float:
    """`docker compose up -d service`; seconds until /ready answers 200."""
    t0 = time.monotonic()
    compose("up", "-d", "--no-build", "service", env=env)
    wait_for("service ready", lambda: status("/ready") == 200, 600)
    return round(time.monotonic() - t0, 1)


def chat(client: openai.OpenAI, text: str, **kw: Any) -> tuple[dict, list[int]]:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
        **kw,
    )
    c = r.choices[0]
    handle = c.model_extra["routed_experts"]
    assert handle["status"] == "stored", handle
    return handle, r.model_extra["prompt_token_ids"] + c.model_extra["token_ids"]


def check_routes(handle: dict, tokens: list[int], key: str | None, prefix: str) -> None:
    """The route through the service (RoutesClient) and straight from the compose Redis
    (RouteStore) is one record, with the tokens the SDK saw."""
    with RoutesClient(URL, api_key=key) as rc:
        via_http = rc.get(handle["route_id"])
    store = RouteStore.from_url(REDIS_URL, prefix=prefix)
    try:
        direct = store.get(handle["route_id"])
    finally:
        store.close()
    assert via_http.token_ids.tolist() == tokens, "service record has other tokens"
    assert direct.token_ids.tolist() == tokens, "Redis record has other tokens"
    assert np.array_equal(via_http.experts, direct.experts)
    assert via_http.experts.shape[0] == len(tokens) == handle["num_rows"]


def phase_open() -> None:
    report["compose_up_to_ready_s"] = up(compose_env())
    client = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0)
    handle, tokens = chat(client, "hello from compose")
    check_routes(handle, tokens, None, "rr")
    # Streaming through the published port as well.
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream it"}], max_tokens=8,
        stream=True, extra_body={"return_token_ids": True},
    )  # fmt: skip
    finals = [c.choices[0].model_extra.get("routed_experts") for c in stream if c.choices]
    assert [h["status"] for h in finals if h] == ["stored"], finals
    # The service runs as the image's non-root user.
    uid = sh("docker", "compose", *FILES, "exec", "-T", "service", "id", "-u",
             env=compose_env(), quiet=True).stdout.strip()  # fmt: skip
    assert uid == "10001", uid
    # Redis goes away (a crash: SHUTDOWN NOSAVE exits it); the restart policy brings it back
    # (Docker restarts it within a second, so /ready may never be seen failing) and the service
    # reconnects: new routes are stored. Persistence is off by default: the route stored before
    # the crash is gone and reads as missing (RouteNotFoundError), never as a partial record.
    t0 = time.monotonic()
    sh("docker", "compose", *FILES, "exec", "-T", "redis", "redis-cli", "-p", str(REDIS_PORT),
       "shutdown", "nosave", env=compose_env(), check=False)  # fmt: skip
    wait_for("Redis restarted", lambda: restart_count() == 1, 60)
    wait_for("/ready 200 after Redis restarts", lambda: status("/ready") == 200, 120)
    report["redis_crash_to_ready_s"] = round(time.monotonic() - t0, 1)
    st = RouteStore.from_url(REDIS_URL)
    try:
        st.get(handle["route_id"])
        raise AssertionError("a route survived a restart of a Redis without persistence")
    except RouteNotFoundError:
        pass
    finally:
        st.close()
    handle, tokens = chat(client, "after the redis restart")
    check_routes(handle, tokens, None, "rr")
    compose("down", "-v")


def phase_keys() -> None:
    """API keys from a secret file: no key, a wrong key and a right key, and the tenant's
    namespace in Redis."""
    tenant, key = "team-a", "k-" + os.urandom(12).hex()
    admin = "adm-" + os.urandom(12).hex()
    with tempfile.TemporaryDirectory() as d:
        keys, admins = Path(d) / "api_keys", Path(d) / "admin_keys"
        keys.write_text(f"# tenant:key\n{tenant}:{key}\n")
        admins.write_text(f"ops:{admin}\n")
        for f in (keys, admins):
            f.chmod(0o444)  # bind-mounted as is: the container's uid 10001 must read it
        env = compose_env(API_KEYS_FILE=str(keys), ADMIN_KEYS_FILE=str(admins))
        report["compose_up_to_ready_with_keys_s"] = up(env)
        try:
            anon = openai.OpenAI(base_url=URL + "/v1", api_key="wrong-key-00000000", max_retries=0)
            try:
                chat(anon, "no")
                raise AssertionError("a wrong key was accepted")
            except openai.AuthenticationError as e:
                assert e.status_code == 401
            assert status("/metrics") == 401 and status("/health") == 200
            client = openai.OpenAI(base_url=URL + "/v1", api_key=key, max_retries=0)
            handle, tokens = chat(client, "hello tenant")
            check_routes(handle, tokens, key, f"rr:t:{tenant}")
            assert status("/metrics", admin) == 200
            # The key file stays out of the image and out of the container's environment.
            env_out = sh("docker", "compose", *FILES, "exec", "-T", "service", "env",
                         env=env, quiet=True).stdout  # fmt: skip
            assert key not in env_out
        finally:
            compose("down", "-v", env=env)


def main() -> int:
    sh("docker", "compose", "version")
    for extra in ([], ["-f", "deploy/compose.gpu.yaml"]):
        sh("docker", "compose", "-f", "compose.yaml", *extra, "config", "-q",
           env={"MODEL_DIR": "/tmp"})  # fmt: skip
    sh("docker", "compose", *FILES, "config", "-q")
    if os.environ.get("SKIP_BUILD") != "1":
        build()
        gpu_image_on_a_stand_in()
    compose("down", "-v", check=False)
    try:
        phase_open()
        phase_keys()
    except BaseException:
        compose("logs", "--tail", "80", check=False)
        compose("down", "-v", check=False)
        raise
    print("deploy report:", json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
