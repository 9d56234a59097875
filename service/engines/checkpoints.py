"""Checkpoint directories a weight load may read, checked before the engine touches them.

A file-based weight load (``POST /reload_weights``) names a directory under the configured
``weights_root``; nothing else is read (never a hub id, never a link out of the root). vLLM's
in-place reload releases the model's tensors before it reads the new ones, so a checkpoint it
cannot load leaves an engine that dies on its next step: every check that can fail runs here,
first, on the safetensors headers (no tensor data is read):

- :func:`resolve_checkpoint`: the path, resolved inside the root, is a readable directory;
- :func:`weight_files`: the files vLLM's default loader reads from the directory, chosen by
  vLLM's own rule, with every index entry that rule would fail on refused by name;
- :func:`read_checkpoint`: ``config.json`` and those files, each opened once (links under the
  root are not followed), fingerprinted, its header well formed and covering its file exactly;
- :func:`check_compatible`: the architecture and every config field that fixes a shape equal the
  served model's, and every tensor the served checkpoint has is present with its shape and dtype;
- :func:`check_unchanged`: every file read is still the file that was checked. vLLM opens the
  files again by name, so the engine's load runs between two of these checks.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
import re
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "FileStamp",
    "TensorInfo",
    "check_compatible",
    "check_unchanged",
    "read_checkpoint",
    "resolve_checkpoint",
    "weight_files",
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
MISTRAL_INDEX = "consolidated.safetensors.index.json"
# vLLM's loader globs ``<checkpoint>/<pattern>``, so these characters in the path are a pattern.
GLOB_MAGIC = re.compile(r"[*?[]")


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
class FileStamp:
    """One version of one file: a replaced file has another inode, a rewritten one another size
    or modification time (to the file system's timestamp resolution)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    # Every entry read, by name in ``path`` ("." is the directory itself: an entry added, removed
    # or renamed changes it, and with it what vLLM's loader would list).
    stamps: dict[str, FileStamp] = field(default_factory=dict)
    follow_links: bool = False  # True only for the served model's own directory (root None)


def resolve_checkpoint(weights_path: str, root: Path | None) -> Path:
    """``weights_path`` (absolute, or relative to ``root``) as a real directory inside ``root``.

    Links are resolved before the check, so a link (the directory or any part of its path) that
    leads out of the root is refused like a path that is outside it. Blocking: file-system calls."""
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


class _Dir:
    """A checkpoint directory opened once. Its files are opened relative to the directory's
    descriptor, each once, fingerprinted as opened. Under a weights root no link is followed (the
    directory's own name included); the served model's directory (no root) follows them, since a
    Hugging Face cache snapshot is links into its blob store."""

    def __init__(self, path: Path, root: Path | None) -> None:
        self.path, self.root, self.follow = path, root, root is None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | self._nofollow)
        except OSError as e:
            raise CheckpointError(
                f"{path} cannot be opened as a directory ({e.strerror})", code="not_a_checkpoint"
            ) from e
        self.stamps = {".": FileStamp.of(os.fstat(self.fd))}

    @property
    def _nofollow(self) -> int:
        return 0 if self.follow else os.O_NOFOLLOW

    def __enter__(self) -> _Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def is_file(self, name: str) -> bool:
        """``os.path.isfile`` (links followed): how vLLM decides whether an index exists."""
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self.fd).st_mode)
        except OSError:
            return False

    @contextmanager
    def open(self, name: str) -> Iterator[tuple[int, FileStamp]]:
        """A descriptor of the regular file ``name`` and its fingerprint (recorded)."""
        f = self.path / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | self._nofollow, dir_fd=self.fd)
        except FileNotFoundError as e:
            raise CheckpointError(f"{f} is missing") from e
        except OSError as e:
            if e.errno == errno.ELOOP and not self.follow:  # O_NOFOLLOW met a link
                raise self._link_error(f) from e
            raise CheckpointError(f"{f} is not readable ({e.strerror})") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{f} is not a regular file")
            self.stamps[name] = FileStamp.of(st)
            yield fd, self.stamps[name]
        finally:
            os.close(fd)

    def _link_error(self, f: Path) -> CheckpointError:
        assert self.root is not None
        if not _inside(Path(os.path.realpath(f)), Path(os.path.realpath(self.root))):
            return CheckpointError(
                f"{f} links out of the weights root", code="outside_weights_root"
            )
        return CheckpointError(
            f"{f} is a symbolic link: files of a checkpoint under the weights root are read only "
            "as regular files, never through links (copy the file, or hard-link it)"
        )


