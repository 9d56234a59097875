"""Weight changes on a busy in-process engine: the RL calls that change the engine run one at a
time, a new weight version is set before generation resumes, requests that have not started
when the weights change are submitted again under the new weights generation (their prefix-cache
partition), and a prefix-cache reset the engine refuses is counted, never assumed.

``VllmRL`` and ``VllmBackend``'s submission run as in the service, over engines that record
their calls (test_checkpoints_reload's, which refuses a reset while blocks are held, as vLLM
does; and an ``AsyncLLM`` whose first output comes when the test says). The real engine's
behaviour is service/test_rl_cache.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from routereplay.service.admission import Admission, cache_salt
from routereplay.service.engine import GenerationRequest
from routereplay.service.engines.vllm import VllmBackend, _engine_error
from routereplay.service.engines.vllm_rl import VllmRL
from routereplay.service.errors import EngineUnavailableError, InvalidRequestError

from .test_checkpoints_reload import Backend, RecordingEngine, write_checkpoint


class TransferEngine(RecordingEngine):
    """The recording engine with vLLM's weight-transfer calls."""

    async def start_weight_update(self) -> None:
        self.calls.append("start")

    async def finish_weight_update(self, weight_version: str | None) -> None:
        self.calls.append("finish")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def resume_generation(self) -> None:
        await super().resume_generation()


@pytest.fixture()
def engine() -> TransferEngine:
    return TransferEngine()


@pytest.fixture()
def rl(tmp_path: Path, engine: TransferEngine) -> VllmRL:
    served = write_checkpoint(tmp_path / "served")
    return VllmRL(Backend(served, engine))  # type: ignore[arg-type]


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


async def held_load(
    rl: VllmRL, engine: RecordingEngine, root: Path
) -> tuple[Path, asyncio.Task, asyncio.Event]:
    """A load of ``root/step-1`` under way: (its checkpoint, its caller's task, the event that
    lets the engine's read of it end)."""
    ckpt = write_checkpoint(root / "step-1")
    entered, release = asyncio.Event(), asyncio.Event()

    async def during(path: Path) -> None:
        entered.set()
        await release.wait()

    engine.during_load = during
    caller = asyncio.create_task(rl.reload_weights(ckpt, "step-1", root))
    await asyncio.wait_for(entered.wait(), 10)
    return ckpt, caller, release


async def test_state_changes_wait_for_a_running_load(
    rl: VllmRL, engine: TransferEngine, root: Path
) -> None:
    _, load, release = await held_load(rl, engine, root)
    others = [
        asyncio.create_task(rl.resume()),
        asyncio.create_task(rl.update_weight_version("relabel")),
        asyncio.create_task(rl.finish_weight_update("step-2")),
    ]
    await asyncio.sleep(0.2)
    # A resume mid-load would run a step on released tensors; a relabel would mislabel rows.
    assert engine.calls == ["pause", "load step-1"] and engine.version == "default"
    release.set()
    await asyncio.wait_for(asyncio.gather(load, *others), 10)
    assert engine.calls == [
        "pause", "load step-1", "loaded step-1", "version step-1", "reset", "resume",
        "resume", "version relabel",
        "pause", "finish", "version step-2", "reset", "resume",
    ]  # fmt: skip


async def test_the_transfer_path_labels_the_weights_before_generation_resumes(
    rl: VllmRL, engine: TransferEngine
) -> None:
    await rl.start_weight_update()
    await rl.finish_weight_update("step-7")
    assert engine.calls == ["start", "reset", "pause", "finish", "version step-7", "reset",
                            "resume"]  # fmt: skip
    assert rl.b.admission.generation == 2  # the partial weights had a generation of their own


async def test_a_paused_engine_stays_paused_and_holds_new_requests(
    rl: VllmRL, engine: TransferEngine, root: Path
) -> None:
    await rl.pause("abort", True)
    assert rl.b.admission.held
    await rl.reload_weights(write_checkpoint(root / "step-1"), "step-1", root)
    assert engine.paused and rl.b.admission.held
    await rl.resume()
    assert not engine.paused and not rl.b.admission.held


async def test_a_refused_reset_is_counted_not_assumed(
    rl: VllmRL, engine: TransferEngine, root: Path
) -> None:
    engine.blocks_held = True  # a request holds KV blocks: vLLM keeps its cache
    await rl.reload_weights(write_checkpoint(root / "step-1"), "step-1", root)
    assert "reset refused" in engine.calls and engine.version == "step-1"
    assert rl.b.prefix_cache_resets == {"cleared": 0, "refused": 1}
    engine.blocks_held = False
    await rl.reload_weights(write_checkpoint(root / "step-2"), "step-2", root)
    assert rl.b.prefix_cache_resets == {"cleared": 1, "refused": 1}


async def test_requests_not_started_are_taken_back_before_generation_resumes(
    rl: VllmRL, engine: TransferEngine, root: Path
) -> None:
    admission = rl.b.admission
    waiting = admission.admit("c1.x", "c1")
    running = admission.admit("c2.x", "c2")
    admission.started(running)

    async def leave_when_taken() -> None:  # what the request path does (VllmBackend._submit)
        await waiting.retake.wait()
        admission.close(waiting)

    leaving = asyncio.create_task(leave_when_taken())
    await rl.reload_weights(write_checkpoint(root / "step-1"), "step-1", root)
    await leaving
    assert engine.calls == ["pause", "load step-1", "loaded step-1", "version step-1",
                            "abort c1.x", "reset", "resume"]  # fmt: skip
    assert not running.retake.is_set() and admission.generation == 1
    assert admission.resubmitted == 1


