"""A fuzz run of the RL control API on the real engine, as an admin: generated requests (valid and
not) for every RL operation in /openapi.json; none may answer 5xx, and the engine serves after.

Runs its own service: the fuzz pauses, resumes and relabels its weights."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from routereplay.service import Settings, create_app

from .conftest import Service, start_service

pytestmark = pytest.mark.vllm

ADMIN = "ops:" + "f" * 24
AUTH = {"Authorization": "Bearer " + "f" * 24}
RL_TAG = "RL control (vLLM's API)"

schema = schemathesis.openapi.from_dict(
    create_app(Settings(backend="synthetic")).openapi()
).include(tag=RL_TAG)

_SERVICE: dict[str, Service] = {}


@pytest.fixture(scope="module")
def own(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, subprocess.Popen]]:
    root = tmp_path_factory.mktemp("fuzz-weights")
    shutil.copytree(tiny_model, root / "ckpt")  # one good checkpoint, for the paths that find it
    flags = ("--route-prefix", "fuzz", "--admin-keys", ADMIN, "--weights-root", str(root))
    with start_service(redis_url, tiny_model, tmp_path_factory.mktemp("fuzz"), *flags) as out:
        yield out


@pytest.fixture(autouse=True, scope="module")
def _server(own: tuple[Service, subprocess.Popen]) -> None:
    _SERVICE["svc"] = own[0]


def test_the_schema_covers_every_rl_operation() -> None:
    paths = {op.path for op in (r.ok() for r in schema.get_all_operations())}
    assert {"/pause", "/resume", "/reload_weights", "/init_weight_transfer_engine",
            "/update_weights", "/abort_requests", "/get_world_size"} <= paths  # fmt: skip


@schema.parametrize()
@hypothesis.settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same cases every run: a failure reproduces
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_no_5xx_from_any_rl_call(case: schemathesis.Case) -> None:
    response = case.call(base_url=_SERVICE["svc"].url, headers=AUTH, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])


def test_the_engine_serves_after_the_fuzz(own: tuple[Service, subprocess.Popen]) -> None:
    service, proc = own
    with httpx.Client(base_url=service.url, headers=AUTH, timeout=120) as c:
        assert c.post("/resume").status_code == 200
        r = c.post("/reload_weights", json={"weights_path": "ckpt", "weight_version": "after"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"model": service.model, "prompt": "still here",
                                            "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["routed_experts"]["weight_version"] == "after"
    assert proc.poll() is None
