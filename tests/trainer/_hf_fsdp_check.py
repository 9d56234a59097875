"""HFRouterReplayer under FSDP2, one process per rank (``torch.distributed.run``): a tiny
transformers MoE model with every decoder layer and the root ``fully_shard``-ed, gradient
accumulation over two micro-batches per rank, in float32 with activation checkpointing and
with bf16 mixed precision. Checks, per rank, that every router call (forward and recompute)
handed its experts exactly this micro-batch's targets, and (float32) that the sharded gradients
equal those of the unsharded model run on every rank's micro-batches (the data-parallel mean).
Prints one JSON line per configuration and rank; exits 1 if one fails.

    python -m torch.distributed.run --nproc-per-node 2 tests/trainer/_hf_fsdp_check.py \
        --device cpu --model-types qwen3_moe,deepseek_v3 --modes checkpointing,bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_replay import _experts_seen, _model, _targets

from routereplay.trainer_adapter.hf import HFRouterReplayer


def _batches(mt: str, world: int, n: int, seq: int) -> list[tuple[torch.Tensor, object]]:
    """Every rank's micro-batches, the same on every rank: ``(input_ids, targets)``."""
    model = _model(mt)
    out = []
    for i in range(world * n):
        rng = np.random.default_rng(100 + i)
        ids = torch.from_numpy(rng.integers(3, 96, (1, seq)))
        out.append((ids, _targets(model, seq, rng)))
    return out


def _loss(model: torch.nn.Module, ids: torch.Tensor, dev: torch.device) -> torch.Tensor:
    logits = model(ids.to(dev)).logits.float()
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:].to(dev))


def _reference(mt: str, batches: list, world: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """Gradients of the unsharded model over all ranks' micro-batches, averaged over ranks."""
    model = _model(mt).to(dev)
    rep = HFRouterReplayer(model)
    for ids, t in batches:
        with rep.micro_batch(t):
            (_loss(model, ids, dev) / world).backward()
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s part of ``full`` as FSDP2 shards it (``torch.chunk`` on dim 0; empty past
    the chunks there are)."""
    parts = torch.chunk(full, world, dim=0)
    return parts[rank] if rank < len(parts) else full[:0]


def check(mt: str, mode: str, rank: int, world: int, dev: torch.device) -> bool:
    """One configuration on this rank: prints its JSON line, returns whether it passed."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    n, ckpt, bf16, offload = 2, mode == "checkpointing", mode == "bf16", mode == "offload"
    batches = _batches(mt, world, n, ARGS.seq)
    mine = batches[rank * n : (rank + 1) * n]
    ref = None if bf16 else _reference(mt, batches, world, dev)
    # Offload: the sharded parameters (the routers' included) stay on the CPU and the forward
    # runs on the GPU, so the replay targets must follow the logits, not the router's weight.
    model = _model(mt) if offload else _model(mt).to(dev)
    if ckpt:
        model.gradient_checkpointing_enable()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    kw = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, **kw)
    fully_shard(model, mp_policy=mp, **kw)
    rep = HFRouterReplayer(model, shadow=True)
    seen, hooks = _experts_seen(model)
    calls_per_mb = 2 if ckpt else 1
    exact = True
    for i, (ids, t) in enumerate(mine):
        with rep.micro_batch(t):
            _loss(model, ids, dev).backward()  # FSDP2 averages the gradients over the ranks
        for k, layer in enumerate(rep.layers):
            got = seen[layer][i * calls_per_mb : (i + 1) * calls_per_mb]
            exact &= len(got) == calls_per_mb
            exact &= all(np.array_equal(idx.cpu().numpy(), t.experts[k]) for idx, _ in got)
    max_diff = None
    if ref is not None and offload:  # gradients on the CPU: this rank's shard, no collective
        grads = {name: p.grad.to_local() for name, p in model.named_parameters()
                 if p.grad is not None}  # fmt: skip
        ref = {name: _shard(g, rank, world) for name, g in ref.items()}
    elif ref is not None:
        grads = {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()
                 if p.grad is not None}  # fmt: skip
    if ref is not None:
        # A shard may be empty (fewer rows than ranks): it differs by nothing.
        max_diff = max(float((grads[name] - g).abs().max()) if g.numel() else 0.0
                       for name, g in ref.items())  # fmt: skip
        exact &= grads.keys() == ref.keys()
    ok = bool(exact) and (max_diff is None or max_diff < 1e-5)
    out = {
        "ok": ok, "rank": rank, "world": world, "device": str(dev), "model_type": mt,
        "mode": mode, "micro_batches": n, "routers": len(rep.layers),
        "targets_exact": bool(exact), "max_grad_diff_vs_unsharded": max_diff,
        "shadow_token_mismatch": round(rep.shadow_report().token_mismatch(), 4),
    }  # fmt: skip
    print("\n" + json.dumps(out), flush=True)
    rep.remove()
    for h in hooks:
        h.remove()
    dist.barrier()  # the next configuration starts together, this one's collectives all done
    return ok


def main() -> int:
    dist.init_process_group("nccl" if ARGS.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{rank}") if ARGS.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ok = True
    for mt in ARGS.model_types.split(","):
        for mode in ARGS.modes.split(","):
            ok &= check(mt, mode, rank, world, dev)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-types", default="qwen3_moe", help="comma-separated")
    p.add_argument("--modes", default="checkpointing,bf16",
                   help="checkpointing (float32, activation checkpointing, gradients compared), "
                   "bf16 (FSDP2 mixed precision) and/or offload (float32, parameters offloaded "
                   "to the CPU, CUDA only)")  # fmt: skip
    p.add_argument("--seq", type=int, default=24)
    ARGS = p.parse_args()
    code = main()
    # Every check has printed its line. On CPU, gloo's threads can abort the interpreter's
    # teardown afterwards ("terminate called without an active exception"), turning a pass into
    # a failure, so the process ends here without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
