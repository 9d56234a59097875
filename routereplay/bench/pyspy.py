"""py-spy recordings of a server's processes while a level runs (``bench service --py-spy``).

Each process of the server's process group (the API process and its engine processes) is
sampled by its own ``py-spy record`` with idle frames kept, so time a thread spends waiting (on
the GPU, a socket, a lock) shows as the Python frame it waits in. The output is py-spy's raw
collapsed stacks (``flamegraph.pl`` and speedscope read them), one file per process, and
:func:`top_frames` ranks a thread's frames by the share of its samples they appear in, and
:func:`shares` measures the time under named frames (``python -m routereplay.bench.pyspy``).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

__all__ = ["executable", "recording", "shares", "top_frames"]


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return "gone"


def executable() -> str | None:
    """py-spy's path: on PATH, or beside this interpreter (pip installs it there, and a venv
    that is not activated is not on PATH)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


@contextlib.contextmanager
def recording(
    pids: list[int], out: Path, tag: str, rate: int = 100, seconds: int | None = None
) -> Iterator[list[Path]]:
    """Sample ``pids`` with py-spy until the block ends, or for its first ``seconds`` only (a
    level's time to first token); yields the files being written,
    ``out/{tag}-{pid}-{process name}.txt`` (a process that is not Python leaves none)."""
    exe = executable()
    if exe is None:
        raise RuntimeError("--py-spy needs the py-spy executable on PATH (pip install py-spy)")
    out.mkdir(parents=True, exist_ok=True)
    files, procs = [], []
    for pid in pids:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", _comm(pid))
        files.append(out / f"{tag}-{pid}-{name}.txt")
        argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--idle", "--threads",
                "--nonblocking", "--format", "raw", "--output", str(files[-1])]  # fmt: skip
        argv += [] if seconds is None else ["--duration", str(seconds)]
        log = open(files[-1].with_suffix(".log"), "wb")
        procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
    time.sleep(0.5)  # py-spy attaches before the level's first request
    try:
        yield files
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p, log in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()


def _stacks(path: Path, thread: str | None) -> Iterator[tuple[list[str], int]]:
    """(frames outermost first, samples) of each stack in ``path``, of the threads whose label
    contains ``thread`` (all with None)."""
    for line in path.read_text(errors="replace").splitlines():
        stack, _, k = line.rpartition(" ")
        if not stack or not k.isdigit():
            continue
        frames = stack.split(";")
        if thread is None or thread in frames[0]:
            yield frames[1:], int(k)  # frames[0] is py-spy's thread label (--threads)


def top_frames(
    path: Path, n: int = 10, leaf: bool = True, thread: str | None = "MainThread"
) -> list[tuple[str, float]]:
    """The ``n`` frames of a raw collapsed-stack file with the largest share of ``thread``'s
    samples: as the innermost frame (``leaf``: where the time is spent, waits included), or
    anywhere on the stack (inclusive)."""
    counts: Counter[str] = Counter()
    total = 0
    for frames, k in _stacks(path, thread):
        total += k
        for f in frames[-1:] if leaf else set(frames):
            counts[f] += k
    return [(f, c / total) for f, c in counts.most_common(n)] if total else []


def shares(path: Path, patterns: list[str], thread: str | None = "MainThread") -> dict[str, float]:
    """The share of ``thread``'s samples whose stack has a frame matching each regex: the
    time inside what the pattern names (a function, a module), waits included."""
    regexes = {p: re.compile(p) for p in patterns}
    hits = dict.fromkeys(patterns, 0)
    total = 0
    for frames, k in _stacks(path, thread):
        total += k
        for p, rx in regexes.items():
            if any(rx.search(f) for f in frames):
                hits[p] += k
    return {p: h / total for p, h in hits.items()} if total else {}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m routereplay.bench.pyspy",
        description="Shares of a thread's samples in py-spy raw profiles (bench service --py-spy)",
    )
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--thread", default="MainThread", help="a substring of py-spy's thread label")
    ap.add_argument("--frame", action="append", default=[], help="a regex (repeat); default: "
                    "the thread's busiest innermost frames")  # fmt: skip
    args = ap.parse_args(argv)
    for f in args.files:
        print(f.name)
        rows = (shares(f, args.frame, args.thread).items() if args.frame
                else top_frames(f, 12, thread=args.thread))  # fmt: skip
        for frame, share in rows:
            print(f"  {share:6.1%}  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
