"""Checkpoint directories a weight load may read, checked before the engine touches them.

A file-based weight load (``POST /reload_weights``) names a directory under the configured
``weights_root``; nothing else is read (never a hub id, never a link out of the root). vLLM's
in-place reload releases the model's tensors before it reads the new ones, so a checkpoint it
cannot load leaves an engine that dies on its next step: every check that can fail runs here,
first, on the safetensors headers (no tensor data is read):

- :func:`resolve_checkpoint`: the path, resolved inside the root, is a readable directory;
- :func:`read_checkpoint`: ``config.json`` and the safetensors files vLLM would load (the index's
  files, or every ``*.safetensors``), each header well formed and covering its file exactly;
- :func:`check_compatible`: the architecture and every config field that fixes a shape equal the
  served model's, and every tensor the served checkpoint has is present with its shape and dtype.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidRequestError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "TensorInfo",
    "check_compatible",
    "read_checkpoint",
    "resolve_checkpoint",
]

# Config fields that fix a parameter's shape, or the routes' shape (top-k, MoE layer pattern).
SHAPE_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_local_experts",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "decoder_sparse_step",
    "mlp_only_layers", "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "tie_word_embeddings", "n_group",
    "topk_group", "norm_topk_prob",
)  # fmt: skip

# Bytes per element of each safetensors dtype (the format's own list).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # the safetensors library refuses larger headers
INDEX = "model.safetensors.index.json"


class CheckpointError(InvalidRequestError):
    """A weight load refused before the engine was touched (400, ``param: weights_path``)."""

    default_code = "bad_checkpoint"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(f"weights_path: {message}", param="weights_path", code=code)


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]


def resolve_checkpoint(weights_path: str, root: Path | None) -> Path:
    """``weights_path`` (absolute, or relative to ``root``) as a real directory inside ``root``.

    Links are resolved before the check, so a link (the directory or any part of its path) that
    leads out of the root is refused like a path that is outside it."""
    if root is None:
        raise CheckpointError(
            "file-based weight loads are off: start the service with --weights-root DIR (or "
            "ROUTEREPLAY_WEIGHTS_ROOT) to load checkpoint directories under DIR",
            code="weight_loads_disabled",
        )
    try:
        real_root = Path(os.path.realpath(root))
        path = Path(os.path.realpath(real_root / weights_path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{weights_path!r} is not a usable path ({e})") from e
    if not _inside(path, real_root):
        raise CheckpointError(
            f"{weights_path!r} is outside the weights root {str(real_root)!r} (links resolved)",
            code="outside_weights_root",
        )
    if not _is_dir(real_root):
        raise CheckpointError(f"the weights root {str(real_root)!r} is not a directory")
    if not _is_dir(path):
        what = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise CheckpointError(
            f"{weights_path!r} {what}: a checkpoint is a directory under the weights root",
            code="not_a_checkpoint",
        )
    return path


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long, a loop: not a checkpoint either way
        return False


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def read_checkpoint(path: Path, root: Path | None = None) -> Checkpoint:
    """Read ``path``'s config and safetensors headers; raise :class:`CheckpointError` naming the
    first file that is missing, unreadable, malformed, truncated, or (with ``root``) a link out
    of ``root``."""
    config = _read_json(path / "config.json", root)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'} is not a JSON object")
    tensors: dict[str, TensorInfo] = {}
    for f in _weight_files(path, root):
        for name, info in _read_header(f).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {f}")
            tensors[name] = info
    return Checkpoint(path, config, tensors)


def _weight_files(path: Path, root: Path | None) -> list[Path]:
    """The files vLLM's default loader reads: the index's, else every top-level safetensors."""
    if (path / INDEX).exists():
        index = _read_json(path / INDEX, root)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{path / INDEX} has no weight_map of tensor -> file")
        files = [path / name for name in sorted(set(wmap.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{path} holds no *.safetensors files (only safetensors checkpoints load here)",
            code="not_a_checkpoint",
        )
    for f in files:
        _check_file(f, root)
    return files


def _check_file(f: Path, root: Path | None) -> None:
    real = Path(os.path.realpath(f))
    if root is not None and not _inside(real, Path(os.path.realpath(root))):
        raise CheckpointError(f"{f} links out of the weights root", code="outside_weights_root")
    if not real.is_file():
        raise CheckpointError(f"{f} is missing or not a regular file")
    if not os.access(real, os.R_OK):
        raise CheckpointError(f"{f} is not readable")


def _read_json(f: Path, root: Path | None) -> Any:
    _check_file(f, root)
    try:
        with open(f, "rb") as fh:
            raw = fh.read(MAX_HEADER_BYTES + 1)
        if len(raw) > MAX_HEADER_BYTES:
            raise CheckpointError(f"{f} is larger than {MAX_HEADER_BYTES} bytes")
        return json.loads(raw)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f} is not readable JSON ({e})") from e


def _read_header(f: Path) -> dict[str, TensorInfo]:
    """A safetensors header, checked as the format defines it: every tensor's byte range matches
    its dtype and shape, and the ranges cover the data section exactly (a truncated or padded
    file fails here)."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{f} is not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{f} is not a safetensors file, or truncated (header {n})")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f} has no readable safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{f}: __metadata__ must map strings to strings")
    out = {name: _tensor(f, name, entry) for name, entry in header.items()}
    _check_coverage(f, header, size - 8 - n)
    _open_as_vllm_does(f)
    return out


