"""Replay on every megatron-core release without RouterReplay, every parallel layout, on CPU.

    .venv/bin/python tests/trainer/legacy_matrix.py                 # all four releases, ~8 min
    .venv/bin/python tests/trainer/legacy_matrix.py --releases 0.12.3

Each release is installed once into ~/.cache/routereplay/megatron-core/<version> (see
test_legacy_megatron.py); each configuration runs tests/gpu/replay_check.py in fresh processes
(gloo ranks) with that release first on PYTHONPATH. Prints one line per run and exits 1 if any
router row, in the forward or the recompute, did not use its replayed experts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gpu"))
sys.path.insert(0, str(HERE))

CONFIGS: list[tuple[int, tuple[str, ...]]] = [
    (1, ("--extras", "--recompute", "full", "--no-cuda")),
    (1, ("--layout", "padded-left", "--recompute", "selective")),
    (2, ("--tp", "2", "--sp")),
    (2, ("--cp", "2")),
    (2, ("--ep", "2")),
    (2, ("--pp", "2", "--micro-batches", "4")),
    (4, ("--tp", "2", "--sp", "--pp", "2", "--vpp", "2", "--micro-batches", "4",
         "--recompute", "selective")),
    (4, ("--ep", "4", "--layout", "padded", "--recompute", "selective")),
]  # fmt: skip


def main() -> int:
    from harness import run_check
    from test_legacy_megatron import RELEASES, release_path

    from routereplay.local_redis import redis_server

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--releases", nargs="+", default=RELEASES)
    args = p.parse_args()
    failed = 0
    with redis_server() as url:
        for version in args.releases:
            env = {"PYTHONPATH": str(release_path(version))}
            for nproc, flags in CONFIGS:
                t0 = time.monotonic()
                try:
                    res = run_check(nproc, *flags, redis_url=url, env=env)
                    ok = all(
                        r["ok"]
                        and r["megatron"] == version
                        and r["replay_path"] == "legacy"
                        and all(
                            st["bad"] == 0 and st["rec"] == st["fwd"] > 0
                            for st in r["router_rows"].values()
                        )
                        for r in res
                    )
                    rows = sum(st["fwd"] for r in res for st in r["router_rows"].values())
                    detail = (
                        f"{rows} router rows replayed in forward and again in recompute, 0 wrong"
                        if ok
                        else str(res)[:500]
                    )
                except AssertionError as e:
                    ok, detail = False, str(e)[-800:]
                failed += not ok
                print(f"{'ok  ' if ok else 'FAIL'} megatron-core {version} x{nproc} "
                      f"{' '.join(flags):60s} {time.monotonic() - t0:5.1f}s  {detail}",
                      flush=True)  # fmt: skip
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
