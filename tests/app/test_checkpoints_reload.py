"""The in-process backend's file-based weight load, over an engine that records its calls.

``VllmRL`` runs as in the service; the engine below answers the calls a load makes (pause,
``reload_weights`` through ``collective_rpc``, resume, the weight version) and lets a test act
inside them: change a file right before the engine reads it, or while it reads, or hold a load
open while its caller is cancelled. What vLLM's own loader does with the files is covered by
test_checkpoints_selection.py and, on the real engine, service/test_weight_loads.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from routereplay.service.admission import Admission
from routereplay.service.engines.checkpoints import CheckpointError
from routereplay.service.engines.vllm_rl import VllmRL


class RecordingEngine:
    """The engine calls a weight load makes, in ``calls``; ``on_pause`` runs as generation
    pauses (right before the load), ``during_load`` inside the engine's read of a checkpoint.
    As vLLM, it refuses to reset its prefix cache while a request holds KV blocks
    (``blocks_held``)."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(load_config=SimpleNamespace(load_format="auto"))
        self.calls: list[str] = []
        self.paused = False
        self.version = "default"
        self.blocks_held = False
        self.on_pause: Callable[[], None] | None = None
        self.during_load: Callable[[Path], Awaitable[None]] | None = None

    async def is_paused(self) -> bool:
        return self.paused

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append("pause")
        self.paused = True
        if self.on_pause is not None:
            self.on_pause()

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def reset_prefix_cache(self) -> bool:
        self.calls.append("reset refused" if self.blocks_held else "reset")
        return not self.blocks_held

    async def abort(self, ids: list[str]) -> None:
        self.calls.append(f"abort {','.join(ids)}")

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"version {version}")
        self.version = version

    async def get_weight_version(self) -> str:
        return self.version

    async def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        path = Path(kwargs["weights_path"])
        self.calls.append(f"load {path.name}")
        if self.during_load is not None:
            await self.during_load(path)
        self.calls.append(f"loaded {path.name}")


class Backend:
    def __init__(self, model: Path, engine: RecordingEngine) -> None:
        self.model, self.engine, self.dead = str(model), engine, False
        self.failed: str | None = None
        self.admission = Admission()
        self.prefix_cache_resets = {"cleared": 0, "refused": 0}
        self.release = None  # VllmBackend's probe of the installed vLLM: none here
        self.relabels = 0

    def fail(self, reason: str) -> None:
        self.dead, self.failed = True, reason

    async def relabel(self) -> None:
        self.relabels += 1


def write_checkpoint(d: Path) -> Path:
    from safetensors.numpy import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["Tiny"], "model_type": "tiny"}))
    tensors = {"a": np.zeros(4, np.float32), "b": np.ones(2, np.float32)}
    save_file(tensors, str(d / "model.safetensors"))
    os.utime(d, ns=(0, 0))  # an entry added later moves the directory's time, however soon
    return d


@pytest.fixture()
def served(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "served")


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@pytest.fixture()
def engine() -> RecordingEngine:
    return RecordingEngine()


@pytest.fixture()
def rl(served: Path, engine: RecordingEngine) -> VllmRL:
    return VllmRL(Backend(served, engine))  # type: ignore[arg-type]


async def test_a_checked_load_reaches_the_engine(
    rl: VllmRL, engine: RecordingEngine, root: Path
) -> None:
    ckpt = write_checkpoint(root / "step-1")
    await rl.reload_weights(ckpt, "step-1", root)
    # Labelled before anything runs again: no token of the new weights under the old label.
    assert engine.calls == ["pause", "load step-1", "loaded step-1", "version step-1", "reset",
                            "resume"]  # fmt: skip
    assert engine.version == "step-1"