def _open_as_vllm_does(f: Path) -> None:
    """The safetensors library's own checks, the reader vLLM's loader uses (headers only)."""
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="np") as st:
            st.keys()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the library's Rust panics are BaseExceptions
        raise CheckpointError(f"{f} is refused by the safetensors library ({e})") from e


def _tensor(f: Path, name: str, entry: Any) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = dtype in DTYPE_BYTES and all(isinstance(d, int) and d >= 0 for d in shape)
        ok = ok and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        ok = ok and end - begin == math.prod(shape) * DTYPE_BYTES[dtype]
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{f}: tensor {name!r} has a malformed header entry {entry!r}")
    return TensorInfo(dtype, tuple(shape), f.name)


def _check_coverage(f: Path, header: dict[str, Any], data_bytes: int) -> None:
    at = 0
    for begin, end in sorted(tuple(e["data_offsets"]) for e in header.values()):
        if begin != at:
            raise CheckpointError(f"{f}: tensor data overlaps or leaves a gap at byte {at}")
        at = end
    if at != data_bytes:
        raise CheckpointError(
            f"{f} is truncated or padded: its header covers {at} data bytes, the file has "
            f"{data_bytes}",
            code="truncated_checkpoint",
        )


def check_compatible(new: Checkpoint, served: Checkpoint) -> None:
    """Raise :class:`CheckpointError` listing how ``new`` differs from the served checkpoint in
    architecture, shape-fixing config fields, or tensors (names, shapes, dtypes)."""
    problems = _config_diffs(new.config, served.config)
    problems += _tensor_diffs(new.tensors, served.tensors)
    if problems:
        shown = "; ".join(problems[:8])
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise CheckpointError(
            f"{str(new.path)!r} does not fit the served model: {shown}{more}",
            code="checkpoint_mismatch",
        )


def _config_diffs(new: dict[str, Any], served: dict[str, Any]) -> list[str]:
    out = []
    for scope, a, b in (("", new, served), ("text_config.", *_sub(new, served, "text_config"))):
        for k in SHAPE_FIELDS:
            if a.get(k) != b.get(k):
                out.append(f"config {scope}{k} is {a.get(k)!r}, the served model's {b.get(k)!r}")
    return out


def _sub(a: dict[str, Any], b: dict[str, Any], key: str) -> tuple[dict, dict]:
    sa, sb = a.get(key), b.get(key)
    return (sa if isinstance(sa, dict) else {}), (sb if isinstance(sb, dict) else {})


def _tensor_diffs(new: dict[str, TensorInfo], served: dict[str, TensorInfo]) -> list[str]:
    out = [f"tensor {k!r} is missing" for k in served if k not in new]
    out += [f"tensor {k!r} is not in the served model" for k in new if k not in served]
    for k, want in served.items():
        got = new.get(k)
        if got is not None and (got.shape, got.dtype) != (want.shape, want.dtype):
            out.append(
                f"tensor {k!r} is {got.dtype}{list(got.shape)}, expected "
                f"{want.dtype}{list(want.shape)}"
            )
    return out