def weight_files(path: Path, load_format: str = "auto", root: Path | None = None) -> list[str]:
    """The names of the files in ``path`` that vLLM's default loader reads for ``load_format``
    (the engine's ``load_config.load_format``), chosen by vLLM's own rule; raise
    :class:`CheckpointError` where that rule would make vLLM fail, naming the index entry, or
    where the files are not safetensors. Blocking: file-system calls."""
    with _Dir(path, root) as d:
        return _select(d, load_format)


def _select(d: _Dir, load_format: str) -> list[str]:
    """vLLM's ``DefaultModelLoader._prepare_weights`` on a local directory: the first pattern
    that matches top-level names (glob's rule: hidden names never match), then, when the
    index is a file, only the files it names; an index entry that is not one of those files is
    an error in vLLM (raised after the served weights are released), so it is refused here."""
    if GLOB_MAGIC.search(str(d.path)):
        raise CheckpointError(
            f"{str(d.path)!r} holds '*', '?' or '[': vLLM's loader reads the checkpoint path as "
            "a glob pattern, so it would not read this directory",
            code="not_a_checkpoint",
        )
    patterns, index = _patterns(d, load_format)
    names = [n for n in d.names() if not n.startswith(".")]
    for pattern in patterns:
        found = sorted(fnmatch.filter(names, pattern))
        if found:
            break
    if not found or not pattern.endswith(".safetensors"):
        raise CheckpointError(
            f"{d.path} holds no {patterns[0]} files (only safetensors checkpoints load here)",
            code="not_a_checkpoint",
        )
    if d.is_file(index):
        found = _in_index(d, index, found, patterns[0])
    return found


def _patterns(d: _Dir, load_format: str) -> tuple[list[str], str]:
    """The loader's glob patterns, in its order, and its index file's name."""
    fmt = load_format.lower()
    if fmt == "auto":
        fmt = "mistral" if _has_consolidated(d.path) else "hf"
    if fmt == "hf":
        return ["*.safetensors", "*.bin", "*.pt"], INDEX
    if fmt in ("safetensors", "fastsafetensors", "instanttensor"):
        return ["*.safetensors"], INDEX
    if fmt == "mistral":
        return ["consolidated*.safetensors"], MISTRAL_INDEX
    raise CheckpointError(
        f"the engine loads with load_format {load_format!r}: file loads are checked, and so "
        "served, only for vLLM's safetensors formats (auto, hf, safetensors, fastsafetensors, "
        "instanttensor, mistral)",
        code="unsupported_load_format",
    )


def _has_consolidated(path: Path) -> bool:
    """vLLM's ``auto`` format is ``mistral`` when any file of the tree (links to directories
    not entered, links to files followed) is named ``consolidated*.safetensors``."""
    for top, _dirs, files in os.walk(path):
        for name in fnmatch.filter(files, "consolidated*.safetensors"):
            if os.path.isfile(os.path.join(top, name)):
                return True
    return False


def _in_index(d: _Dir, index: str, found: list[str], pattern: str) -> list[str]:
    wmap = _read_json(d, index)
    wmap = wmap.get("weight_map") if isinstance(wmap, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{d.path / index} has no weight_map of tensor -> file")
    # vLLM compares os.path.join(checkpoint, entry) with the globbed paths, string for string.
    folder = str(d.path)
    listed = {os.path.join(folder, n) for n in found}
    bad = sorted({v for v in wmap.values() if os.path.join(folder, v) not in listed})
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{d.path / index} names {bad[0]!r}{more}, which is not a {pattern} file at the top "
            "of the checkpoint, spelled as its bare name: vLLM's loader fails on such an entry "
            "after it has released the served weights",
        )
    named = {os.path.join(folder, v) for v in wmap.values()}
    kept = [n for n in found if os.path.join(folder, n) in named]
    if not kept:
        raise CheckpointError(f"{d.path / index} names no file", code="not_a_checkpoint")
    return kept


