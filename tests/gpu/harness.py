"""Run replay_check.py from pytest: world size 1 or N gloo ranks; returns each rank's ``RESULT``
record.

Ranks fork from a forkserver that has imported torch, megatron-core and replay_check once for the
whole pytest session (a fresh interpreter spends ~5 s of CPU on those imports, per rank), and the
check's own shims run in each rank as they do in a fresh process. A run with ``env`` (another
megatron-core first on ``PYTHONPATH``) cannot use those imports: it goes to a server process
started with that environment (``python harness.py --serve``), one per environment for the
session, whose own forkserver imported that megatron-core."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from summarize import results

from routereplay.local_redis import free_port

# What replay_check imports before its shims run (megatron.core comes with the second).
PRELOAD = ["replay_check", "megatron.core.tensor_parallel.random"]
TIMEOUT_S = 300
REPLY = "HARNESS-REPLY "  # a server's answer line (anything else it prints is not one)
_forkserver: list[Any] = []  # the context, made on first use
_servers: dict[tuple[tuple[str, str], ...], subprocess.Popen] = {}


def run_check(
    nproc: int, *args: str, redis_url: str = "", env: dict[str, str] | None = None
) -> list[dict]:
    """``env``: extra environment (e.g. ``PYTHONPATH`` putting another megatron-core first)."""
    argv = ["--device", "cpu", *args, *(["--redis-url", redis_url] if redis_url else [])]
    out = _served(nproc, argv, env) if env else _forked(nproc, argv)
    res = results(out)  # ranks may share stdout: records may be glued on one line
    assert len(res) == nproc, out[-2000:]
    return res


def _served(nproc: int, argv: list[str], env: dict[str, str]) -> str:
    """:func:`_forked` in the server process for ``env`` (started on first use)."""
    key = tuple(sorted(env.items()))
    server = _servers.get(key)
    if server is None or server.poll() is not None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
        server = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        _servers[key] = server
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps({"nproc": nproc, "argv": argv}) + "\n")
    server.stdin.flush()
    for line in server.stdout:
        if line.startswith(REPLY):
            reply = json.loads(line[len(REPLY) :])
            assert "error" not in reply, reply["error"]
            return reply["out"]
    raise AssertionError(f"the harness server for {dict(key)} exited {server.wait()}")


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        if server.poll() is None:
            server.stdin.close()  # type: ignore[union-attr]
            server.wait(timeout=30)


def _serve() -> None:
    """The server's loop: one JSON request per stdin line, one :data:`REPLY` line per request."""
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"out": _forked(req["nproc"], req["argv"])}
        except AssertionError as e:
            reply = {"error": str(e)}
        print(REPLY + json.dumps(reply), flush=True)


def _forked(nproc: int, argv: list[str]) -> str:
    if not _forkserver:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _forkserver.append(ctx)
    ctx = _forkserver[0]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rr-ranks-") as d:
        logs = [Path(d) / f"rank{r}.log" for r in range(nproc)]
        procs = [
            ctx.Process(target=_rank, args=(r, nproc, port, argv, str(logs[r])))
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        text = "".join(log.read_text(errors="replace") for log in logs)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * nproc, f"exit codes {codes} (-9: past {TIMEOUT_S} s)\n{text[-6000:]}"
    return text


def _rank(rank: int, nproc: int, port: int, argv: list[str], log: str) -> None:
    """One rank, in a process forked from the forkserver: what ``torch.distributed.run`` and
    the fresh process's environment would have given it, then replay_check's ``main``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if nproc > 1:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import replay_check

    try:
        code = replay_check.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def assert_policy(results: list[dict], action: str, *, perturbed: bool = False) -> None:
    """A ``--policy`` run: the stale record (0) and the missing one (6) were the samples at fault
    on every micro-batch; ``own_routing``: every router row of theirs took the router's own top-k
    of the forward's scores (what a forward without replay chose, where one ran), the other rows
    their routes, and recompute the forward's experts; ``drop``: the re-packed batches had
    nothing left to decide."""
    own_rows = 0
    for r in results:
        assert r["ok"], r
        p = r["policy"]
        assert p["ok"] and p["records_at_fault"] == [0, 6], p
        assert p["kinds"] == ["missing", "staleness"] and set(p["samples"]) == {2.0}, p
        assert all(r["replay_mask_equal"]) and all(r["targets_equal_truth"]), r
        for layer, st in r["router_rows"].items():
            assert st["bad"] == 0 and st["rec_differs"] == 0 and st["fwd"] > 0, (layer, st)
            own_rows += st["own"]
            if perturbed and st["own"]:  # a recompute choosing afresh would have differed
                assert st["rec_own_topk_moved"] > 0, (layer, st)
            if not perturbed and action == "own_routing":
                assert st["rec_own_topk_moved"] == 0, (layer, st)
        if action == "drop":
            assert r["repacked_decisions"] == [0] * r["args"]["micro_batches"], r
            assert all(st["own"] == 0 for st in r["router_rows"].values()), r
        elif r["args"]["pp"] == 1:
            free = r["own_vs_free_forward"]
            assert free["differs"] == 0 and free["rows"] > 0, free
            assert free["gate_max_abs_diff"] <= 1e-5, free  # replay_check.GATE_TOL
    assert (own_rows > 0) == (action == "own_routing"), own_rows


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    import harness  # the ranks' target is pickled by name: "harness._rank", not "__main__._rank"

    harness._serve()
