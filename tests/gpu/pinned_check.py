"""gather_targets(pin_memory=True) on a GPU: the same targets as the pageable path, in page-locked
memory, and safe to drop right after to_torch's asynchronous copy (torch's caching host allocator
must not hand the block to the next step's targets before the copy has read it). Run by
tests/gpu/run_bench_host.sh; exits non-zero on any mismatch."""

from __future__ import annotations

import sys

import numpy as np
import torch

from routereplay.client import RouteRecord
from routereplay.trainer_adapter import (
    gather_targets,
    padded_position_map,
    sample_from_record,
    thd_position_map,
)

L, MOE, K = 6, (1, 2, 4, 5), 4


def records(rng, lens, E):
    out = []
    for n in lens:
        arr = np.zeros((n - 1, L, K), np.int64)
        for layer in MOE:
            arr[:, layer] = np.argsort(rng.random((n - 1, E)), 1)[:, :K]
        tok = rng.integers(0, 999, n)
        out.append(
            RouteRecord.from_engine(
                arr, tok, prompt_len=2, num_experts=E, moe_layers=MOE, num_layers=L
            )
        )
    return out


def main() -> int:
    rng = np.random.default_rng(0)
    fails = 0
    for E in (64, 300):  # uint8 and uint16 ids
        recs = records(rng, [int(x) for x in rng.integers(50, 400, 12)], E)
        samples = [sample_from_record(i, r) for i, r in enumerate(recs)]
        lens = np.array([r.num_tokens for r in recs])
        maps = {
            "thd": thd_position_map(samples, np.concatenate([[0], np.cumsum(lens)])),
            "padded": padded_position_map(samples, int(lens.max()), records=recs),
        }
        for name, pm in maps.items():
            want = gather_targets(pm, recs, MOE)
            got = gather_targets(pm, recs, MOE, pin_memory=True)
            ok = (
                got.pinned is not None
                and got.pinned.is_pinned()
                and got.pinned.data_ptr() == got.experts.ctypes.data
                and np.array_equal(got.experts, want.experts)
                and np.array_equal(got.valid, want.valid)
                and torch.equal(got.to_torch("cuda").cpu(), want.to_torch())
            )
            print(f"E={E} {name}: pinned targets equal the pageable ones: {ok}")
            fails += not ok
    # Drop each step's host targets right after queueing its copy behind a long GPU kernel: if
    # their block were reused early, a later step's rows would reach an earlier step's tensor.
    sets = [records(rng, [int(x) for x in rng.integers(2000, 6000, 16)], 64) for _ in range(4)]
    pms = []
    for rs in sets:
        lens = np.array([r.num_tokens for r in rs])
        smp = [sample_from_record(i, r) for i, r in enumerate(rs)]
        pms.append(thd_position_map(smp, np.concatenate([[0], np.cumsum(lens)])))
    truth = [gather_targets(pm, rs, MOE).to_torch() for pm, rs in zip(pms, sets, strict=True)]
    a = torch.randn(4096, 4096, device="cuda")
    dev = []
    for i in range(40):
        for _ in range(20):
            a = torch.tanh(a @ a)  # keeps the stream busy: the copy below waits behind it
        tg = gather_targets(pms[i % 4], sets[i % 4], MOE, pin_memory=True)
        dev.append(tg.to_torch("cuda"))
        del tg
    torch.cuda.synchronize()
    bad = [i for i, t in enumerate(dev) if not torch.equal(t.cpu(), truth[i % 4])]
    print(f"40 steps dropped right after their asynchronous copy: {len(bad)} corrupted {bad[:5]}")
    fails += bool(bad)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