def read_checkpoint(path: Path, root: Path | None = None, load_format: str = "auto") -> Checkpoint:
    """Read ``path``'s config and the safetensors headers of :func:`weight_files`; raise
    :class:`CheckpointError` naming the first file that is missing, unreadable, malformed,
    truncated, changed while read, or (with ``root``) a link. Blocking: file-system calls."""
    with _Dir(path, root) as d:
        config = _read_json(d, "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{path / 'config.json'} is not a JSON object")
        tensors: dict[str, TensorInfo] = {}
        for name in _select(d, load_format):
            for tensor, info in _read_header(d, name).items():
                if tensor in tensors:
                    raise CheckpointError(
                        f"tensor {tensor!r} is in both {tensors[tensor].file} and {name}"
                    )
                tensors[tensor] = info
        return Checkpoint(path, config, tensors, dict(d.stamps), d.follow)


def check_unchanged(checkpoint: Checkpoint) -> None:
    """Raise :class:`CheckpointError` (``checkpoint_changed``) naming the first entry
    :func:`read_checkpoint` read that is no longer what it read: replaced, rewritten, gone, or
    (links not followed) now a link. Blocking: file-system calls."""
    look = os.stat if checkpoint.follow_links else os.lstat
    # The directory last: a replaced or rewritten file is the more useful name.
    for name, was in sorted(checkpoint.stamps.items(), key=lambda item: item[0] == "."):
        f = checkpoint.path / name
        try:
            now: FileStamp | None = FileStamp.of(look(f))
        except OSError:
            now = None
        if now != was:
            what = _change(was, now)
            if name == "." and what == "was modified":
                what = "had an entry added, removed or renamed"
            raise CheckpointError(
                f"{f} {what} after it was checked: a checkpoint must not change while it loads",
                code="checkpoint_changed",
            )


def _change(was: FileStamp, now: FileStamp | None) -> str:
    if now is None:
        return "is gone"
    if (now.dev, now.ino) != (was.dev, was.ino):
        return "was replaced by another file"
    if now.size != was.size:
        return f"changed size from {was.size} to {now.size} bytes"
    return "was modified"


def _read_json(d: _Dir, name: str) -> Any:
    f = d.path / name
    with d.open(name) as (fd, stamp):
        if stamp.size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{f} is larger than {MAX_HEADER_BYTES} bytes")
        try:
            return json.loads(_pread(fd, stamp.size, 0))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{f} is not readable JSON ({e})") from e


def _pread(fd: int, n: int, at: int) -> bytes:
    out = b""
    while len(out) < n:
        got = os.pread(fd, n - len(out), at + len(out))
        if not got:
            break
        out += got
    return out


def _read_header(d: _Dir, name: str) -> dict[str, TensorInfo]:
    """A safetensors header, checked as the format defines it: every tensor's byte range matches
    its dtype and shape, and the ranges cover the data section exactly (a truncated or padded
    file fails here)."""
    f = d.path / name
    with d.open(name) as (fd, stamp):
        try:
            head = _pread(fd, 8, 0)
            if len(head) < 8:
                raise CheckpointError(f"{f} is not a safetensors file ({stamp.size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > stamp.size:
                raise CheckpointError(f"{f} is not a safetensors file, or truncated (header {n})")
            header = json.loads(_pread(fd, n, 8))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{f} has no readable safetensors header ({e})") from e
        out = _tensors(f, header, stamp.size - 8 - n)
        _open_as_vllm_does(fd, f)
        if FileStamp.of(os.fstat(fd)) != stamp:  # still being written
            raise CheckpointError(f"{f} changed while it was read", code="checkpoint_changed")
    return out


def _tensors(f: Path, header: Any, data_bytes: int) -> dict[str, TensorInfo]:
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{f}: __metadata__ must map strings to strings")
    out = {name: _tensor(f, name, entry) for name, entry in header.items()}
    _check_coverage(f, header, data_bytes)
    return out


def _open_as_vllm_does(fd: int, f: Path) -> None:
    """The safetensors library's own checks, the reader vLLM's loader uses (headers only), on
    the file already open (``/dev/fd``: the same file, not the name again)."""
    from safetensors import safe_open

    try:
        with safe_open(f"/dev/fd/{fd}", framework="np") as st:
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
