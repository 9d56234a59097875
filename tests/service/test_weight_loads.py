"""File-based weight loads on the real engine: only checkpoint directories under --weights-root
load, every one is checked before the engine's weights are touched, and no bad path or bad
checkpoint changes what serves. Each refused load is followed by a completion that must succeed
under the weights that served before it.

Runs on the session's RL engine (``rl_service``): it reloads weights (see test_rl_loop's note on
in-place reloads)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from routereplay.bench.servers import engine_env

from engines import MODEL_NAME as MODEL
from engines import RLService, Service

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent


def save(dst: Path, tensors: dict, **config_changes: object) -> Path:
    """A copy of the served checkpoint with ``tensors`` as its weights."""
    from safetensors.torch import save_file

    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return dst


def bad_checkpoints(root: Path, model: Path) -> list[tuple[str, str, str]]:
    """(weights_path, expected error code, words the message must hold) for each bad input, made
    in ``root``, a directory directly under the weights root."""
    import torch
    from safetensors.torch import load_file

    sd = load_file(model / "model.safetensors")
    sub = root.name + "/"  # the paths below, relative to the weights root

    def copy(name: str) -> Path:
        return Path(shutil.copytree(model, root / name))

    (root / "empty").mkdir()
    (root / "a-file").write_text("not a directory")
    os.symlink(model, root / "link-out")  # a link to a checkpoint outside the root
    os.symlink("/etc", root / "etc-link")
    garbage = copy("garbage")
    (garbage / "model.safetensors").write_bytes(os.urandom(4096))
    trunc = copy("truncated")
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) - 1000])
    big = next(k for k in sd if k.endswith("mlp.gate.weight"))
    save(copy("wrong-shape"), {**sd, big: torch.zeros(sd[big].shape[0] + 1, sd[big].shape[1])})
    save(copy("wrong-dtype"), {**sd, big: sd[big].to(torch.bfloat16)})
    save(copy("missing-tensor"), {k: v for k, v in sd.items() if k != big})
    save(copy("extra-tensor"), {**sd, "model.extra.weight": torch.zeros(2)})
    cfg = json.loads((model / "config.json").read_text())
    save(copy("wrong-config"), sd, num_experts_per_tok=cfg["num_experts_per_tok"] + 1)
    save(copy("wrong-arch"), sd, architectures=["LlamaForCausalLM"], model_type="llama")
    (copy("no-config") / "config.json").unlink()
    file_link = copy("file-link-out")
    (file_link / "model.safetensors").unlink()
    os.symlink(model / "model.safetensors", file_link / "model.safetensors")
    pickle_only = copy("pickle-only")
    (pickle_only / "model.safetensors").rename(pickle_only / "pytorch_model.bin")
    return [
        ("/etc/passwd", "outside_weights_root", "outside the weights root"),
        ("../../../../etc", "outside_weights_root", "outside the weights root"),
        (str(model), "outside_weights_root", "outside the weights root"),
        (sub + "link-out", "outside_weights_root", "outside the weights root"),
        (sub + "etc-link", "outside_weights_root", "outside the weights root"),
        ("Qwen/Qwen3-30B-A3B", "not_a_checkpoint", "does not exist"),
        (sub + "missing", "not_a_checkpoint", "does not exist"),
        (sub + "a-file", "not_a_checkpoint", "is not a directory"),
        (sub + "empty", "bad_checkpoint", "config.json is missing"),
        (sub + "no-config", "bad_checkpoint", "config.json is missing"),
        (sub + "pickle-only", "not_a_checkpoint", "no *.safetensors"),
        (sub + "file-link-out", "outside_weights_root", "links out of the weights root"),
        (sub + "garbage", "bad_checkpoint", "model.safetensors"),
        (sub + "truncated", "truncated_checkpoint", "truncated"),
        (sub + "wrong-shape", "checkpoint_mismatch", f"tensor '{big}' is F32"),
        (sub + "wrong-dtype", "checkpoint_mismatch", f"tensor '{big}' is BF16"),
        (sub + "missing-tensor", "checkpoint_mismatch", f"tensor '{big}' is missing"),
        (sub + "extra-tensor", "checkpoint_mismatch", "'model.extra.weight' is not in the served"),
        (sub + "wrong-config", "checkpoint_mismatch", "config num_experts_per_tok is 3"),
        (sub + "wrong-arch", "checkpoint_mismatch", "config architectures is ['LlamaForCausalLM']"),
        ("a\x00b", "bad_checkpoint", "not a usable path"),
        ("x" * 5000, "not_a_checkpoint", "does not exist"),
    ]


def complete(c: httpx.Client, service: Service) -> str:
    """A completion that must succeed; the weight version its route names."""
    r = c.post("/v1/completions", json={"model": service.model, "prompt": "The weights are",
                                        "max_tokens": 3, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    handle = r.json()["choices"][0]["routed_experts"]
    assert handle["status"] == "stored"
    return handle["weight_version"]


def test_every_bad_load_is_a_400_and_the_old_weights_keep_serving(
    rl_service: RLService, tiny_model: Path
) -> None:
    service, proc = rl_service.service, rl_service.proc
    d = rl_service.weights_root / "weight-loads"
    d.mkdir()
    cases = bad_checkpoints(d, tiny_model)
    shutil.copytree(tiny_model, d / "step-1")
    with rl_service.client() as c:
        r = c.post("/reload_weights", json={"weights_path": f"{d.name}/step-1",
                                            "weight_version": "step-1"})  # fmt: skip
        assert r.json() == {"message": "Weights reloaded", "weight_version": "step-1"}, r.text
        for path, code, words in cases:
            r = c.post("/reload_weights", json={"weights_path": path, "weight_version": "bad"})
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["param"]) == (400, code, "weights_path"), (
                path[:80], r.text)  # fmt: skip
            assert words in err["message"], (path[:80], err["message"])
            assert c.get("/weight_info").json() == {"weight_version": "step-1"}
            assert complete(c, service) == "step-1", path[:80]
        assert proc.poll() is None


def test_the_embedded_default_keeps_the_rl_api_closed(http: httpx.Client, tiny_model: Path) -> None:
    """The pytest session's service is the README's command: no keys, no --weights-root. No
    call may load weights or pause it, and it serves on."""
    calls = [("POST", "/reload_weights", {"weights_path": str(tiny_model)}),
             ("POST", "/pause", None), ("GET", "/weight_info", None)]  # fmt: skip
    for method, path, body in calls:
        r = http.request(method, path, json=body)
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (403, "permission_denied"), (path, r.text)
        assert "--admin-keys" in err["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "still", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_load_failing_in_the_engine_restores_the_last_good_weights_or_stops(
    tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    script = HERE / "_reload_restore.py"
    argv = [sys.executable, str(script), str(tiny_model), str(tmp_path), redis_url]
    p = subprocess.run(argv, capture_output=True, text=True, env=engine_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    status, code, message = out["load_error"]
    assert (status, code) == (400, "checkpoint_load_failed"), message
    assert "previous weights ('default') are restored" in message
    assert out["same_routes"] and out["versions"] == ["default", "default"]
    # Against the first load, near-ties may flip (0.906 of rows equal measured); other weights
    # would leave almost no row equal (4 layers of top-2 of 8 experts).
    assert out["rows_like_first_load"] > 0.5, out["rows_like_first_load"]
    assert out["dead_after_restore"] is False
    assert out["good_reload"] == {"message": "Weights reloaded", "weight_version": "step-good"}
    status, code, message = out["fatal_error"]
    assert (status, code) == (503, "engine_dead") and "exits with status 3" in message
    assert out["dead"] is True and out["completion_after_fatal"] == 503
    assert len(out["on_fatal"]) == 1
