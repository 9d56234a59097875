"""Which files of a checkpoint a weight load reads: vLLM's own rule, run side by side with vLLM.

Each directory below is given to routereplay's :func:`weight_files` and to vLLM's
``DefaultModelLoader._prepare_weights`` (the function vLLM's in-place reload uses to choose the
files), for each safetensors load format. Both must choose the same files, or both refuse;
routereplay refuses more only where a case says why (vLLM would read pickles, or files outside
the checkpoint, or an index through a link). A vLLM release that changes its rule fails here.

vLLM is imported (its loader, no engine): the module takes some seconds to start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from routereplay.service.engines.checkpoints import CheckpointError, read_checkpoint, weight_files

FORMATS = ("auto", "hf", "safetensors", "mistral")


def shard(d: Path, name: str, tensor: str = "w") -> None:
    from safetensors.numpy import save_file

    (d / name).parent.mkdir(parents=True, exist_ok=True)
    save_file({tensor: np.zeros(2, np.float32)}, str(d / name))


def index(d: Path, entries: dict[str, str], name: str = "model.safetensors.index.json") -> None:
    (d / name).write_text(json.dumps({"metadata": {}, "weight_map": entries}))


def plain(d: Path) -> None:
    shard(d, "model.safetensors")


def sharded(d: Path) -> None:
    shard(d, "model-00001.safetensors", "a")
    shard(d, "model-00002.safetensors", "b")
    index(d, {"a": "model-00001.safetensors", "b": "model-00002.safetensors"})


def index_names_a_subset(d: Path) -> None:
    sharded(d)
    shard(d, "unindexed.safetensors", "c")  # not in the index: not read


def dot_slash_entry(d: Path) -> None:
    shard(d, "model.safetensors")
    index(d, {"w": "./model.safetensors"})


def subdirectory_entry(d: Path) -> None:
    shard(d, "model.safetensors", "a")
    shard(d, "sub/model.safetensors", "b")
    index(d, {"a": "model.safetensors", "b": "sub/model.safetensors"})


def parent_entry(d: Path) -> None:
    shard(d, "model.safetensors")
    shard(d.parent, f"{d.name}-outside.safetensors", "b")
    index(d, {"w": "model.safetensors", "b": f"../{d.name}-outside.safetensors"})


def missing_entry(d: Path) -> None:
    shard(d, "model-00001.safetensors", "a")
    index(d, {"a": "model-00001.safetensors", "b": "model-00002.safetensors"})


def absolute_entry(d: Path) -> None:
    shard(d, "model.safetensors")
    index(d, {"w": str(d / "model.safetensors")})  # vLLM joins it to the same path


def empty_weight_map(d: Path) -> None:
    shard(d, "model.safetensors")
    index(d, {})


def hidden_shard(d: Path) -> None:
    shard(d, "model.safetensors", "a")
    shard(d, ".partial.safetensors", "b")  # glob never matches a hidden name


def only_hidden(d: Path) -> None:
    shard(d, ".model.safetensors")


def no_index_two_files(d: Path) -> None:
    shard(d, "a.safetensors", "a")
    shard(d, "b.safetensors", "b")


def index_is_a_directory(d: Path) -> None:
    shard(d, "model.safetensors")
    (d / "model.safetensors.index.json").mkdir()  # not a file: vLLM reads no index


def linked_shard(d: Path) -> None:
    shard(d, "real.bin.data")
    os.symlink("real.bin.data", d / "model.safetensors")


def dangling_link(d: Path) -> None:
    shard(d, "model.safetensors", "a")
    os.symlink("nowhere", d / "b.safetensors")


def directory_named_like_a_shard(d: Path) -> None:
    shard(d, "model.safetensors")
    (d / "extra.safetensors").mkdir()


def bin_and_safetensors(d: Path) -> None:
    shard(d, "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"pickle")


def bin_only(d: Path) -> None:
    (d / "pytorch_model.bin").write_bytes(b"pickle")


def nothing(d: Path) -> None:
    (d / "README").write_text("no weights")


def mistral_layout(d: Path) -> None:
    shard(d, "consolidated.safetensors", "a")
    shard(d, "model-00001.safetensors", "b")
    index(d, {"b": "model-00001.safetensors"})


def mistral_with_its_index(d: Path) -> None:
    shard(d, "consolidated-00001.safetensors", "a")
    shard(d, "consolidated-00002.safetensors", "b")
    index(d, {"a": "consolidated-00001.safetensors"}, "consolidated.safetensors.index.json")


def consolidated_in_a_subdirectory(d: Path) -> None:
    shard(d, "model.safetensors", "a")
    shard(d, "old/consolidated.safetensors", "b")  # makes vLLM's auto format mistral


def index_through_a_link(d: Path) -> None:
    shard(d, "model.safetensors")
    index(d, {"w": "model.safetensors"}, "real-index.json")
    os.symlink("real-index.json", d / "model.safetensors.index.json")


CASES: dict[str, Callable[[Path], None]] = {
    f.__name__: f
    for f in (
        plain, sharded, index_names_a_subset, dot_slash_entry, subdirectory_entry, parent_entry,
        missing_entry, absolute_entry, empty_weight_map, hidden_shard, only_hidden,
        no_index_two_files, index_is_a_directory, linked_shard, dangling_link,
        directory_named_like_a_shard, bin_and_safetensors, bin_only, nothing, mistral_layout,
        mistral_with_its_index, consolidated_in_a_subdirectory, index_through_a_link,
    )
}  # fmt: skip

# Where routereplay refuses what vLLM would read, and the words of routereplay's refusal.
STRICTER = {
    "bin_only": "holds no *.safetensors files",  # vLLM would unpickle pytorch_model.bin
    "index_through_a_link": "is a symbolic link",  # files under the root are never links
}


def vllm_files(path: Path, load_format: str) -> set[str] | None:
    """vLLM's choice for ``path``: its files, or None where vLLM's loader raises."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig(load_format=load_format))
    try:
        _, files, use_safetensors, _ = loader._prepare_weights(str(path), None, None, True, None)
    except (FileNotFoundError, RuntimeError, ValueError, KeyError, TypeError):
        return None
    return set(files) if use_safetensors else {f"(not safetensors) {f}" for f in files}