async def test_a_caller_whose_load_timed_out_learns_how_it_ended(
    rl: VllmRL, engine: TransferEngine, root: Path
) -> None:
    ckpt, caller, release = await held_load(rl, engine, root)
    caller.cancel()  # its HTTP client gave up
    status = rl.weight_update_status()
    assert status["running"]["op"] == "reload_weights", status
    assert status["running"]["weights_path"] == str(ckpt) and status["last_weight_change"] is None
    release.set()
    await until(lambda: rl.weight_update_status()["running"] is None)
    status = rl.weight_update_status()
    last = status["last_weight_change"]
    assert status["running"] is None
    assert (last["op"], last["weight_version"], last["state"]) == ("reload_weights", "step-1",
                                                                   "done")  # fmt: skip
    with pytest.raises(Exception, match="cannot be opened as a directory"):
        await rl.reload_weights(root / "missing", "step-2", root)
    last = rl.weight_update_status()["last_weight_change"]
    assert last["state"] == "failed" and last["weight_version"] == "step-2" and last["error"]


# -- the request path ------------------------------------------------------------------------
class FirstOutputLater:
    """``AsyncLLM.generate`` whose first output comes when the test calls :meth:`emit`; it
    records each submission's engine id and cache salt, and each abort (a closed stream)."""

    def __init__(self) -> None:
        self.errored = False
        self.submitted: list[tuple[str, str]] = []
        self.aborted: list[str] = []
        self._go: dict[str, asyncio.Event] = {}

    async def generate(self, prompt: dict, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.submitted.append((request_id, prompt["cache_salt"]))
        go = self._go[request_id] = asyncio.Event()
        try:
            await go.wait()
            yield SimpleNamespace(request_id=request_id)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise

    def emit(self, request_id: str) -> None:
        self._go[request_id].set()


def generation_request(salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(SimpleNamespace(cache_salt=salt), "c", "c.ab12")  # type: ignore[arg-type]


async def until(cond: Any, timeout_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.005)


@pytest.fixture()
def backend() -> tuple[VllmBackend, FirstOutputLater]:
    b = VllmBackend("m", served_model_name="m")
    b.engine = FirstOutputLater()
    return b, b.engine


async def test_a_request_not_started_at_a_weight_change_is_submitted_again(backend) -> None:
    b, engine = backend
    submit = asyncio.create_task(
        b._submit(generation_request("mine"), {"prompt_token_ids": [1]}, None)
    )
    await until(lambda: engine.submitted)
    taken = b.admission.advance()
    await b.admission.settle(taken)
    await until(lambda: len(engine.submitted) == 2)
    engine.emit("c.ab12.1")
    ticket, _, first = await asyncio.wait_for(submit, 10)
    assert engine.submitted == [
        ("c.ab12", cache_salt(0, "mine")),
        ("c.ab12.1", cache_salt(1, "mine")),
    ]
    assert engine.aborted == ["c.ab12"] and first.request_id == "c.ab12.1"
    assert ticket.generation == 1 and ticket.started
    assert [t.engine_id for t in b.admission.tickets()] == ["c.ab12.1"]


async def test_a_started_request_keeps_its_generation(backend) -> None:
    b, engine = backend
    submit = asyncio.create_task(b._submit(generation_request(), {"prompt_token_ids": [1]}, None))
    await until(lambda: engine.submitted)
    engine.emit("c.ab12")
    ticket, _, _ = await asyncio.wait_for(submit, 10)
    assert b.admission.advance() == [] and ticket.generation == 0


async def test_new_requests_wait_while_the_engine_is_paused(backend) -> None:
    b, engine = backend
    b.admission.hold()
    submit = asyncio.create_task(b._submit(generation_request(), {"prompt_token_ids": [1]}, None))
    await asyncio.sleep(0.1)
    assert engine.submitted == []
    b.admission.advance()  # weights changed while it waited: it is admitted under the new ones
    b.admission.release_hold()
    await until(lambda: engine.submitted)
    engine.emit("c.ab12")
    ticket, _, _ = await asyncio.wait_for(submit, 10)
    assert engine.submitted == [("c.ab12", cache_salt(1, None))] and ticket.generation == 1


def test_salts_keep_generations_and_clients_apart() -> None:
    salts = {cache_salt(g, u) for g in (0, 1, 12) for u in (None, "a", "b", "@/" * 64)}
    assert len(salts) == 12
    assert all(len(s) <= 128 and not set(s) & set("@/\\\x00") for s in salts)


def test_engine_errors_are_never_a_500() -> None:
    from vllm.exceptions import GenerationError, RetryableRequestError, VLLMValidationError

    request = SimpleNamespace(model_fields={})
    retry = _engine_error(RetryableRequestError("paused"), request, started=False)
    assert isinstance(retry, EngineUnavailableError) and retry.headers == {"Retry-After": "1"}
    assert (retry.status_code, retry.code) == (503, "engine_busy")
    failed = _engine_error(GenerationError("boom"), request, started=True)
    assert isinstance(failed, EngineUnavailableError) and failed.code == "engine_error"
    bad = _engine_error(VLLMValidationError("n must be 1", parameter="n"), request, started=False)
    assert isinstance(bad, InvalidRequestError) and bad.param == "n"
    assert _engine_error(KeyError("x"), request, started=True) is None


def test_admission_starts_open() -> None:
    a = Admission()
    assert not a.held and a.generation == 0 and list(a.tickets()) == []
