"""How share_targets moves a step's targets, measured: TP2 on this host, 102 MB of targets
[48, 265216, 8] uint8, each rank getting its SP half: a gloo scatter (what share_targets does)
against POSIX shared memory (rank 0 writes the whole rows into a segment, rank 1 copies its half
out). Best of 3 each; prints wall time and each rank's CPU time.

    python tests/trainer/share_transport.py 1 29533 &
    python tests/trainer/share_transport.py 0 29533
"""

import os
import sys
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2)
M, N, K = 48, 265216, 8
full = np.random.default_rng(0).integers(0, 128, (M, N, K), dtype=np.uint8) if rank == 0 else None
res = {}
for way in ("scatter", "shm") * 3:
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    if way == "scatter":
        mine = np.empty((M, N // 2, K), np.uint8)
        parts = (
            [
                torch.from_numpy(
                    np.ascontiguousarray(full[:, r * N // 2 : (r + 1) * N // 2]).reshape(-1)
                )
                for r in range(2)
            ]
            if rank == 0
            else None
        )
        dist.scatter(torch.from_numpy(mine.reshape(-1)), parts, src=0)
    else:
        name = [None]
        if rank == 0:
            shm = shared_memory.SharedMemory(create=True, size=full.nbytes)
            np.ndarray(full.shape, np.uint8, shm.buf)[:] = full
            name = [shm.name]
        dist.broadcast_object_list(name, src=0)
        if rank == 1:
            shm = shared_memory.SharedMemory(name=name[0])
            mine = np.ndarray((M, N, K), np.uint8, shm.buf)[:, N // 2 :].copy()
        else:
            mine = np.ascontiguousarray(full[:, : N // 2])
        dist.barrier()
        shm.close()
        if rank == 0:
            shm.unlink()
    c1 = time.process_time()
    dist.barrier()
    res.setdefault(way, []).append((time.perf_counter() - t0, c1 - c0))
out = [None, None]
dist.all_gather_object(out, res)
if rank == 0:
    for way in ("scatter", "shm"):
        walls = [min(w for w, _ in out[r][way]) for r in range(2)]
        cpus = [min(c for _, c in out[r][way]) for r in range(2)]
        print(f"{way:8s} wall {max(walls):.3f} s, CPU rank0 {cpus[0]:.3f} s rank1 {cpus[1]:.3f} s")
dist.destroy_process_group()
