"""A fuzz run of the RL control API on the real engine, as an admin: generated requests (valid and
not) for every RL operation in /openapi.json; none may answer 5xx, and the engine serves after.

Runs on the session's RL engine (``rl_service``): the fuzz pauses, resumes and relabels its
weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from routereplay.service import Settings, create_app

from engines import RL_AUTH, RLService, Service

pytestmark = pytest.mark.vllm

RL_TAG = "RL control (vLLM's API)"

schema = schemathesis.openapi.from_dict(
    create_app(Settings(backend="synthetic")).openapi()
).include(tag=RL_TAG)

_SERVICE: dict[str, Service] = {}


@pytest.fixture(autouse=True, scope="module")
def _server(rl_service: RLService, tiny_model: Path) -> None:
    # One good checkpoint, for the paths that find it.
    shutil.copytree(tiny_model, rl_service.weights_root / "ckpt", dirs_exist_ok=True)
    _SERVICE["svc"] = rl_service.service


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
    response = case.call(base_url=_SERVICE["svc"].url, headers=RL_AUTH, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])


def test_the_engine_serves_after_the_fuzz(rl_service: RLService) -> None:
    service, proc = rl_service.service, rl_service.proc
    with rl_service.client() as c:
        assert c.post("/resume").status_code == 200
        r = c.post("/reload_weights", json={"weights_path": "ckpt", "weight_version": "after"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"model": service.model, "prompt": "still here",
                                            "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["routed_experts"]["weight_version"] == "after"
    assert proc.poll() is None
