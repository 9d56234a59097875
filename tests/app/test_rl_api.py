"""vLLM's RL control API on the service (synthetic engine, whose "weights" are a salt mixed into
every route): the same paths and answers as vLLM's server, weight versions on every record and
handle, spans when a request crosses an update, and prefix fills that never cross versions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from routereplay.service.engines.synthetic import synthetic_routes

from .conftest import MODEL, App, HeldEngine, running_app, until

BODY = {"model": MODEL, "max_tokens": 6, "return_token_ids": True, "temperature": 0}


def checkpoint(tmp_path: Path, salt: int) -> str:
    d = tmp_path / f"ckpt-{salt}"
    d.mkdir()
    (d / "synthetic.json").write_text(json.dumps({"salt": salt}))
    return str(d)


async def complete(svc: App, prompt: str, **extra: object) -> tuple[dict, list[int]]:
    r = await svc.http.post("/v1/completions", json={**BODY, "prompt": prompt, **extra})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c, c["prompt_token_ids"] + c["token_ids"]


async def test_vllm_shaped_answers(svc: App) -> None:
    http = svc.http
    assert (await http.get("/weight_info")).json() == {"weight_version": "default"}
    assert (await http.get("/is_paused")).json() == {"is_paused": False}
    assert (await http.post("/pause?mode=wait")).json() == {"status": "paused"}
    assert (await http.get("/is_paused")).json() == {"is_paused": True}
    assert (await http.post("/resume")).json() == {"status": "resumed"}
    r = await http.post("/update_weight_version", json={"new_version": "step-1"})
    assert r.json() == {"success": True, "new_version": "step-1"}
    assert (await http.get("/weight_info")).json() == {"weight_version": "step-1"}
    assert (await http.get("/get_world_size")).json() == {"world_size": 1}
    r = await http.post("/finish_weight_update", json={"weight_version": "step-2"})
    assert r.json() == {"message": "Weight update finished"}
    assert (await http.post("/abort_requests", json={})).json() == {
        "status": "aborted",
        "aborted": 0,
    }
    # What this engine cannot do is a 400 naming it, not a 500.
    r = await http.post("/init_weight_transfer_engine", json={"init_info": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_supported"
    assert "reload_weights" in r.json()["error"]["message"]
    r = await http.post("/pause?mode=sideways")
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = await http.post("/reload_weights", json={"weights_path": "/nonexistent"})
    assert r.status_code == 400 and "weights_path" in r.json()["error"]["message"]
    r = await http.post("/update_weight_version", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "new_version"


async def test_update_changes_routes_and_versions_label_them(svc: App, tmp_path: Path) -> None:
    before, toks = await complete(svc, "same prompt, new weights")
    h0 = before["routed_experts"]
    assert h0["weight_version"] == "default"
    assert h0["weight_versions"] == [{"version": "default", "start": 0, "stop": len(toks)}]
    r = await svc.http.post("/reload_weights", json={"weights_path": checkpoint(tmp_path, 7),
                                                     "weight_version": "step-1"})  # fmt: skip
    assert r.json() == {"message": "Weights reloaded", "weight_version": "step-1"}
    after, toks2 = await complete(svc, "same prompt, new weights")
    assert toks2 == toks  # greedy tokens come from the sampler, not the router
    assert after["routed_experts"]["weight_version"] == "step-1"
    r0 = (await svc.http.get(f"/v1/routes/{h0['route_id']}?format=json")).json()
    r1 = (
        await svc.http.get(f"/v1/routes/{after['routed_experts']['route_id']}?format=json")
    ).json()
    assert r0["experts"] != r1["experts"]  # the router changed
    info = svc.backend.info
    want = synthetic_routes(toks, info.num_layers, info.moe_layers, info.num_experts, info.top_k,
                            salts=[7] * len(toks))[:, 1:]  # fmt: skip
    assert np.array_equal(np.asarray(r1["experts"][:-1]), want)


async def test_request_across_an_update_carries_both_versions(
    held_svc: App, tmp_path: Path
) -> None:
    svc, engine = held_svc, held_svc.backend
    assert isinstance(engine, HeldEngine)
    engine.hold_after = 5
    path = checkpoint(tmp_path, 9)
    task = asyncio.create_task(complete(svc, "crossing", max_tokens=30))
    await until(lambda: engine.held == 1, "five tokens under the first weights")
    # Paused with mode=keep, the running request stays frozen through the update.
    assert (await svc.http.post("/pause?mode=keep")).status_code == 200
    engine.let_go()
    await svc.http.post("/reload_weights", json={"weights_path": path, "weight_version": "v2"})
    assert (await svc.http.post("/resume")).status_code == 200
    choice, toks = await task
    h = choice["routed_experts"]
    assert h["status"] == "stored" and h["weight_version"] is None  # mixed: says so
    (a, b) = h["weight_versions"]
    assert a["version"] == "default" and b["version"] == "v2"
    assert a["start"] == 0 and a["stop"] == b["start"] and b["stop"] == len(toks)
    # The prompt's rows and four tokens' were routed by the first weights: the fifth token's row
    # is routed by the next forward, which ran after the update.
    assert a["stop"] == len(choice["prompt_token_ids"]) + 4, a
    # Each row's experts are those of the weights that routed it.
    rec = (await svc.http.get(f"/v1/routes/{h['route_id']}?format=json")).json()
    assert rec["weight_versions"] == [["default", 0, a["stop"]], ["v2", a["stop"], len(toks)]]
    info = svc.backend.info
    salts = [0] * a["stop"] + [9] * (len(toks) - a["stop"])
    want = synthetic_routes(toks, info.num_layers, info.moe_layers, info.num_experts, info.top_k,
                            salts=salts)[:, 1:]  # fmt: skip
    assert np.array_equal(np.asarray(rec["experts"][:-1]), want)


async def test_pause_abort_ends_requests_in_flight(held_svc: App) -> None:
    svc, engine = held_svc, held_svc.backend
    assert isinstance(engine, HeldEngine)
    task = asyncio.create_task(complete(svc, "doomed", max_tokens=200))
    await until(lambda: engine.held == 1, "the request generating")
    # The pause waits for the running request to end; it is let go once the abort is asked.
    pause = asyncio.create_task(svc.http.post("/pause?mode=abort"))
    await until(lambda: engine.abort_requested, "the abort asked of the engine")
    engine.let_go()
    assert (await pause).status_code == 200
    choice, _ = await task
    assert choice["finish_reason"] == "abort"
    await svc.http.post("/resume")


async def test_prefix_fill_never_crosses_versions(svc: App, tmp_path: Path) -> None:
    turn1 = "first turn of a long conversation " * 3
    first, _toks = await complete(svc, turn1)
    assert first["routed_experts"]["status"] == "stored"
    # A second turn that skips the stored prefix's rows: filled from the index (same weights)...
    same, _ = await complete(svc, turn1 + "and more", routed_experts_prompt_start=64)
    assert same["routed_experts"]["num_valid_rows"] == same["routed_experts"]["num_rows"] - 1
    # ...but after an update the old weights' rows must not be used: they stay invalid.
    await svc.http.post("/reload_weights", json={"weights_path": checkpoint(tmp_path, 3),
                                                 "weight_version": "v2"})  # fmt: skip
    other, _ = await complete(svc, turn1 + "and more", routed_experts_prompt_start=64)
    h = other["routed_experts"]
    assert h["status"] == "stored" and h["weight_version"] == "v2"
    assert h["num_valid_rows"] == h["num_rows"] - 1 - 64


async def test_rl_api_needs_an_admin_key(redis_url: str, tmp_path: Path) -> None:
    alice, root = "alice:" + "a" * 20, "ops:" + "r" * 20
    async with running_app(redis_url, api_keys=[alice], admin_keys=[root]) as svc:
        r = await svc.http.post("/pause", headers={"Authorization": "Bearer " + "a" * 20})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert (await svc.http.get("/weight_info")).status_code == 401
        r = await svc.http.get("/weight_info", headers={"Authorization": "Bearer " + "r" * 20})
        assert r.status_code == 200


@pytest.mark.parametrize("path", ["/pause", "/resume", "/reload_weights"])
async def test_rl_calls_count_in_metrics(svc: App, path: str, tmp_path: Path) -> None:
    body = {"weights_path": checkpoint(tmp_path, 1)} if path == "/reload_weights" else None
    await svc.http.post(path, json=body)
    op = path.strip("/").replace("reload_weights", "reload")
    assert await svc.metric(f'routereplay_rl_operations_total{{op="{op}",status="ok"}}') == 1


async def test_without_a_weights_root_no_file_loads(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "step-1").mkdir()
    async with running_app(redis_url, unsafe_no_auth=True) as svc:
        r = await svc.http.post("/reload_weights", json={"weights_path": str(tmp_path / "step-1")})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "weight_loads_disabled", r.text
        assert "--weights-root" in err["message"]
        assert (await svc.http.get("/weight_info")).json() == {"weight_version": "default"}
