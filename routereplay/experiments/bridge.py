"""Qwen3-MoE between Hugging Face checkpoints and a Megatron-Core ``GPTModel``.

``hf_config`` is the checkpoint's ``config.json`` (a dict). :func:`build_model` makes the
Megatron model of that config (local layer spec: no Transformer Engine needed, so it runs on CPU
and on GPUs without TE), :func:`load_hf_weights` copies a Hugging Face state dict into it and
:func:`export_hf_weights` goes back, so weights trained in Megatron can be served again by vLLM
(``save_hf_checkpoint`` writes a directory vLLM's ``reload_weights`` takes).

The mapping is by name and layout, for any Qwen3-MoE shape (GQA, ``mlp_only_layers`` /
``decoder_sparse_step`` dense layers, ``norm_topk_prob``, untied or tied embeddings); it is checked
by comparing logits with Hugging Face transformers on the same input (``tests/experiments``).
Why not a bridge from PyPI: ``megatron-bridge`` and ``mbridge`` build models with Transformer
Engine layer names (``linear_qkv.layer_norm_weight``) and move weights to CUDA; neither runs on
this CPU machine, and TE is not on the GPU machine either.

Megatron-Core assumes CUDA in a few places even for CPU models; :func:`cpu_shims` patches them
(``torch.cuda.current_device`` -> "cpu", the CUDA RNG state saved by recompute, 0.16's
``te_general_gemm`` name). They are process-wide: call it only in a CPU trainer process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "build_model",
    "causal_mask",
    "cpu_shims",
    "export_hf_weights",
    "init_megatron",
    "load_hf_weights",
    "megatron_config",
    "moe_layers_of",
    "save_hf_checkpoint",
]


def cpu_shims() -> None:
    """Let megatron-core run a MoE GPTModel on CPU (see the module docstring)."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def init_megatron(device: torch.device, seed: int = 0) -> None:
    """A single-process model-parallel world (gloo on CPU, NCCL on GPU)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        if "MASTER_PORT" not in os.environ:
            from routereplay.local_redis import free_port

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if device.type == "cpu":
            cpu_shims()
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    kw = {"inference_rng_tracker": True} if device.type == "cpu" else {}
    tensor_parallel.model_parallel_cuda_manual_seed(seed, **kw)
    torch.manual_seed(seed)


def moe_layers_of(hf_config: dict[str, Any]) -> list[int]:
    """Global 0-based MoE layers (Qwen2/3-MoE's rule: not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``)."""
    n = int(hf_config["num_hidden_layers"])
    dense = set(hf_config.get("mlp_only_layers") or [])
    step = int(hf_config.get("decoder_sparse_step") or 1)
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _rope_theta(c: dict[str, Any]) -> float:
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return float(rp.get("rope_theta") or c.get("rope_theta") or 10000.0)


def megatron_config(
    hf_config: dict[str, Any],
    *,
    dtype: torch.dtype = torch.float32,
    routing_replay: bool = True,
    cpu: bool = True,
    **overrides: Any,
) -> Any:
    """The Megatron ``TransformerConfig`` of a Qwen3-MoE Hugging Face config."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    c = hf_config
    moe = set(moe_layers_of(c))
    n = int(c["num_hidden_layers"])
    kw: dict[str, Any] = dict(
        num_layers=n,
        hidden_size=int(c["hidden_size"]),
        num_attention_heads=int(c["num_attention_heads"]),
        num_query_groups=int(c["num_key_value_heads"]),
        kv_channels=int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
        ffn_hidden_size=int(c["intermediate_size"]),
        moe_ffn_hidden_size=int(c["moe_intermediate_size"]),
        num_moe_experts=int(c.get("num_experts") or c["num_local_experts"]),
        moe_router_topk=int(c["num_experts_per_tok"]),
        moe_layer_freq=[1 if i in moe else 0 for i in range(n)],
        # Qwen3: softmax over the top-k logits when norm_topk_prob, else top-k of the softmax.
        moe_router_pre_softmax=not bool(c.get("norm_topk_prob", True)),
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_enable_routing_replay=routing_replay,
        normalization="RMSNorm",
        layernorm_epsilon=float(c.get("rms_norm_eps", 1e-6)),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(c.get("attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=cpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def _replace_in_spec(obj: Any, old: type, new: type) -> None:
    """Swap module class ``old`` for ``new`` throughout a Megatron layer spec."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, ModuleSpec):
        if obj.module is old:
            obj.module = new
        _replace_in_spec(obj.submodules, old, new)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is old:
                setattr(obj, f.name, new)
            else:
                _replace_in_spec(v, old, new)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _replace_in_spec(x, old, new)


def build_model(
    hf_config: dict[str, Any],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    routing_replay: bool = True,
    core_attention: type | None = None,
    **overrides: Any,
) -> Any:
    """A Megatron ``GPTModel`` of ``hf_config`` (random weights; see :func:`load_hf_weights`).

    Needs :func:`init_megatron` first. Rotary embeddings as Qwen3 (rotate-half, ``rope_theta``),
    applied by Megatron; or, with ``core_attention`` (a module in place of Megatron's core
    attention, e.g. :class:`~.packing.PackedAttention` for packed layouts), by that module.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    device = torch.device(device)
    cfg = megatron_config(
        hf_config, dtype=dtype, routing_replay=routing_replay, cpu=device.type == "cpu",
        **overrides,
    )  # fmt: skip
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    if core_attention is not None:
        _replace_in_spec(spec, DotProductAttention, core_attention)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=int(hf_config["vocab_size"]),
        max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
        position_embedding_type="rope" if core_attention is None else "none",
        rotary_base=int(_rope_theta(hf_config)),
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        pre_process=True,
        post_process=True,
    )
    return model.to(device=device, dtype=dtype)


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's attention mask for a causal ``[B, S]`` batch: True where attention is masked."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


# -- weights ---------------------------------------------------------------------------------------
def _qkv_groups(c: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(c["num_attention_heads"])
    groups = int(c["num_key_value_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    return heads, groups, head_dim


def _fuse_qkv(c: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's ``linear_qkv``: per query group, its query heads then its key then its value."""
    heads, groups, hd = _qkv_groups(c)
    per = heads // groups
    q = q.reshape(groups, per * hd, -1)
    k = k.reshape(groups, hd, -1)
    v = v.reshape(groups, hd, -1)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * hd, -1)


