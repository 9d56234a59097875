"""The RL API on the real engine: weights reloaded from a checkpoint directory change routing,
every record says which weights routed it (spans across an update), prefix fills never cross
weight versions.

Runs its own service: vLLM's in-place reload is not bit-identical to a fresh load (reloading the
original weights flipped 1 of 61 routed rows, a near-tie), so the session's service, whose routes
other modules compare with an offline engine, must keep its weights."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from routereplay.client import decode_record

from .conftest import Service, start_service

pytestmark = pytest.mark.vllm


def perturbed_checkpoint(src: Path, dst: Path) -> Path:
    """The tiny model with its router (``mlp.gate``) weights moved: routing changes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for k in sd:
        if k.endswith("mlp.gate.weight"):
            sd[k] = sd[k] + 0.5 * torch.randn(sd[k].shape, generator=g, dtype=sd[k].dtype)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def own_service(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    log_dir = tmp_path_factory.mktemp("rl")
    with start_service(redis_url, tiny_model, log_dir, "--route-prefix", "rl") as (svc, _):
        yield svc


@pytest.fixture()
def rl(own_service: Service, tmp_path: Path) -> Iterator[tuple[httpx.Client, Path]]:
    ckpt = perturbed_checkpoint(own_service.model_path, tmp_path / "step-1")
    with httpx.Client(base_url=own_service.url, timeout=120) as c:
        try:
            yield c, ckpt
        finally:
            c.post("/resume")


def route(c: httpx.Client, rid: str):
    r = c.get(f"/v1/routes/{rid}")
    assert r.status_code == 200, r.text
    return decode_record(r.content)


def complete(c: httpx.Client, service: Service, prompt, rid: str, **extra) -> dict:
    r = c.post("/v1/completions", headers={"X-Request-Id": rid}, json={
        "model": service.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_reload_changes_routes_and_labels_records(rl, own_service: Service) -> None:
    service = own_service
    c, ckpt = rl
    prompt = list(range(40, 240))
    h0 = complete(c, service, prompt, "rl-before")["routed_experts"]
    assert h0["weight_version"] == c.get("/weight_info").json()["weight_version"]
    t0 = time.perf_counter()
    r = c.post("/reload_weights", json={"weights_path": str(ckpt), "weight_version": "step-1"})
    took = time.perf_counter() - t0
    assert r.json() == {"message": "Weights reloaded", "weight_version": "step-1"}, r.text
    assert took < 10
    h1 = complete(c, service, prompt, "rl-after")["routed_experts"]
    assert h1["weight_version"] == "step-1" and h1["status"] == "stored"
    a, b = route(c, "rl-before-0"), route(c, "rl-after-0")
    assert np.array_equal(a.token_ids, b.token_ids)
    changed = (a.experts[:-1] != b.experts[:-1]).any(axis=(1, 2)).mean()
    assert changed > 0.2, changed  # the new router routes differently
    # Nothing of the old prompt's cache served the new request: every row is the new weights'.
    assert b.weight_versions == (("step-1", 0, b.num_tokens),)
    # A later turn that skips its prefix is filled only from step-1 rows (here: rl-after's).
    h2 = complete(c, service, [*prompt, 7, 8, 9], "rl-turn2", routed_experts_prompt_start=128)
    rec = route(c, "rl-turn2-0")
    assert rec.valid[:128].all() and np.array_equal(rec.experts[:128], b.experts[:128])
    assert h2["routed_experts"]["weight_version"] == "step-1"


def test_request_across_an_update_reports_its_spans(rl, own_service: Service) -> None:
    service = own_service
    c, ckpt = rl
    assert c.post("/update_weight_version", json={"new_version": "before-cross"}).status_code == 200
    out: dict = {}

    def run() -> None:
        out["choice"] = complete(c, service, "cross the update", "rl-cross", max_tokens=300)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2.0)  # some tokens under the first weights
    assert c.post("/pause", params={"mode": "keep"}).status_code == 200
    assert c.get("/is_paused").json() == {"is_paused": True}
    c.post("/reload_weights", json={"weights_path": str(ckpt), "weight_version": "after-cross"})
    assert c.post("/resume").status_code == 200
    t.join(timeout=120)
    h = out["choice"]["routed_experts"]
    assert h["status"] == "stored" and h["weight_version"] is None, h
    versions = [s["version"] for s in h["weight_versions"]]
    assert versions == ["before-cross", "after-cross"], h["weight_versions"]
    rec = route(c, "rl-cross-0")
    assert [s.version for s in rec.weight_versions] == versions
    assert rec.weight_versions[-1].stop == rec.num_tokens
