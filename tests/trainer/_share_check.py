"""One rank of tests/trainer/test_share_targets.py: ``python _share_check.py RANK WORLD PORT``.

Four processes on gloo form two TP groups ([0, 1] and [2, 3], sources 0 and 2; each group its
own data-parallel rank, so its own records). Every rank checks what share_targets gives it
against gather_targets on its own position map (every byte), for each case: the whole rows
(sequence parallel off), the SP slices, uint16 ids with a replay mask, and a source whose
preparation fails. Exits 1 on any difference; prints one line per case.

With a fourth argument ``nccl`` (WORLD 2 or 4, one GPU per rank: tests/gpu/run_share_gpu.sh)
the default group is NCCL, as in a Megatron trainer, and the shares travel over gloo groups
made beside it; each rank then installs its ids on its GPU and gathers them over the NCCL TP
group, which must rebuild the group's whole rows.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from test_trainer_alignment import MOE, make_record

from routereplay.trainer_adapter import (
    ReplayTargets,
    TargetShareError,
    gather_targets,
    sample_from_record,
    share_targets,
    thd_position_map,
)


def step(dp: int, num_experts: int):
    rng = np.random.default_rng(100 + dp)
    lens = [37, 64, 21, 6]  # 128 tokens, padded to a multiple of 2 * TP below
    recs = [make_record(rng, rng.integers(0, 999, n), num_experts=num_experts) for n in lens]
    cu = np.concatenate([[0], np.cumsum(lens)])
    pm = thd_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], cu)
    return pm, recs


def same(a: ReplayTargets, b: ReplayTargets) -> bool:
    arrays = ("experts", "valid", "replay_mask", "weights")
    fields = ("layers", "num_experts", "filler_rows", "batch_shape", "order")
    for k in arrays:
        x, y = getattr(a, k), getattr(b, k)
        if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
            return False
        if x is not None and x.dtype != y.dtype:
            return False
    return all(getattr(a, k) == getattr(b, k) for k in fields)


def _same_on_gpus(got: ReplayTargets, whole: ReplayTargets, group, rank: int, case: str) -> bool:
    """Install ``got``'s ids on this rank's GPU and gather them over the NCCL TP group: the
    two ranks' rows, joined (SP halves) or each (whole rows), are the group's whole rows."""
    ids = torch.from_numpy(got.experts.astype(np.int32)).cuda()
    parts = [torch.empty_like(ids) for _ in range(2)]
    dist.all_gather(parts, ids, group=group)
    want = torch.from_numpy(whole.experts.astype(np.int32)).cuda()
    rows = 1  # experts is [layers, rows, k]
    joined = parts if got.num_tokens == whole.num_tokens else [torch.cat(parts, dim=rows)]
    ok = all(torch.equal(p, want) for p in joined)
    print(f"rank {rank} {case}: on GPU {torch.cuda.current_device()}, gathered over NCCL: "
          f"{'whole rows' if ok else 'DIFFERENT'}")  # fmt: skip
    return ok


def main() -> int:
    rank, world, port = (int(x) for x in sys.argv[1:4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nccl = sys.argv[4:] == ["nccl"]
    if nccl:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))  # fmt: skip
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    tp_ranks = [[r, r + 1] for r in range(0, world, 2)]
    groups = [dist.new_group(r, backend="gloo") for r in tp_ranks]  # every rank makes each
    nccl_groups = [dist.new_group(r) for r in tp_ranks] if nccl else []
    dp, tp_rank = divmod(rank, 2)
    group, src = groups[dp], 2 * dp
    ok = True
    for case, E, sp, own in [("whole", 16, False, ()), ("sp", 16, True, ()),
                             ("uint16+mask", 300, True, (1,))]:  # fmt: skip
        pm, recs = step(dp, E)

        def prepare(pm=pm, recs=recs, own=own, case=case) -> tuple[ReplayTargets, dict]:
            t = gather_targets(pm.local(tp_size=2, sequence_parallel=False), recs, MOE,
                               own_routing=own)  # fmt: skip
            return t, {"case": case, "dp": dp}  # what every rank needs beside the targets

        got, extra = share_targets(prepare if rank == src else None, group=group, src=src,
                                   sequence_parallel=sp)  # fmt: skip
        if extra != {"case": case, "dp": dp}:
            print(f"rank {rank} {case}: extra {extra!r} DIFFERENT")
            ok = False
        want = gather_targets(pm.local(tp_size=2, tp_rank=tp_rank, sequence_parallel=sp), recs,
                              MOE, own_routing=own)  # fmt: skip
        good = same(got, want) and got.experts.dtype == (np.uint16 if E > 256 else np.uint8)
        print(f"rank {rank} {case}: {'same' if good else 'DIFFERENT'} rows {got.num_tokens}")
        ok &= good
        if nccl:
            whole = prepare()[0]  # the group's whole rows, as the source prepared them
            ok &= _same_on_gpus(got, whole, nccl_groups[dp], rank, case)

    def broken() -> ReplayTargets:
        raise KeyError("route r-7 is gone")

    try:
        share_targets(broken if rank == src else None, group=group, src=src)
        print(f"rank {rank} failure: NOT RAISED")
        ok = False
    except TargetShareError as e:
        print(f"rank {rank} failure: receiver raised: {e}")
        ok &= rank != src and "route r-7 is gone" in str(e) and f"rank {src}" in str(e)
    except KeyError as e:
        print(f"rank {rank} failure: source raised its own {e!r}")
        ok &= rank == src
    try:
        share_targets(None, group=group, src=src)  # the source forgot its prepare
        print(f"rank {rank} no prepare: NOT RAISED")
        ok = False
    except TargetShareError as e:
        print(f"rank {rank} no prepare: receiver raised")
        ok &= rank != src and "must pass prepare" in str(e)
    except ValueError:
        print(f"rank {rank} no prepare: source raised")
        ok &= rank == src
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
