"""Engine-free parts of the service: layouts, settings, protocol, inline format, setup, model."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from routereplay.service.capture import npy_base64
from routereplay.service.cli import settings_from_argv
from routereplay.service.model_info import moe_layout
from routereplay.service.protocol import ChatCompletionRequest, CompletionRequest
from routereplay.service.tiny_model import build_tiny_model
from routereplay.service.vllm_patches import cpu_setup


@pytest.mark.parametrize(
    ("cfg", "want"),
    [
        # Qwen3-MoE: all MoE / dense first layer / every second layer MoE.
        ({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}, (0, 1, 2, 3)),
        ({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
          "mlp_only_layers": [0]}, (1, 2, 3)),
        ({"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 2,
          "decoder_sparse_step": 2}, (1, 3, 5)),
        # DeepSeek-V3: first_k_dense_replace dense layers, then MoE.
        ({"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8,
          "first_k_dense_replace": 3, "moe_layer_freq": 1}, tuple(range(3, 61))),
        # Mixtral: every layer, experts under another name.
        ({"num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2}, (0, 1)),
        # Multimodal wrapper.
        ({"text_config": {"num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 1,
                          "mlp_only_layers": [2]}}, (0, 1)),
    ],
)  # fmt: skip
def test_moe_layout(cfg: dict, want: tuple[int, ...]) -> None:
    _, moe, num_experts, top_k = moe_layout(cfg)
    assert moe == want and num_experts >= 4 and top_k >= 1


def test_moe_layout_refuses_dense_model() -> None:
    with pytest.raises(ValueError, match="no routed experts"):
        moe_layout({"num_hidden_layers": 2})


def test_settings_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_PORT", "9100")
    monkeypatch.setenv("ROUTEREPLAY_REDIS_URL", "redis://env:1/0")
    s = settings_from_argv(["--redis-url", "redis://flag:2/0", "--engine-args", '{"a": 1}'])
    assert s.port == 9100 and s.redis_url == "redis://flag:2/0" and s.engine_args == {"a": 1}
    assert settings_from_argv(["--no-enforce-eager"]).enforce_eager is False
    assert s.resolved_model_name() == "tiny-qwen3-moe-moe"


def test_protocol_validation_names_fields() -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [], "max_tokens": 1})
    assert e.value.errors()[0]["loc"] == ("messages",)
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", ""]})
    assert e.value.errors()[0]["loc"] == ("prompt",)
    assert "prompt 1 is empty" in e.value.errors()[0]["msg"]
    r = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2, 3]], "x_vendor": 1})
    assert r.prompts == [[1, 2, 3]] and r.model_extra == {"x_vendor": 1}
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompts == [[5, 6]]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
        )


def test_inline_format_is_vllms() -> None:
    a = np.random.default_rng(0).integers(0, 8, size=(5, 4, 2)).astype(np.uint8)
    back = np.load(io.BytesIO(base64.b64decode(npy_base64(a))), allow_pickle=False)
    assert back.dtype == np.uint8 and np.array_equal(a, back)


def test_cpu_setup_idempotent(tmp_path: Path) -> None:
    assert not cpu_setup.is_installed(tmp_path)
    d1 = cpu_setup.install(tmp_path)
    d2 = cpu_setup.install(tmp_path)
    assert d1 == d2 and cpu_setup.is_installed(tmp_path)
    assert (
        "cpu = routereplay.service.vllm_patches.triton_cpu" in (d1 / "entry_points.txt").read_text()
    )
    assert cpu_setup.remove(tmp_path) and not cpu_setup.is_installed(tmp_path)


def test_triton_cpu_backend_only_active_under_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Through Triton's own entry-point discovery, as vLLM's processes load it (importing the
    # backend modules directly first would be a circular import through triton.backends).
    from triton.backends import backends

    if not cpu_setup.is_installed():
        pytest.fail(
            "run `python -m routereplay.service.vllm_patches.cpu_setup` (scripts/setup.sh does)"
        )
    CpuInterpreterBackend, CpuInterpreterDriver = backends["cpu"].compiler, backends["cpu"].driver

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not CpuInterpreterDriver.is_active()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert CpuInterpreterDriver.is_active()
    t = CpuInterpreterDriver().get_current_target()
    # No compiling: torch inductor must keep its C++ path.
    assert t.backend == "cpu" and not CpuInterpreterBackend.supports_target(t)


def test_tiny_model_build_is_deterministic(tmp_path: Path) -> None:
    def digest(d: Path) -> dict[str, str]:
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.iterdir())
            if p.suffix in (".safetensors", ".json")
        }

    a = digest(build_tiny_model(tmp_path / "a", "dense-first"))
    b = digest(build_tiny_model(tmp_path / "b", "dense-first"))
    assert a == b and "model.safetensors" in a
    import json

    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [0] and moe_layout(cfg)[1:] == ((1, 2, 3), 8, 2)