@pytest.mark.parametrize("entry", ["./model.safetensors", "sub/model.safetensors"])
async def test_an_index_entry_vllm_fails_on_is_refused_before_the_engine_is_touched(
    rl: VllmRL, engine: RecordingEngine, root: Path, entry: str
) -> None:
    """vLLM reads only top-level files, and only entries spelled as their bare names: here the
    one file under another spelling, or ``b`` moved to a file of its own in a subdirectory."""
    from safetensors.numpy import load_file, save_file

    ckpt = write_checkpoint(root / "step-1")
    index = {"weight_map": {"a": entry, "b": entry}}
    if entry.startswith("sub/"):
        tensors = load_file(str(ckpt / "model.safetensors"))
        (ckpt / "sub").mkdir()
        save_file({"a": tensors["a"]}, str(ckpt / "model.safetensors"))
        save_file({"b": tensors["b"]}, str(ckpt / entry))
        index = {"weight_map": {"a": "model.safetensors", "b": entry}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        await rl.reload_weights(ckpt, "step-1", root)
    assert e.value.code == "bad_checkpoint" and repr(entry) in e.value.message, e.value.message
    assert engine.calls == [] and engine.version == "default"


async def test_a_link_inside_the_root_is_refused_before_the_engine_is_touched(
    rl: VllmRL, engine: RecordingEngine, root: Path
) -> None:
    ckpt = write_checkpoint(root / "step-1")
    shutil.move(ckpt / "model.safetensors", root / "shard")
    os.symlink(root / "shard", ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        await rl.reload_weights(ckpt, "step-1", root)
    assert "model.safetensors is a symbolic link" in e.value.message, e.value.message
    assert engine.calls == []


def replace(ckpt: Path) -> None:
    """Another file under the same name, same bytes (a link swapped, a shard re-saved)."""
    shutil.copy(ckpt / "model.safetensors", ckpt / "new")
    os.replace(ckpt / "new", ckpt / "model.safetensors")


def append(ckpt: Path) -> None:
    """The shard still being written."""
    with open(ckpt / "model.safetensors", "ab") as f:
        f.write(b"\0" * 64)


def add_shard(ckpt: Path) -> None:
    """A file vLLM's loader would list (no index: every top-level *.safetensors)."""
    shutil.copy(ckpt / "model.safetensors", ckpt / "late.safetensors")


CHANGES = {"replace": (replace, "was replaced"), "append": (append, "changed size"),
           "add_shard": (add_shard, "had an entry added")}  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
async def test_a_checkpoint_changed_right_before_the_load_is_refused(
    rl: VllmRL, engine: RecordingEngine, root: Path, change: str
) -> None:
    ckpt = write_checkpoint(root / "step-1")
    do, words = CHANGES[change]
    engine.on_pause = lambda: do(ckpt)
    with pytest.raises(CheckpointError) as e:
        await rl.reload_weights(ckpt, "step-1", root)
    assert e.value.code == "checkpoint_changed" and words in e.value.message, e.value.message
    assert engine.calls == ["pause", "reset", "resume"] and engine.version == "default"


@pytest.mark.parametrize("change", CHANGES)
async def test_a_checkpoint_changed_while_the_engine_reads_it_restores_the_last_good_weights(
    rl: VllmRL, engine: RecordingEngine, root: Path, served: Path, change: str
) -> None:
    ckpt = write_checkpoint(root / "step-1")
    do, words = CHANGES[change]

    async def change_step_1(path: Path) -> None:
        if path == ckpt:
            do(ckpt)

    engine.during_load = change_step_1
    with pytest.raises(CheckpointError) as e:
        await rl.reload_weights(ckpt, "step-1", root)
    assert e.value.code == "checkpoint_load_failed", e.value.message
    assert words in e.value.message and "('default') are restored" in e.value.message
    assert engine.calls == ["pause", "load step-1", "loaded step-1", "load served",
                            "loaded served", "reset", "resume"]  # fmt: skip
    assert engine.version == "default" and not rl.b.dead


async def test_a_cancelled_caller_keeps_the_lock_until_its_load_ends(
    rl: VllmRL, engine: RecordingEngine, root: Path
) -> None:
    first, second = write_checkpoint(root / "step-1"), write_checkpoint(root / "step-2")
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold_step_1(path: Path) -> None:
        if path == first:
            entered.set()
            await release.wait()

    engine.during_load = hold_step_1
    caller = asyncio.create_task(rl.reload_weights(first, "step-1", root))
    await asyncio.wait_for(entered.wait(), 10)
    caller.cancel()  # the client hung up mid-load
    with pytest.raises(asyncio.CancelledError):
        await caller
    later = asyncio.create_task(rl.reload_weights(second, "step-2", root))
    await asyncio.sleep(0.3)
    assert engine.calls == ["pause", "load step-1"]  # the second load waits
    release.set()
    await asyncio.wait_for(later, 10)
    assert engine.calls == ["pause", "load step-1", "loaded step-1", "version step-1", "reset",
                            "resume", "pause", "load step-2", "loaded step-2", "version step-2",
                            "reset", "resume"]  # fmt: skip
    assert engine.version == "step-2"


async def test_a_caller_cancelled_while_it_waits_drops_its_load() -> None:
    from routereplay.service.engines.one_at_a_time import OneAtATime

    runs: list[str] = []
    release = asyncio.Event()

    async def load(name: str) -> str:
        runs.append(f"start {name}")
        if name == "a":
            await release.wait()
        runs.append(f"end {name}")
        return name

    one = OneAtATime()
    a = asyncio.create_task(one.run({"op": "a"}, lambda: load("a")))
    b = asyncio.create_task(one.run({"op": "b"}, lambda: load("b")))
    await asyncio.sleep(0.05)
    b.cancel()  # still waiting for the lock: its load never runs
    a.cancel()  # started: it runs to its end, holding the lock
    for t in (a, b):
        with pytest.raises(asyncio.CancelledError):
            await t
    c = asyncio.create_task(one.run({"op": "c"}, lambda: load("c")))
    await asyncio.sleep(0.05)
    assert runs == ["start a"]
    release.set()
    assert await asyncio.wait_for(c, 10) == "c"
    assert runs == ["start a", "end a", "start c", "end c"]


@pytest.fixture()
def loop_file_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The file-system calls made on this thread (the event loop's) while the list is open."""
    calls: list[str] = []
    loop_thread = threading.get_ident()
    for name in ("open", "stat", "lstat", "listdir", "scandir", "access"):
        real = getattr(os, name)

        def wrapped(*args: object, _real: Callable = real, _name: str = name, **kw: object):
            if threading.get_ident() == loop_thread and calls and calls[0] == "recording":
                calls.append(f"os.{_name}{args[:1]}")
            return _real(*args, **kw)

        monkeypatch.setattr(os, name, wrapped)
    yield calls


async def test_file_system_work_stays_off_the_event_loop(
    rl: VllmRL, root: Path, loop_file_calls: list[str]
) -> None:
    ckpt = write_checkpoint(root / "step-1")
    loop_file_calls.append("recording")
    await rl.reload_weights(ckpt, "step-1", root)
    loop_file_calls.remove("recording")
    assert loop_file_calls == []


class NoOpRL:
    async def reload_weights(
        self, checkpoint: Path, weight_version: str | None, root: Path
    ) -> None:
        pass

    async def weight_version(self) -> str:
        return "default"


async def test_the_path_is_resolved_off_the_event_loop(
    root: Path, loop_file_calls: list[str]
) -> None:
    from routereplay.service.metrics import ServiceMetrics
    from routereplay.service.serving.rl import ServingRL

    write_checkpoint(root / "step-1")
    serving = ServingRL(SimpleNamespace(rl=NoOpRL(), dead=False), ServiceMetrics(), root)  # type: ignore[arg-type]
    loop_file_calls.append("recording")
    await serving.reload_weights("step-1", None)
    loop_file_calls.remove("recording")
    assert loop_file_calls == []