def ours(path: Path, load_format: str, root: Path) -> set[str] | CheckpointError:
    try:
        return {os.path.join(str(path), n) for n in weight_files(path, load_format, root)}
    except CheckpointError as e:
        return e


@pytest.mark.parametrize("load_format", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_the_files_chosen_are_vllms(tmp_path: Path, case: str, load_format: str) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    CASES[case](path)
    theirs, got = vllm_files(path, load_format), ours(path, load_format, tmp_path)
    if isinstance(got, CheckpointError) and theirs is not None:
        assert case in STRICTER, (case, got.message, theirs)
        assert STRICTER[case] in got.message, got.message
    elif isinstance(got, CheckpointError):
        assert got.status_code == 400 and got.param == "weights_path", got.message
    else:
        assert got == theirs, case


def test_a_glob_pattern_in_the_path_is_refused(tmp_path: Path) -> None:
    """vLLM globs ``<path>/*.safetensors``: ``ck[1]`` would read ``ck1``'s files."""
    shard(tmp_path / "ck1", "model.safetensors")
    path = tmp_path / "ck[1]"
    shard(path, "model.safetensors")
    assert vllm_files(path, "auto") == {str(tmp_path / "ck1" / "model.safetensors")}
    got = ours(path, "auto", tmp_path)
    assert isinstance(got, CheckpointError) and "glob pattern" in got.message


def _refused(tmp_path: Path, case: Callable) -> CheckpointError:
    """What reading a checkpoint laid out by ``case`` (with a config) under the root raises."""
    path = tmp_path / "ckpt"
    path.mkdir()
    case(path)
    (path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path, tmp_path)
    return e.value


@pytest.mark.parametrize(
    ("case", "words"),
    [
        (dot_slash_entry, "names './model.safetensors'"),
        (subdirectory_entry, "names 'sub/model.safetensors'"),
        (parent_entry, "outside.safetensors'"),
        (missing_entry, "names 'model-00002.safetensors'"),
    ],
)
def test_an_index_entry_vllm_fails_on_is_named(tmp_path: Path, case: Callable, words: str) -> None:
    err = _refused(tmp_path, case)
    assert words in err.message and err.code == "bad_checkpoint", err.message
    assert "model.safetensors.index.json" in err.message


@pytest.mark.parametrize(
    ("case", "words"),
    [
        (linked_shard, "model.safetensors is a symbolic link"),
        (dangling_link, "b.safetensors is a symbolic link"),
        (directory_named_like_a_shard, "extra.safetensors is not a regular file"),
    ],
)
def test_vllms_choice_is_read_only_as_regular_files(
    tmp_path: Path, case: Callable, words: str
) -> None:
    err = _refused(tmp_path, case)
    assert words in err.message, err.message


def test_a_link_out_of_the_root_is_named_so(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    shard(outside, "model.safetensors")
    (root / "ckpt").mkdir(parents=True)
    (root / "ckpt" / "config.json").write_text("{}")
    os.symlink(outside / "model.safetensors", root / "ckpt" / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(root / "ckpt", root)
    assert e.value.code == "outside_weights_root" and "links out of the weights root" in str(
        e.value.message
    )


def test_the_served_models_own_directory_may_be_links(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot is links into its blob store; it is read with no root."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
    shard(blobs, "0123")
    (blobs / "cfg").write_text(json.dumps({"model_type": "x"}))
    snap.mkdir()
    os.symlink(blobs / "0123", snap / "model.safetensors")
    os.symlink(blobs / "cfg", snap / "config.json")
    got = read_checkpoint(snap)
    assert got.follow_links and set(got.tensors) == {"w"}
    assert set(got.stamps) == {".", "config.json", "model.safetensors"}
