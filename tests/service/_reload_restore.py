"""A weight load that fails inside the real engine, after the checks: run by test_weight_loads.py
in a process of its own (it boots an engine in process).

    python _reload_restore.py MODEL_DIR WEIGHTS_ROOT REDIS_URL  ->  one JSON object on stdout

A checkpoint that changes on disk between the service's checks and the engine's read reaches
the engine unchecked; this script gets there by calling the backend's load step directly with a
truncated checkpoint. First the last good weights must come back (same routes, same version,
the engine alive); then, with the last good checkpoint deleted, the backend must declare itself
dead and the app's watcher must call ``on_fatal`` (``routereplay serve`` then exits with 3).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx

from routereplay.client import AsyncRouteStore
from routereplay.service import Settings, create_app
from routereplay.service.engines.checkpoints import CheckpointError
from routereplay.service.engines.vllm import VllmBackend
from routereplay.service.errors import EngineUnavailableError

NAME = "tiny-restore"


def truncated(model: Path, dst: Path) -> Path:
    shutil.copytree(model, dst)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return dst


async def route(http: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    r = await http.post(
        "/v1/completions",
        headers={"X-Request-Id": rid},
        json={"model": NAME, "prompt": list(range(40, 100)), "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = (await http.get(f"/v1/routes/{rid}-0?format=json")).json()
    return {"version": choice["routed_experts"]["weight_version"], "experts": got["experts"]}


def _share_equal(a: list, b: list) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


async def main(model: Path, root: Path, redis_url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    backend = VllmBackend(str(model), served_model_name=NAME, dtype="float32")
    await backend.start()
    settings = Settings(redis_url=redis_url, route_prefix="restore", weights_root=root,
                        engine_death_grace_s=0.1, unsafe_no_auth=True)  # fmt: skip
    fatal: list[str] = []
    store = AsyncRouteStore.from_url(redis_url, prefix="restore")
    app = create_app(settings, backend=backend, store=store, on_fatal=fatal.append)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as http,
        ):
            rl = backend.rl
            before = await route(http, "before")
            await rl._served_checkpoint()  # type: ignore[attr-defined]
            try:
                await rl._load(truncated(model, root / "trunc"), root)  # type: ignore[attr-defined]
            except CheckpointError as e:
                out["load_error"] = [e.status_code, e.code, e.message]
            after = await route(http, "after")
            # vLLM's in-place reload is not bit-identical to its first load (a near-tie may
            # flip), so the reference is the same weights reloaded by a load that succeeds.
            shutil.copytree(model, root / "again")
            await http.post("/reload_weights", json={"weights_path": "again"})
            again = await route(http, "again")
            out["same_routes"] = after["experts"] == again["experts"]
            out["rows_like_first_load"] = _share_equal(after["experts"], before["experts"])
            out["versions"] = [before["version"], after["version"]]
            out["dead_after_restore"] = backend.dead

            good = root / "good"
            shutil.copytree(model, good)
            body = {"weights_path": "good", "weight_version": "step-good"}
            r = await http.post("/reload_weights", json=body)
            out["good_reload"] = r.json()
            shutil.rmtree(good)  # the last good weights are gone: nothing to restore
            try:
                await rl._load(root / "trunc", root)  # type: ignore[attr-defined]
            except EngineUnavailableError as e:
                out["fatal_error"] = [e.status_code, e.code, e.message]
            out["dead"] = backend.dead
            r = await http.post("/v1/completions", json={"model": NAME, "prompt": "x"})
            out["completion_after_fatal"] = r.status_code
            for _ in range(100):
                if fatal:
                    break
                await asyncio.sleep(0.05)
            out["on_fatal"] = fatal
    finally:
        await store.close()
        await backend.close()
    return out


if __name__ == "__main__":
    model, root, url = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    print(json.dumps(asyncio.run(main(model, root, url))))