def _split_qkv(
    c: dict[str, Any], qkv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups, hd = _qkv_groups(c)
    per = heads // groups
    g = qkv.reshape(groups, (per + 2) * hd, -1)
    q = g[:, : per * hd].reshape(heads * hd, -1)
    k = g[:, per * hd : (per + 1) * hd].reshape(groups * hd, -1)
    v = g[:, (per + 1) * hd :].reshape(groups * hd, -1)
    return q, k, v


def _pairs(c: dict[str, Any]) -> list[tuple[str, str]]:
    """(Megatron name, HF name) of every tensor mapped one to one."""
    out = [("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
           ("decoder.final_layernorm.weight", "model.norm.weight")]  # fmt: skip
    if not c.get("tie_word_embeddings", False):
        out.append(("output_layer.weight", "lm_head.weight"))
    for i in range(int(c["num_hidden_layers"])):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        out += [
            (f"{m}.input_layernorm.weight", f"{h}.input_layernorm.weight"),
            (f"{m}.self_attention.q_layernorm.weight", f"{h}.self_attn.q_norm.weight"),
            (f"{m}.self_attention.k_layernorm.weight", f"{h}.self_attn.k_norm.weight"),
            (f"{m}.self_attention.linear_proj.weight", f"{h}.self_attn.o_proj.weight"),
            (f"{m}.pre_mlp_layernorm.weight", f"{h}.post_attention_layernorm.weight"),
        ]
    return out


def load_hf_weights(
    model: Any, hf_state: dict[str, torch.Tensor], hf_config: dict[str, Any]
) -> None:
    """Copy a Hugging Face Qwen3-MoE state dict into ``model`` (every Megatron tensor is set;
    a missing or misshapen one raises, naming it)."""
    c = hf_config
    moe = set(moe_layers_of(c))
    params = dict(model.named_parameters())
    done: set[str] = set()

    def put(name: str, value: torch.Tensor) -> None:
        p = params.get(name)
        if p is None:
            raise KeyError(f"the Megatron model has no parameter {name}")
        if tuple(p.shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: Megatron shape {tuple(p.shape)}, HF gives {tuple(value.shape)}"
            )
        with torch.no_grad():
            p.copy_(value.to(p.dtype))
        done.add(name)

    for m, h in _pairs(c):
        put(m, hf_state[h])
    for i in range(int(c["num_hidden_layers"])):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        a = f"{h}.self_attn"
        put(f"{m}.self_attention.linear_qkv.weight",
            _fuse_qkv(c, hf_state[f"{a}.q_proj.weight"], hf_state[f"{a}.k_proj.weight"],
                      hf_state[f"{a}.v_proj.weight"]))  # fmt: skip
        if i in moe:
            put(f"{m}.mlp.router.weight", hf_state[f"{h}.mlp.gate.weight"])
            for j in range(int(c.get("num_experts") or c["num_local_experts"])):
                e, x = f"{m}.mlp.experts.local_experts.{j}", f"{h}.mlp.experts.{j}"
                gate_up = [hf_state[f"{x}.gate_proj.weight"], hf_state[f"{x}.up_proj.weight"]]
                put(f"{e}.linear_fc1.weight", torch.cat(gate_up))
                put(f"{e}.linear_fc2.weight", hf_state[f"{x}.down_proj.weight"])
        else:
            gate_up = [hf_state[f"{h}.mlp.gate_proj.weight"], hf_state[f"{h}.mlp.up_proj.weight"]]
            put(f"{m}.mlp.linear_fc1.weight", torch.cat(gate_up))
            put(f"{m}.mlp.linear_fc2.weight", hf_state[f"{h}.mlp.down_proj.weight"])
    left = sorted(set(params) - done)
    if left:
        raise KeyError(f"Megatron parameters not set from the checkpoint: {left[:8]}")


def export_hf_weights(model: Any, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of ``model`` (the inverse of :func:`load_hf_weights`)."""
    c = hf_config
    moe = set(moe_layers_of(c))
    params = {k: v.detach().to("cpu") for k, v in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for m, h in _pairs(c):
        out[h] = params[m]
    for i in range(int(c["num_hidden_layers"])):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        q, k, v = _split_qkv(c, params[f"{m}.self_attention.linear_qkv.weight"])
        out[f"{h}.self_attn.q_proj.weight"] = q
        out[f"{h}.self_attn.k_proj.weight"] = k
        out[f"{h}.self_attn.v_proj.weight"] = v
        if i in moe:
            out[f"{h}.mlp.gate.weight"] = params[f"{m}.mlp.router.weight"]
            for j in range(int(c.get("num_experts") or c["num_local_experts"])):
                e, x = f"{m}.mlp.experts.local_experts.{j}", f"{h}.mlp.experts.{j}"
                gate, up = params[f"{e}.linear_fc1.weight"].chunk(2)
                out[f"{x}.gate_proj.weight"], out[f"{x}.up_proj.weight"] = gate, up
                out[f"{x}.down_proj.weight"] = params[f"{e}.linear_fc2.weight"]
        else:
            gate, up = params[f"{m}.mlp.linear_fc1.weight"].chunk(2)
            out[f"{h}.mlp.gate_proj.weight"], out[f"{h}.mlp.up_proj.weight"] = gate, up
            out[f"{h}.mlp.down_proj.weight"] = params[f"{m}.mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def load_hf_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json, state dict)`` of a safetensors checkpoint directory, or of
    ``train_tiny train``'s output (``config.json`` + ``weights.pt``, bf16 values that float32
    holds exactly: the same model as the directory ``train_tiny finish`` makes of it)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    if not state and (path / "weights.pt").is_file():
        pt = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
        state = {k: v.float() for k, v in pt.items()}
    return cfg, state


def save_hf_checkpoint(
    model: Any, hf_config: dict[str, Any], src: str | Path, out: str | Path
) -> Path:
    """Write ``model``'s weights as a Hugging Face checkpoint directory at ``out``: the config and
    tokenizer files of ``src`` plus ``model.safetensors`` in the config's dtype (what vLLM's
    ``reload_weights`` loads)."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != "model.safetensors.index.json"
        ):
            shutil.copy2(f, out / f.name)
    dtype = getattr(torch, str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"))
    state = {k: v.to(dtype) for k, v in export_hf_weights(model, hf_config).items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out
