"""What the capture needs to know about a model: which layers are MoE, experts, top-k.

vLLM returns a row for EVERY transformer layer, dense ones as zeros; the record keeps only the MoE
layers, by GLOBAL index, so the layout must come from the model config, never from an offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelInfo", "moe_layout"]


@dataclass(frozen=True)
class ModelInfo:
    """Served model: its name, route shape and context limit."""

    name: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    max_model_len: int
    # Where the weights came from (vLLM's model card ``root``: a path or hub name).
    root: str | None = None
    # Longest vocabulary entry in UTF-8 bytes (>= the bytes any one token decodes to), so a
    # prompt of C characters has at least C / max_token_bytes tokens: over-long prompts are
    # refused before the chat template and the tokenizer spend time on them. None: unknown.
    max_token_bytes: int | None = None


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def moe_layout(cfg: Any) -> tuple[int, tuple[int, ...], int, int]:
    """``(num_layers, moe_layers, num_experts, top_k)`` of a Hugging Face config (object or dict).

    Known conventions: Qwen2/3-MoE ``mlp_only_layers`` + ``decoder_sparse_step``;
    DeepSeek-V2/V3, Kimi, GLM-4.5 ``first_k_dense_replace`` + ``moe_layer_freq``; Mixtral and
    gpt-oss: every layer. Multimodal configs are unwrapped through ``text_config``.
    """
    text = _get(cfg, "text_config")
    if text is not None:
        cfg = text
    num_layers = int(_get(cfg, "num_hidden_layers"))
    num_experts = _get(cfg, "num_experts") or _get(cfg, "n_routed_experts")
    num_experts = num_experts or _get(cfg, "num_local_experts")
    top_k = _get(cfg, "num_experts_per_tok") or _get(cfg, "moe_topk") or _get(cfg, "top_k")
    if not num_experts or not top_k:
        raise ValueError("model config has no routed experts (num_experts/num_experts_per_tok)")
    if _get(cfg, "first_k_dense_replace") is not None:
        k = int(_get(cfg, "first_k_dense_replace"))
        freq = int(_get(cfg, "moe_layer_freq", 1) or 1)
        moe = [i for i in range(num_layers) if i >= k and i % freq == 0]
    else:
        dense_only = set(_get(cfg, "mlp_only_layers", None) or [])
        step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
        # Qwen2/3-MoE's rule (modeling_qwen3_moe.Qwen3MoeDecoderLayer).
        moe = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
    return num_layers, tuple(moe), int(num_experts), int(top_k)
