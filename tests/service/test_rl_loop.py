"""The RL API on the real engine: weights reloaded from a checkpoint directory change routing,
every record says which weights routed it (spans across an update), prefix fills never cross
weight versions.

Runs its own service: vLLM's in-place reload is not bit-identical to a fresh load (reloading the
original weights flipped 1 of 61 routed rows, a near-tie), so the pytest session's service, whose
routes other modules compare with an offline engine, must keep its weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from routereplay.client import decode_record

from .conftest import Service, engine_core_pids, start_service

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
def own(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, subprocess.Popen]]:
    log_dir = tmp_path_factory.mktemp("rl")
    # Checkpoints are written to each test's tmp_path, inside the pytest session's temporary
    # directory.
    root = str(tmp_path_factory.getbasetemp())
    flags = ("--route-prefix", "rl", "--weights-root", root)
    with start_service(redis_url, tiny_model, log_dir, *flags) as (svc, proc):
        yield svc, proc


@pytest.fixture(scope="module")
def own_service(own: tuple[Service, subprocess.Popen]) -> Service:
    return own[0]


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


def test_reload_changes_routes_and_labels_records(
    rl, own: tuple[Service, subprocess.Popen]
) -> None:
    service, proc = own
    c, ckpt = rl
    prompt = list(range(40, 240))
    h0 = complete(c, service, prompt, "rl-before")["routed_experts"]
    assert h0["weight_version"] == c.get("/weight_info").json()["weight_version"]
    cores = engine_core_pids(proc.pid)
    assert cores, "no engine core process found"
    r = c.post("/reload_weights", json={"weights_path": str(ckpt), "weight_version": "step-1"})
    assert r.json() == {"message": "Weights reloaded", "weight_version": "step-1"}, r.text
    # Loaded in place: the engine that served before serves after (no restart of the engine).
    assert engine_core_pids(proc.pid) == cores
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
    out: dict = {"tokens": 0}
    tokens_arrived = threading.Event()

    def run() -> None:
        # Streamed, so the pause follows the first tokens; as long as the context allows, so the
        # request is still far from its end when the pause lands.
        body = {"model": service.model, "prompt": "cross the update", "max_tokens": 1900,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{service.url}/v1/completions", json=body, timeout=600,
                              headers={"X-Request-Id": "rl-cross"}) as r:  # fmt: skip
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    out["tokens"] += len(choice.get("token_ids") or [])
                    if out["tokens"] >= 3:
                        tokens_arrived.set()
                    if choice.get("finish_reason"):
                        out["handle"] = choice["routed_experts"]
        finally:
            tokens_arrived.set()  # a failed stream must not leave the test waiting

    t = threading.Thread(target=run)
    t.start()
    assert tokens_arrived.wait(timeout=600) and out["tokens"] >= 3, "no tokens streamed"
    assert c.post("/pause", params={"mode": "keep"}).status_code == 200
    assert c.get("/is_paused").json() == {"is_paused": True}
    # While paused the service is ready, and a new request waits for /resume.
    assert c.get("/ready").status_code == 200
    waiting: dict = {}
    w = threading.Thread(target=lambda: waiting.update(choice=complete(c, service, "wait", "rl-w")))
    w.start()
    w.join(timeout=3)
    assert w.is_alive(), "a request ran while the engine was paused"
    c.post("/reload_weights", json={"weights_path": str(ckpt), "weight_version": "after-cross"})
    assert c.get("/is_paused").json() == {"is_paused": True}  # a reload keeps the pause
    assert c.post("/resume").status_code == 200
    w.join(timeout=600)
    assert waiting["choice"]["routed_experts"]["weight_version"] == "after-cross"
    t.join(timeout=600)
    assert not t.is_alive(), "the request did not finish"
    h = out["handle"]
    assert h["status"] == "stored" and h["weight_version"] is None, h
    versions = [s["version"] for s in h["weight_versions"]]
    assert versions == ["before-cross", "after-cross"], h["weight_versions"]
    rec = route(c, "rl-cross-0")
    assert [s.version for s in rec.weight_versions] == versions
    assert rec.weight_versions[-1].stop == rec.num_tokens


def test_a_reload_without_pause_freezes_running_requests(rl, own_service: Service) -> None:
    """Without /pause the reload pauses (mode keep) around the load itself: the running request
    finishes under the new weights and reports both versions' spans."""
    service = own_service
    c, ckpt = rl
    assert c.post("/update_weight_version", json={"new_version": "before-live"}).status_code == 200
    out: dict = {}
    started = threading.Event()

    def run() -> None:
        body = {"model": service.model, "prompt": "live reload", "max_tokens": 1900,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{service.url}/v1/completions", json=body, timeout=600,
                              headers={"X-Request-Id": "rl-live"}) as r:  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        choice = json.loads(line[len("data: ") :])["choices"][0]
                        if choice.get("finish_reason"):
                            out["handle"] = choice["routed_experts"]
        finally:
            started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(timeout=600)
    r = c.post("/reload_weights", json={"weights_path": str(ckpt), "weight_version": "after-live"})
    assert r.status_code == 200, r.text
    assert c.get("/is_paused").json() == {"is_paused": False}
    t.join(timeout=600)
    assert not t.is_alive()
    versions = [s["version"] for s in out["handle"]["weight_versions"]]
    assert versions == ["before-live", "after-live"], out["handle"]
