"""The RL API on the real engine: weights reloaded from a checkpoint directory change routing,
every record says which weights routed it (spans across an update), prefix fills never cross
weight versions.

Runs on the session's RL engine (``rl_service``), not the session's ``service``: vLLM's in-place
reload is not bit-identical to a fresh load (reloading the original weights flipped 1 of 61 routed
rows, a near-tie), and ``service``, whose routes other modules compare with an offline engine,
must keep its weights. Requests in flight across a pause or a reload are held by the scheduler's
test hold, not made long."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from routereplay.client import decode_record

from engines import RL_AUTH, RLService, Service, engine_core_pids

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


@pytest.fixture()
def rl(rl_service: RLService, tmp_path: Path) -> Iterator[tuple[httpx.Client, Path]]:
    # Under the engine's weights root, one directory per test.
    step = rl_service.weights_root / tmp_path.name / "step-1"
    ckpt = perturbed_checkpoint(rl_service.service.model_path, step)
    with rl_service.client() as c:
        try:
            yield c, ckpt
        finally:
            c.post("/resume")
            for rid in HELD:  # a failed test must not leave its request parked
                rl_service.release(rid)


HELD = ("held-cross", "held-live")


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


def test_reload_changes_routes_and_labels_records(rl, rl_service: RLService) -> None:
    service, proc = rl_service.service, rl_service.proc
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


def stream(service: Service, rid: str, prompt: str, out: dict, started: threading.Event) -> None:
    """A streamed completion as ``rid``: ``out["tokens"]`` counts its tokens, ``out["handle"]`` is
    its final ``routed_experts``; ``started`` is set at its third token or when the stream ends."""
    body = {"model": service.model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
    headers = {**RL_AUTH, "X-Request-Id": rid}
    out["tokens"] = 0
    try:
        with httpx.stream("POST", f"{service.url}/v1/completions", json=body, timeout=600,
                          headers=headers) as r:  # fmt: skip
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                out["tokens"] += len(choice.get("token_ids") or [])
                if out["tokens"] >= 3:
                    started.set()
                if choice.get("finish_reason"):
                    out["handle"] = choice["routed_experts"]
    finally:
        started.set()  # a failed stream must not leave the test waiting


def test_request_across_an_update_reports_its_spans(rl, rl_service: RLService) -> None:
    service = rl_service.service
    c, ckpt = rl
    assert c.post("/update_weight_version", json={"new_version": "before-cross"}).status_code == 200
    out: dict = {}
    tokens_arrived = threading.Event()
    # Held by the scheduler after its first tokens: in flight until released below.
    t = threading.Thread(
        target=stream, args=(service, "held-cross", "cross the update", out, tokens_arrived)
    )
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
    assert t.is_alive(), "the held request finished before the update"
    rl_service.release("held-cross")
    assert c.post("/resume").status_code == 200
    w.join(timeout=600)
    assert waiting["choice"]["routed_experts"]["weight_version"] == "after-cross"
    t.join(timeout=600)
    assert not t.is_alive(), "the request did not finish"
    h = out["handle"]
    assert h["status"] == "stored" and h["weight_version"] is None, h
    assert out["tokens"] == 16
    versions = [s["version"] for s in h["weight_versions"]]
    assert versions == ["before-cross", "after-cross"], h["weight_versions"]
    rec = route(c, "held-cross-0")
    assert [s.version for s in rec.weight_versions] == versions
    assert rec.weight_versions[-1].stop == rec.num_tokens


def test_a_reload_without_pause_freezes_running_requests(rl, rl_service: RLService) -> None:
    """Without /pause the reload pauses (mode keep) around the load itself: the running request
    finishes under the new weights and reports both versions' spans."""
    service = rl_service.service
    c, ckpt = rl
    assert c.post("/update_weight_version", json={"new_version": "before-live"}).status_code == 200
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=stream, args=(service, "held-live", "live reload", out, started))
    t.start()
    assert started.wait(timeout=600)
    r = c.post("/reload_weights", json={"weights_path": str(ckpt), "weight_version": "after-live"})
    assert r.status_code == 200, r.text
    assert c.get("/is_paused").json() == {"is_paused": False}
    assert t.is_alive(), "the held request finished before the reload"
    rl_service.release("held-live")
    t.join(timeout=600)
    assert not t.is_alive()
    versions = [s["version"] for s in out["handle"]["weight_versions"]]
    assert versions == ["before-live", "after-live"], out["handle"]


def test_without_the_hold_variable_no_request_is_held(service: Service) -> None:
    """The session's default service runs without RR_TEST_HOLD_DIR: a request named like a
    held one runs to its end."""
    with httpx.Client(base_url=service.url, timeout=120) as c:
        choice = complete(c, service, "not held", "held-never", max_tokens=12)
    assert len(choice["token_ids"]) == 12 and choice["routed_experts"]["status"] == "stored"
