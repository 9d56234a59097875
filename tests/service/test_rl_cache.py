"""Weight changes on a busy engine, on the real engine: no request after a weight change reuses
a cached prefix of the old weights, even while another request holds KV blocks (vLLM then
refuses to reset its prefix cache), and every span names the weights that produced its rows.

The probe request shares a 600-token prompt already in the engine's prefix cache. Its layer-0
rows are checked exactly against a transformers reference of the new checkpoint: the router of
layer 0 reads the hidden state after the first attention, which no router before it changes,
and the checkpoints below differ only in their routers, so layer 0 shows whose router routed
each row. Runs on the session's RL engine (``rl_service``), whose weights change.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from routereplay.client import decode_record

from engines import RL_AUTH, RLService, Service

pytestmark = pytest.mark.vllm


def _spans() -> bool:
    """Whether this vLLM's outputs carry weight-version spans (0.32+)."""
    from routereplay.service.engines.vllm_release import probe

    return probe().weight_versions


PROMPT = [40 + (7 * i) % 400 for i in range(600)]  # 4 whole KV blocks of 128, and more
PROBE = PROMPT + list(range(500, 520))


def routers_moved(src: Path, dst: Path, seed: int) -> Path:
    """The tiny model with its routers (``mlp.gate``) moved by ``seed``: routing changes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for k in sd:
        if k.endswith("mlp.gate.weight"):
            sd[k] = sd[k] + 0.7 * torch.randn(sd[k].shape, generator=g, dtype=sd[k].dtype)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def layer0_reference(checkpoint: Path, token_ids: list[int], top_k: int) -> np.ndarray:
    """Layer 0's top-k experts per position under ``checkpoint`` (transformers, float32),
    sorted per row: ``[len(token_ids), top_k]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    gate = model.model.layers[0].mlp.gate
    seen: list[torch.Tensor] = []
    hook = gate.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        hook.remove()
    hidden = seen[0].reshape(len(token_ids), -1)
    logits = hidden @ gate.weight.detach().float().T
    return np.sort(logits.topk(top_k, dim=-1).indices.numpy(), axis=-1)


def complete(c: httpx.Client, model: str, prompt: list[int], rid: str) -> dict:
    r = c.post("/v1/completions", headers={"X-Request-Id": rid}, json={
        "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
        "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def stream_held(service: Service, rid: str, out: dict, started: threading.Event) -> None:
    """A streamed completion that the scheduler's test hold parks after its first tokens, with
    its KV blocks: ``out["handle"]`` is its final ``routed_experts``."""
    body = {"model": service.model, "prompt": list(range(60, 200)), "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    n = 0
    try:
        with httpx.stream("POST", f"{service.url}/v1/completions", json=body, timeout=600,
                          headers={**RL_AUTH, "X-Request-Id": rid}) as r:  # fmt: skip
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                n += 1
                if n >= 2:
                    started.set()
                if choice.get("finish_reason"):
                    out["handle"] = choice["routed_experts"]
    finally:
        started.set()


def resets(c: httpx.Client) -> dict[str, float]:
    text = c.get("/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("routereplay_prefix_cache_resets_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = float(line.rsplit(" ", 1)[1])
    return out


# A reload alone; the pause(keep) / reload / resume flow, where the pause keeps the cache (the
# held request keeps its KV blocks) or clears it (vLLM preempts the running requests to do so).
FLOWS = {"reload": None, "pause-keep-cache": "false", "pause-clear-cache": "true"}


@pytest.mark.parametrize("flow", FLOWS)
def test_after_a_weight_change_no_request_reuses_the_old_weights_cache(
    flow: str, rl_service: RLService, tmp_path: Path
) -> None:
    service = rl_service.service
    clear_cache = FLOWS[flow]
    seed = 21 + list(FLOWS).index(flow)
    ckpt = routers_moved(service.model_path, rl_service.weights_root / tmp_path.name, seed)
    version = f"cache-{flow}"
    held = f"held-cache-{flow}"
    out: dict = {}
    started = threading.Event()
    with rl_service.client() as c:
        top_k = c.get("/v1/models").json()["data"][0]["routed_experts"]["top_k"]
        complete(c, service.model, PROMPT, f"cache-warm-{flow}")  # P's blocks now cached
        before = resets(c)
        t = threading.Thread(target=stream_held, args=(service, held, out, started))
        t.start()
        try:
            assert started.wait(timeout=600), "the held stream did not start"
            if clear_cache is not None:
                pause = c.post("/pause", params={"mode": "keep", "clear_cache": clear_cache})
                assert pause.status_code == 200, pause.text
            r = c.post("/reload_weights", json={"weights_path": str(ckpt),
                                                "weight_version": version})  # fmt: skip
            assert r.json() == {"message": "Weights reloaded", "weight_version": version}, r.text
            if clear_cache is not None:
                assert c.post("/resume").status_code == 200
            probe = complete(c, service.model, PROBE, f"cache-probe-{flow}")
            after = resets(c)
        finally:
            rl_service.release(held)
            t.join(timeout=600)
        rec = decode_record(c.get(f"/v1/routes/cache-probe-{flow}-0").content)
    cached = probe["usage"]["prompt_tokens_details"]["cached_tokens"]
    want = layer0_reference(ckpt, PROBE, top_k)
    got = np.sort(rec.experts[: len(PROBE), 0, :], axis=-1)
    old_rows = int((got != want).any(axis=-1).sum())
    assert (cached, old_rows) == (0, 0), (
        f"{cached} prompt tokens came from the prefix cache, and {old_rows} of {len(PROBE)} "
        f"prompt rows carry other weights' routing, all labelled {rec.weight_versions}"
    )
    assert rec.weight_versions == ((version, 0, rec.num_tokens),), rec.weight_versions
    if clear_cache != "true":
        # The held request kept its blocks: vLLM refused the reset, and /metrics says so.
        assert after.get("refused", 0) > before.get("refused", 0), (before, after)
    # The request frozen across the load finished under both labels (vLLM 0.32+; before it the
    # engine's outputs carry no spans, and a route that crossed a change is unknown).
    if _spans():
        spans = [s["version"] for s in out["handle"]["weight_versions"]]
        assert spans[-1] == version and len(spans) == 2, out["handle"]
    else:
        handle = out["handle"]
        assert (handle["weight_version"], handle["weight_versions"]) == (None, None), handle
