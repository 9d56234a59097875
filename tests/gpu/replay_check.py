"""End-to-end replay check on a real Megatron-Core GPTModel, CPU (gloo) or GPU (NCCL).

Builds a small MoE GPTModel (4 layers, layer 1 dense: ``moe_layer_freq=[0, 1, 1, 1]``, 8 experts,
top-2), makes route records the way vLLM returns them (``[T-1, L, K]``, dense layer all zero, last
token unrouted), optionally stores them in Redis and fetches them back with ``RouteStore.get_many``
(else a codec round trip), packs several samples (plain, shared-prefix GRPO group, multi-turn) as
THD or as a right-padded batch, aligns and slices them with ``routereplay.trainer_adapter`` and
replays them with :class:`RouterReplayer`, two micro-batches forward then both backward (so
recompute pops the FIFO across micro-batches).

Independent proof: the expected experts of every router row are computed from the records with a
plain per-position lookup, and the row -> packed-position order comes from Megatron's own sharding
(``get_batch_on_this_cp_rank`` for BSHD context parallel, ``scatter_to_sequence_parallel_region``
for sequence parallel; THD context parallel uses the TE index order, reimplemented since TE is
absent). Forward hooks on every router compare its routing_map with that truth, in the forward and
in the recompute; hooks on the experts compare tokens per expert (summed over the expert group).

``--policy own_routing|drop``: record 0 comes from stale weights and a fifth sample's record is
missing from the store; a :class:`ReplayPolicy` decides per sample. ``own_routing``: the hooks
prove that every row of those samples took the router's own top-k of the forward's scores, that
replayed rows kept their routes, that recompute repeated the forward's choices, and (without
pipeline parallel) that a forward without replay chose the same experts there. ``drop``: the
loss mask is False exactly at the dropped samples' positions, and the batch re-packed from the
kept samples replays every row.

Each rank prints ``RESULT {json}`` and exits 1 on any mismatch. Launch:
    python tests/gpu/replay_check.py --device cpu                          # world size 1
    python -m torch.distributed.run --nproc-per-node 2 tests/gpu/replay_check.py --tp 2 --sp
CPU runs need test-only shims (see ``_cpu_shims``), as measured in
shared/notes/megatron-router-replay.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

NUM_LAYERS = 4
MOE_FREQ = [0, 1, 1, 1]
MOE_LAYERS = (1, 2, 3)  # global 0-based; Megatron layer_number 2, 3, 4
E = 8
K = 2
V = 128
PACK_LEN = 128  # THD tokens per micro-batch
PAD_LEN = 32  # padded layout: sequence length
H = 64


# ---------------------------------------------------------------------------------------------
# test-only shims and modules
# ---------------------------------------------------------------------------------------------
def _cpu_pipeline_shims() -> None:
    """Megatron's schedules allocate a token counter on the GPU (device="cuda" or .cuda())."""
    from megatron.core.pipeline_parallel import schedules

    class _Torch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*a, **k):
            if k.get("device") == "cuda":
                k["device"] = "cpu"
            return torch.zeros(*a, **k)

    schedules.torch = _Torch()
    # 0.12's 1F1B schedule also moves a token counter with .cuda().
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _no_te_shims() -> None:
    """megatron-core 0.13-0.16 name te_general_gemm in the router's gating even without
    Transformer Engine (it is bound only when TE imports): NameError on any device."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_shims() -> None:
    """Let megatron-core run a full MoE model on CPU (see the notes): Router.gating moves weights
    to torch.cuda.current_device(); recompute saves the CUDA RNG state."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def _forbid_cuda_in_routereplay() -> None:
    """Every ``torch.cuda`` function raises when called from routereplay's own code (the
    adapter's replay path must take devices from tensors: NPU stacks have no CUDA). Megatron's
    calls, which the CPU shims above answer, still pass."""
    import functools
    import types

    import routereplay.client
    import routereplay.trainer_adapter

    ours = tuple(
        os.path.dirname(os.path.abspath(m.__file__)) + os.sep
        for m in (routereplay.trainer_adapter, routereplay.client)
    )

    def guard(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
            if caller.startswith(ours):
                raise RuntimeError(f"torch.cuda.{name} called from {caller}")
            return fn(*a, **k)

        return wrapper

    for name in dir(torch.cuda):
        fn = getattr(torch.cuda, name)
        if isinstance(fn, types.FunctionType) and not name.startswith("_"):
            setattr(torch.cuda, name, guard(name, fn))
    torch.cuda.is_available = guard("is_available", lambda: False)


class _GatherCP(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward sums and keeps this rank's slice
    (gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ws = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.n = x.shape[0]
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * ctx.n : (r + 1) * ctx.n], None


class PackedCausalAttention(torch.nn.Module):
    """Core attention for tests: causal within each packed sequence, keys gathered over the CP
    group, masked by true (sequence id, position). Replaces DotProductAttention, which refuses THD
    and context parallel without Transformer Engine. Routing does not depend on it being fast.

    The sequence ids and positions of this rank's query rows come as the ``attention_mask``
    argument, ``[B, 2, S_local]`` int (:func:`seq_mask`): activation checkpointing saves it with
    the layer's inputs, so a recompute attends as its own micro-batch's forward did."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        super().__init__()
        self.config = config
        self.scale = config.kv_channels**-0.5

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        from megatron.core import parallel_state as ps

        seq, pos = attention_mask[:, 0], attention_mask[:, 1]  # [B, Sq]
        kseq, kpos = seq, pos
        if ps.get_context_parallel_world_size() > 1:
            g = ps.get_context_parallel_group()
            key = _GatherCP.apply(key, g)
            value = _GatherCP.apply(value, g)
            kseq = _GatherCP.apply(seq.t().contiguous(), g).t()
            kpos = _GatherCP.apply(pos.t().contiguous(), g).t()
        if key.shape[2] != query.shape[2]:  # GQA
            rep = query.shape[2] // key.shape[2]
            key = key.repeat_interleave(rep, 2)
            value = value.repeat_interleave(rep, 2)
        scores = torch.einsum("sbnh,tbnh->bnst", query, key) * self.scale
        mask = (seq[:, :, None] == kseq[:, None, :]) & (kpos[:, None, :] <= pos[:, :, None])
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores.float(), -1).to(query.dtype)
        out = torch.einsum("bnst,tbnh->sbnh", probs, value)
        return out.reshape(out.shape[0], out.shape[1], -1)


def seq_mask(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The ``attention_mask`` :class:`PackedCausalAttention` reads: ``[B, 2, S]``."""
    return torch.stack([seq, pos], 1)


class SPNorm:
    """LayerNorm/RMSNorm that tolerates sequence parallel (norms are per token); Megatron's
    WrappedTorchNorm asserts it away when Transformer Engine is absent."""

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if config.normalization == "RMSNorm":
            m = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            m = torch.nn.LayerNorm(hidden_size, eps=eps)
        for p in m.parameters():
            p.sequence_parallel = config.sequence_parallel
        return m


def _patch_spec(obj, mapping: dict) -> None:
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, ModuleSpec):
        if isinstance(obj.module, type) and obj.module in mapping:
            obj.module = mapping[obj.module]
        _patch_spec(obj.submodules, mapping)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, type) and v in mapping:
                setattr(obj, f.name, mapping[v])
            else:
                _patch_spec(v, mapping)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _patch_spec(x, mapping)


# ---------------------------------------------------------------------------------------------
# records and batches
# ---------------------------------------------------------------------------------------------
# --policy: the weights the trainer is at; record STALE comes from older ones, record MISSING
# (a fifth sample) is not in the store.
CURRENT, STALE, MISSING = "step-5", 0, 6


def make_records(seed: int, policy: bool = False):
    """Records as vLLM returns them: [T-1, L, K] with the dense layer all zero. ``policy``:
    weight versions on every record (record STALE's two behind) and a seventh record, MISSING."""
    from routereplay.client._record import RouteRecord

    rng = np.random.default_rng(seed)

    def rec(tokens: np.ndarray, prompt_len: int, invalid_extra: int = 0) -> RouteRecord:
        T = len(tokens)
        R = T - 1
        arr = np.zeros((R, NUM_LAYERS, K), np.int64)
        for layer in MOE_LAYERS:
            arr[:, layer] = np.argsort(rng.random((R, E)), axis=1)[:, :K]
        version = "step-3" if policy and not made else CURRENT
        made.append(T)
        r = RouteRecord.from_engine(
            arr,
            tokens,
            prompt_len=prompt_len,
            num_experts=E,
            moe_layers=MOE_LAYERS,
            num_layers=NUM_LAYERS,
            model="tiny-moe",
            weight_versions=((version, 0, T),) if policy else (),
        )
        if invalid_extra:  # rows an engine could not return (e.g. a lost prefix-cache hit)
            r.valid[1 : 1 + invalid_extra] = False
        return r

    def toks(n: int) -> np.ndarray:
        return rng.integers(1, V, n)

    made: list[int] = []
    recs = [rec(toks(int(rng.integers(9, 20))), 4), rec(toks(int(rng.integers(5, 12))), 3, 2)]
    prompt = toks(6)  # GRPO group: one prompt, two completions
    recs += [rec(np.concatenate([prompt, toks(5)]), 6), rec(np.concatenate([prompt, toks(8)]), 6)]
    t1 = toks(10)  # multi-turn: turn 2 re-sends turn 1 and adds a tool reply + completion
    recs += [rec(t1, 5), rec(np.concatenate([t1, toks(9)]), 15)]
    if policy:
        recs.append(rec(toks(int(rng.integers(6, 12))), 3))
    return recs


def with_engine_weights(recs, seed: int) -> list:
    """``--weights engine``: each record carries engine routing weights (bfloat16 values, 0 at
    invalid rows), as an engine stores them next to the ids."""
    rng = np.random.default_rng(seed + 7)
    for r in recs:
        if r is None:
            continue
        w = rng.random(r.experts.shape).astype(np.float32) + 0.05
        w = (w / w.sum(-1, keepdims=True)).astype(np.float32)
        w = (w.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bfloat16-exact
        w[~r.valid] = 0
        r.weights, r.weights_dtype = w, "bfloat16"
    return recs


def truth_weights(pm, recs) -> tuple[np.ndarray, np.ndarray]:
    """``[M, B*S, K]`` engine weights and ``[B*S]`` valid rows in batch-major position order,
    by plain per-position lookup (as :func:`truth_experts`)."""
    rec = pm.record.reshape(-1)
    tok = pm.token.reshape(-1)
    out = np.zeros((len(MOE_LAYERS), rec.size, K), np.float32)
    valid = np.zeros(rec.size, bool)
    for p in range(rec.size):
        r = int(rec[p])
        if r >= 0 and recs[r] is not None and recs[r].valid[tok[p]]:
            out[:, p] = recs[r].weights[tok[p]]
            valid[p] = True
    return out, valid


def sample_maps(recs, missing_tokens=None):
    """The samples and the trainer's token ids. ``missing_tokens``: a fifth sample, record
    MISSING's, whose record the store does not have (``recs[MISSING] is None``)."""
    from routereplay.trainer_adapter import (
        multi_turn_sample,
        sample_from_record,
        shared_prefix_sample,
    )

    samples = [
        sample_from_record(0, recs[0]),
        sample_from_record(1, recs[1]),
        shared_prefix_sample([2, 3], recs, sample=2),
        multi_turn_sample([4, 5], recs, sample=3),
    ]
    # The trainer's own token ids for each sample (built from the rollouts, not from the maps).
    tokens = [
        recs[0].token_ids,
        recs[1].token_ids,
        np.concatenate([recs[2].token_ids, recs[3].token_ids[recs[3].prompt_len :]]),
        recs[5].token_ids,
    ]
    if missing_tokens is not None:
        samples.append(sample_from_record(MISSING, None, length=len(missing_tokens)))
        tokens.append(missing_tokens)
    return samples, tokens


def truth_experts(pm, recs) -> np.ndarray:
    """[M, B*S, K] expected experts in batch-major position order, by plain per-position lookup
    (a second implementation, independent of gather_targets' run copies)."""
    from routereplay.trainer_adapter import filler_experts

    rec = pm.record.reshape(-1)
    tok = pm.token.reshape(-1)
    pos = pm.position.reshape(-1)
    out = np.zeros((len(MOE_LAYERS), rec.size, K), np.int64)
    for p in range(rec.size):
        r = int(rec[p])
        if r >= 0 and recs[r] is not None and recs[r].valid[tok[p]]:
            out[:, p] = recs[r].experts[tok[p]]  # all records carry MOE_LAYERS in order
        else:
            out[:, p] = filler_experts(np.array([pos[p]]), E, K)[0]
    return out


def build_batch(args, recs, mb: int, missing_tokens=None, keep=None):
    """Global (unsliced) batch of micro-batch ``mb``: position map, tokens, positions, seq ids.
    ``keep``: re-pack only these samples (a ReplayReport's ``kept``)."""
    from routereplay.trainer_adapter import padded_position_map, thd_position_map

    samples, tokens = sample_maps(recs, missing_tokens)
    # Every micro-batch packs the samples in another order (rotated, reversed on odd ones), so
    # replaying micro-batch i's targets for micro-batch j != i shows up as wrong rows.
    r = mb % len(samples)
    samples, tokens = samples[r:] + samples[:r], tokens[r:] + tokens[:r]
    if (mb // len(samples)) % 2:
        samples, tokens = samples[::-1], tokens[::-1]
    if keep is not None:
        samples, tokens = [samples[i] for i in keep], [tokens[i] for i in keep]
    mult = 2 * args.cp * args.tp
    if args.layout == "thd":
        lens = np.array([len(t) for t in tokens])
        plens = -(-lens // mult) * mult
        # A fixed pack length (the last sequence's padding absorbs the rest), as trainers pad
        # packs: the allgather dispatcher needs equal token counts on every rank.
        plens[-1] += PACK_LEN - plens.sum()
        cu = np.concatenate([[0], np.cumsum(lens)])
        cup = np.concatenate([[0], np.cumsum(plens)])
        pm = thd_position_map(samples, cu, cu_seqlens_padded=cup, records=recs)
        T = int(cup[-1])
        ids = np.zeros((1, T), np.int64)
        seq = np.full((1, T), -1, np.int64)
        pos = np.zeros((1, T), np.int64)
        for i, t in enumerate(tokens):
            ids[0, cup[i] : cup[i] + len(t)] = t
            seq[0, cup[i] : cup[i + 1]] = i
            pos[0, cup[i] : cup[i + 1]] = np.arange(plens[i])
        return pm, ids, seq, pos, cup
    S = PAD_LEN
    side = "left" if args.layout == "padded-left" else "right"
    pm = padded_position_map(samples, S, padding_side=side, records=recs)
    ids = np.zeros((len(tokens), S), np.int64)
    for b, t in enumerate(tokens):
        if side == "right":
            ids[b, : len(t)] = t
        else:
            ids[b, S - len(t) :] = t
    # Padding is a sequence of its own, as a trainer's attention mask makes it: left padding
    # would otherwise reach every token's attention, and its routing differs between a replayed
    # forward (fillers) and one without replay.
    seq = np.where(pm.sample >= 0, 0, -1).astype(np.int64)
    pos = np.broadcast_to(np.arange(S), ids.shape).copy()
    return pm, ids, seq, pos, None


def megatron_rows(args, B: int, S: int, cup) -> np.ndarray:
    """Packed positions (b * S + s) of this rank's router rows, in router row order, derived with
    Megatron's own sharding functions."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.utils import get_batch_on_this_cp_rank

    from routereplay.trainer_adapter import thd_cp_index

    gpos = torch.arange(B * S, dtype=torch.int64).reshape(B, S)
    if args.cp > 1:
        if cup is None:
            gpos = get_batch_on_this_cp_rank({"tokens": gpos})["tokens"]
        else:  # TE's thd_get_partitioned_indices order (TE absent here)
            idx = thd_cp_index(cup, args.cp, ps.get_context_parallel_rank(), total=S)
            gpos = gpos[:, torch.from_numpy(idx)]
    sb = gpos.t().contiguous().float()  # [S_local, B] as the embedding emits it
    if args.sp and args.tp > 1:
        sb = tensor_parallel.scatter_to_sequence_parallel_region(sb)
    return sb.reshape(-1).long().numpy()


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def build_model(args, device) -> list:
    """This rank's model chunks (one per virtual pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    rc = {}
    if args.recompute == "full":
        rc = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif args.recompute == "selective":
        rc = dict(recompute_granularity="selective", recompute_modules=["moe"])
    # megatron-core < 0.16 has no replay flag: its models are built as users build them today,
    # and RouterReplayer attaches the legacy replay state afterwards.
    if "moe_enable_routing_replay" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        rc["moe_enable_routing_replay"] = args.replay_path != "legacy"
    cfg = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=64,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_layer_freq=MOE_FREQ,
        moe_token_dispatcher_type=args.dispatcher,
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        tensor_model_parallel_size=args.tp,
        sequence_parallel=args.sp,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
        batch_p2p_sync=False,
        use_cpu_initialization=device.type == "cpu",
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        **rc,
    )
    import inspect

    # megatron-core 0.12 has no vp_stage arguments: each chunk is built under the global
    # virtual pipeline rank instead.
    has_vp_stage = "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters
    chunks = []
    for vp in range(args.vpp):
        vp_stage = vp if args.vpp > 1 else None
        skw = {"vp_stage": vp_stage} if vp_stage is not None and has_vp_stage else {}
        if args.vpp > 1 and not has_vp_stage:
            ps.set_virtual_pipeline_model_parallel_rank(vp)
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, **skw)
        _patch_spec(spec, {DotProductAttention: PackedCausalAttention, WrappedTorchNorm: SPNorm})
        kw = skw
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=V,
            max_sequence_length=256,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=False,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, **skw),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, **skw),
            **kw,
        )
        chunks.append(model.to(device))
    if args.vpp > 1 and not has_vp_stage:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


def adopt_records(args) -> list:
    """``--route-ids``: replay records a real engine produced (e.g. the routereplay service over
    vLLM), fetched from Redis. The model takes their shape: layers, MoE layers, experts, top-k,
    and a vocabulary that holds their token ids. Six ids, in the roles of ``make_records``: two
    single samples, a GRPO pair (same prompt), and two turns (turn 2 starts with turn 1)."""
    global NUM_LAYERS, MOE_FREQ, MOE_LAYERS, E, K, V
    from routereplay.client import RouteStore

    ids = args.route_ids.split(",")
    if len(ids) != 6:
        raise SystemExit(f"--route-ids needs 6 ids, got {len(ids)}")
    store = RouteStore.from_url(args.redis_url, prefix=args.route_prefix)
    recs = store.get_many(ids)
    store.close()
    r0 = recs[0]
    if any(r.moe_layers != r0.moe_layers or r.top_k != r0.top_k for r in recs):
        raise SystemExit("--route-ids records come from different model shapes")
    NUM_LAYERS, MOE_LAYERS = r0.num_layers, tuple(r0.moe_layers)
    MOE_FREQ = [int(layer in MOE_LAYERS) for layer in range(NUM_LAYERS)]
    E, K = r0.num_experts, r0.top_k
    V = max(V, max(int(r.token_ids.max()) for r in recs) + 1)
    return recs


def fetch_records(args, recs, dp_rank: int = 0, missing: int | None = None):
    """Round trip through Redis (RouteStore.get_many) or, without Redis, the codec. Ids carry
    the data-parallel rank: replicas hold different records, and shared ids would race.
    ``missing``: that record is never stored, and comes back None."""
    if args.route_ids:
        return recs, "engine"
    ids = [f"check-{args.seed}-dp{dp_rank}-{i}" for i in range(len(recs))]
    if args.redis_url:
        from routereplay.client import RouteStore

        store = RouteStore.from_url(args.redis_url, prefix=f"rrcheck{args.seed}")
        for j, (i, r) in enumerate(zip(ids, recs, strict=True)):
            if j != missing:
                store.put(i, r)
        dist.barrier()
        got = store.get_many(ids, missing_ok=missing is not None)
        store.close()
        return got, "redis"
    from routereplay.client._codec import decode_record, encode_record

    got = [decode_record(encode_record(r)) for r in recs]
    if missing is not None:
        got[missing] = None
    return got, "codec"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline stage")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--dispatcher", default="allgather", choices=["allgather", "alltoall"])
    p.add_argument("--recompute", default="full", choices=["none", "full", "selective"])
    p.add_argument("--layout", default="thd", choices=["thd", "padded", "padded-left"])
    p.add_argument("--redis-url", default="")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--extras", action="store_true", help="also R2 mode, shape and stale checks")
    p.add_argument("--route-ids", default="", help="6 comma-separated ids to replay from Redis")
    p.add_argument("--route-prefix", default="rr", help="store prefix of --route-ids")
    p.add_argument(
        "--replay-path", default="auto", choices=["auto", "legacy"],
        help="RouterReplayer(path=...): legacy forces the 0.12-0.15 path on a newer release",
    )  # fmt: skip
    p.add_argument(
        "--pin-memory", action="store_true",
        help="gather the targets into page-locked memory (gather_targets(pin_memory=True))",
    )  # fmt: skip
    p.add_argument(
        "--no-cuda", action="store_true",
        help="make every torch.cuda call from routereplay's code raise (device-agnostic proof)",
    )  # fmt: skip
    p.add_argument(
        "--weights", default="ids", choices=["ids", "engine"],
        help="RouterReplayer(weights=...): engine also replays the records' routing weights",
    )  # fmt: skip
    p.add_argument(
        "--policy", default="none", choices=["none", "own_routing", "drop"],
        help="a stale and a missing record, and ReplayPolicy(on_violation=...) per sample",
    )  # fmt: skip
    p.add_argument(
        "--perturb-router", action="store_true",
        help="change the router weights between the forwards and the backwards (restored "
        "after): a recompute choosing afresh would choose other experts",
    )  # fmt: skip
    args = p.parse_args(argv)
    t_start = time.time()

    if "RANK" not in os.environ:  # single process without a launcher
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl")
    else:
        _cpu_shims()
        dist.init_process_group("gloo")
        if args.pp > 1:
            _cpu_pipeline_shims()
    rank = dist.get_rank()
    _no_te_shims()

    import megatron.core
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay
    except ImportError:  # megatron-core < 0.16
        RouterReplay = None
    if args.no_cuda:
        _forbid_cuda_in_routereplay()

    from routereplay.trainer_adapter import (
        R2Recorder,
        RouterReplayer,
        TargetShapeError,
        gather_targets,
    )

    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
    )
    kw = {"inference_rng_tracker": True} if device.type == "cpu" else {}
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed, **kw)
    torch.manual_seed(args.seed)

    result: dict = {
        "rank": rank,
        "world": dist.get_world_size(),
        "megatron": megatron.core.__version__,
        "args": {k: v for k, v in vars(args).items() if k not in ("redis_url", "route_ids")},
    }
    # Engine records set the model's shape, so they are read before the model is built.
    adopted = adopt_records(args) if args.route_ids else None
    native = RouterReplay is not None and args.replay_path != "legacy"
    if args.extras and native:  # a stale model: its RouterReplay instances stay in the global list
        RouterReplay.clear_global_router_replay_instances()
        build_model(args, device)
        result["stale_instances_before_build"] = len(RouterReplay.global_router_replay_instances)
    chunks = build_model(args, device)
    for c in chunks:
        c.train()
    model = chunks[0]
    replayer = RouterReplayer(chunks, path=args.replay_path, weights=args.weights)
    result["replay_path"] = "legacy" if replayer.legacy else "native"
    result["router_layer_numbers"] = [s.layer_number for s in replayer.slots]
    result["router_chunks"] = [s.chunk for s in replayer.slots]
    if native:
        result["global_instances"] = len(RouterReplay.global_router_replay_instances)
    mine = [MOE_LAYERS.index(x) for x in replayer.layers]  # this rank's rows of the truth

    dp_rank = ps.get_data_parallel_rank()
    policy = args.policy != "none"
    if adopted is not None:  # records from a real engine, same data on every replica
        recs = adopted
    else:  # each data-parallel replica its own data
        recs = make_records(args.seed + 1000 * dp_rank, policy=policy)
    engine = args.weights == "engine"
    if engine and adopted is None:  # a real engine's records bring the weights it applied
        recs = with_engine_weights(recs, args.seed + 1000 * dp_rank)
    missing_tokens = recs[MISSING].token_ids if policy else None  # the trainer has its tokens
    sent = recs
    recs, source = fetch_records(args, recs, dp_rank, missing=MISSING if policy else None)
    result["records_from"] = source
    if engine:  # a store that does not keep the weights plane yet: the check is the replay's
        result["weights_from"] = "store"
        if any(r is not None and getattr(r, "weights", None) is None for r in recs):
            result["weights_from"] = "attached"
            for r, o in zip(recs, sent, strict=True):
                if r is not None:
                    r.weights, r.weights_dtype = o.weights, o.weights_dtype

    # ---- per micro-batch: align, slice, truth --------------------------------------------------
    cp_rank = ps.get_context_parallel_rank()
    tp_rank = ps.get_tensor_model_parallel_rank()
    mbs = []
    for mb in range(args.micro_batches):
        pm, ids, seq, pos, cup = build_batch(args, recs, mb, missing_tokens)
        report = None
        if policy:
            report = decide(args, pm, recs, replayer.layers, result)
            if args.policy == "drop":  # the caller re-packs the kept samples
                keep = report.kept
                pm, ids, seq, pos, cup = build_batch(args, recs, mb, missing_tokens, keep)
                again = decide(args, pm, recs, replayer.layers)
                result.setdefault("repacked_decisions", []).append(len(again.decisions))
        pm.check_tokens(recs, ids)
        local = pm.local(
            cp_size=args.cp,
            cp_rank=cp_rank,
            tp_size=args.tp,
            tp_rank=tp_rank,
            sequence_parallel=args.sp,
            cu_seqlens_padded=cup,
        )
        own_routing = report.own_routing if report is not None else ()
        targets = gather_targets(
            local, recs, replayer.layers, pin_memory=args.pin_memory, own_routing=own_routing,
            weights=engine,
        )  # fmt: skip
        assert (targets.pinned is not None) == args.pin_memory
        B, S = pm.shape
        rows = megatron_rows(args, B, S, cup)
        truth = truth_experts(pm, recs)[:, rows]  # [M_all, N_local, K]
        w_truth, w_valid = truth_weights(pm, recs) if engine else (None, None)
        if engine:
            w_truth, w_valid = w_truth[:, rows], w_valid[rows]
        # Router rows whose experts the router chooses, from the report's unsliced mask placed
        # by Megatron's own sharding (independent of gather_targets' slicing).
        own = np.zeros(rows.size, bool)
        if report is not None:
            own = ~report.replay_mask.reshape(-1)[rows]
        got_mask = np.ones(rows.size, bool) if targets.replay_mask is None else targets.replay_mask
        if engine:  # own rows keep the router's probabilities: gathered as 0, like fillers
            result.setdefault("weights_equal_truth", []).append(
                bool(np.array_equal(targets.weights, np.where(own[:, None], 0, w_truth[mine])))
            )
        result.setdefault("replay_mask_equal", []).append(bool(np.array_equal(got_mask, ~own)))
        # the model's inputs, sharded for CP as Megatron shards them (rows of the [B, S] batch)
        cp_idx = np.arange(S)
        if args.cp > 1:
            from routereplay.trainer_adapter import cp_zigzag_index, thd_cp_index

            cp_idx = (
                thd_cp_index(cup, args.cp, cp_rank, total=S)
                if cup is not None
                else cp_zigzag_index(S, args.cp, cp_rank)
            )

        def t(a, cp_idx=cp_idx):
            return torch.from_numpy(np.ascontiguousarray(a[:, cp_idx])).to(device)

        mbs.append(
            dict(
                targets=targets,
                truth=truth,
                w_truth=w_truth,
                w_valid=w_valid,
                ids=t(ids),
                seq=t(seq),
                pos=t(pos),
                labels=t(np.roll(ids, -1, 1)),
                fillers=targets.filler_rows,
                own=torch.from_numpy(own),
            )
        )
        # installed targets must equal the truth: this is the alignment + slicing check
        result.setdefault("targets_equal_truth", []).append(
            bool(np.array_equal(targets.experts.astype(np.int64), truth[mine]))
        )

    # ---- hooks: the k-th forward (recompute) of a router is micro-batch k's ----------------
    def action(slot):  # by value: the native and the legacy enums share them
        a = slot.replay.router_replay_action
        return None if a is None else a.value

    stats: dict = {}
    slot_of = {s.layer_number: s for s in replayer.slots}
    # (layer number, micro-batch) -> routing_map [N, E] of the replayed forward, and of a forward
    # without replay ("free"); the experts each router row was sent to, for the expert counts.
    fwd_maps: dict = {}
    fwd_gates: dict = {}
    free_maps: dict = {}
    chosen: dict = {}

    def router_hook(slot):
        def hook(mod, inputs, output):
            act = action(slot)
            got = output[1].detach().cpu()  # routing_map [N, E]
            gates = output[0].detach().float().cpu()  # routing probs [N, E]
            if act is None and FREE_FORWARD["mb"] is not None:
                free_maps[(slot.layer_number, FREE_FORWARD["mb"])] = (got, gates)
                return
            if act not in ("replay_forward", "replay_backward"):
                return
            phase = "fwd" if act == "replay_forward" else "rec"
            st = stats.setdefault(
                slot.layer_number,
                {"fwd": 0, "rec": 0, "bad": 0, "calls_fwd": 0, "calls_rec": 0, "own": 0,
                 "rec_differs": 0, "rec_own_topk_moved": 0},
            )  # fmt: skip
            mb = st["calls_" + phase]
            st["calls_" + phase] += 1
            if mb >= len(mbs):  # the guard checks in _extras run extra forwards
                return
            exp = mbs[mb]["truth"][MOE_LAYERS.index(slot.layer)]
            want = torch.zeros(exp.shape[0], E, dtype=torch.bool)
            want.scatter_(1, torch.from_numpy(exp), True)
            own = mbs[mb]["own"]
            if own.shape[0] == want.shape[0] and own.any():
                # The router's own choice there: top-k of this very forward's logits (softmax
                # after top-k, no load balancing: the top-k of the logits is the router's).
                with torch.no_grad():
                    logits = mod.gating(inputs[0]).reshape(-1, E).float().cpu()
                top = torch.zeros_like(want).scatter_(1, logits.topk(K, dim=1).indices, True)
                if phase == "fwd":
                    want[own] = top[own]
                    st["own"] += int(own.sum())
                else:  # recompute repeats the forward's choice, whatever its scores say now
                    fwd = fwd_maps[(slot.layer_number, mb)]
                    want[own] = fwd[own]
                    st["rec_own_topk_moved"] += int((top[own] != fwd[own]).any(1).sum())
            st[phase] += got.shape[0]
            if got.shape != want.shape:
                st["bad"] += max(got.shape[0], want.shape[0])
                return
            st["bad"] += int((got != want).any(1).sum())
            if engine:  # the gates at the replayed rows are the engine's, bit for bit
                li = MOE_LAYERS.index(slot.layer)
                rows = torch.from_numpy(mbs[mb]["w_valid"]) & ~own
                w = torch.from_numpy(mbs[mb]["w_truth"][li])
                g = gates.gather(1, torch.from_numpy(exp))
                st["w_rows"] = st.get("w_rows", 0) + int(rows.sum())
                st["w_bad"] = st.get("w_bad", 0) + int((g[rows] != w[rows]).any(1).sum())
            if phase == "fwd":
                fwd_maps[(slot.layer_number, mb)] = got
                fwd_gates[(slot.layer_number, mb)] = gates
                chosen[(slot.layer_number, mb)] = got.nonzero()[:, 1].reshape(-1, K).numpy()
            else:  # recompute repeats the forward's decisions, replayed or the router's own
                st["rec_differs"] += int((got != fwd_maps[(slot.layer_number, mb)]).any(1).sum())

        return hook

    expert_counts: dict = {}

    def expert_hook(layer_number, e):
        def hook(mod, inputs):
            if action(slot_of[layer_number]) == "replay_forward":
                c = expert_counts.setdefault(layer_number, np.zeros(E, np.int64))
                c[e] += inputs[0].shape[0]

        return hook

    handles = [s.router.register_forward_hook(router_hook(s)) for s in replayer.slots]
    for lm, mod in _moe_layers(chunks):
        for j, e in enumerate(mod.local_expert_indices):
            handles.append(
                mod.experts.local_experts[j].register_forward_pre_hook(expert_hook(lm, e))
            )

    def forward(mbd, chunk=model):
        return chunk(mbd["ids"], mbd["pos"], seq_mask(mbd["seq"], mbd["pos"]), labels=mbd["labels"])

    if args.pp == 1:
        # ---- R3: F0 F1 .. B0 B1 .. (recompute pops targets FIFO across micro-batches) --------
        with replayer.step():
            losses = []
            for mbd in mbs:
                with replayer.micro_batch(mbd["targets"]):
                    losses.append(forward(mbd).sum())
            with perturbed_routers(replayer, args.perturb_router):
                for loss in losses:
                    loss.backward()
    else:
        # ---- R3 under Megatron's own pipeline schedule (1F1B, or interleaved with VPP) --------
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, chunk):
            mbd = next(data_iterator)
            with replayer.micro_batch(mbd["targets"], model=chunk):  # the integration
                out = forward(mbd, chunk)
            return out, lambda o: (o.sum(), {"loss": o.sum().detach()})

        B, S = mbs[0]["ids"].shape
        with replayer.step():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(mbs) for _ in chunks] if args.vpp > 1 else iter(mbs),
                model=chunks if args.vpp > 1 else chunks[0],
                num_microbatches=len(mbs),
                seq_length=S,
                micro_batch_size=B,
                forward_only=False,
            )
    if args.policy == "own_routing" and args.pp == 1:
        result["own_vs_free_forward"] = free_forward_check(
            mbs, forward, fwd_maps, fwd_gates, free_maps
        )
    if args.vpp > 1:  # without the chunk, installing is refused (it would misalign recompute)
        from routereplay.trainer_adapter import ReplayConfigError

        try:
            with replayer.micro_batch(mbs[0]["targets"]):
                pass
            result["vpp_requires_chunk"] = False
        except ReplayConfigError:
            result["vpp_requires_chunk"] = True
        replayer.clear()
    grads = [s.router.weight.grad for s in replayer.slots]
    result["router_grads_nonzero"] = all(g is not None and bool(g.abs().sum() > 0) for g in grads)
    result["router_rows"] = stats
    result["filler_rows"] = [m["fillers"] for m in mbs]

    # tokens per expert, summed over the ranks that share experts, versus the truth
    want_counts = np.zeros((len(MOE_LAYERS), E), np.int64)
    for mb, m in enumerate(mbs):
        for li, layer in enumerate(MOE_LAYERS):
            # the router's own rows went where it chose; the rest where the truth says
            sent = chosen.get((layer + 1, mb), m["truth"][li])
            want_counts[li] += np.bincount(sent.ravel(), minlength=E)
    wc = torch.from_numpy(want_counts).to(device)
    dist.all_reduce(wc, group=ps.get_expert_tensor_and_model_parallel_group())
    want_counts = wc.cpu().numpy()
    bad_experts = []
    for li, layer in enumerate(MOE_LAYERS):
        got = expert_counts.get(layer + 1, np.zeros(E, np.int64))
        owned = {
            e
            for lm, mod in _moe_layers(chunks)
            if lm == layer + 1
            for e in mod.local_expert_indices
        }
        for e in sorted(owned):
            if got[e] != want_counts[li, e]:
                bad_experts.append([layer + 1, int(e), int(got[e]), int(want_counts[li, e])])
    result["expert_count_mismatches"] = bad_experts

    ok = (
        all(result["targets_equal_truth"])
        and all(result["replay_mask_equal"])
        and result["router_grads_nonzero"]
        and not bad_experts
        and all(st["bad"] == 0 and st["fwd"] > 0 for st in stats.values())
        and all(st["rec_differs"] == 0 for st in stats.values())
        and (args.recompute == "none" or all(st["rec"] == st["fwd"] for st in stats.values()))
        and result.get("vpp_requires_chunk", True)
        and result.get("own_vs_free_forward", {"differs": 0})["differs"] == 0
        and result.get("own_vs_free_forward", {}).get("gate_max_abs_diff", 0.0) <= GATE_TOL
        and not any(result.get("repacked_decisions", []))
        and result.get("policy", {}).get("ok", True)
        and all(result.get("weights_equal_truth", [True]))
        and all(st.get("w_bad", 0) == 0 for st in stats.values())
        and (not engine or all(st.get("w_rows", 0) > 0 for st in stats.values()))
    )

    if args.extras and args.pp == 1:
        ok &= _extras(
            args, model, replayer, mbs, forward, stats, result, TargetShapeError, R2Recorder
        )
    for h in handles:
        h.remove()
    result["ok"] = bool(ok)
    result["seconds"] = round(time.time() - t_start, 1)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


@contextlib.contextmanager
def perturbed_routers(replayer, on: bool):
    """Router weights changed for the block (the backwards: recompute scores differ from the
    forward's), restored after. Only with activation recompute: without it autograd saved the
    weights and refuses the in-place change."""
    if not on:
        yield
        return
    saved = [s.router.weight.detach().clone() for s in replayer.slots]
    gen = torch.Generator(device=saved[0].device).manual_seed(7)
    with torch.no_grad():
        for s, w in zip(replayer.slots, saved, strict=True):
            noise = torch.randn(w.shape, generator=gen, device=w.device, dtype=w.dtype)
            s.router.weight.add_(noise * w.std())
    try:
        yield
    finally:
        with torch.no_grad():
            for s, w in zip(replayer.slots, saved, strict=True):
                s.router.weight.copy_(w)


# How far the router's own rows' gates may be from a forward without replay's: float rounding
# only (the experts' GEMMs batch other tokens alongside them; 3e-8 measured on CPU).
GATE_TOL = 1e-5

# Set while free_forward_check runs a forward without replay: the micro-batch it runs.
FREE_FORWARD: dict = {"mb": None}


def free_forward_check(mbs, forward, fwd_maps, fwd_gates, free_maps) -> dict:
    """Forward each micro-batch again with no replay action (the router decides every row) and
    compare, at the router's own rows, the experts chosen there and their gates with the
    replayed forward's."""
    differs = rows = 0
    gate_diff = 0.0
    with torch.no_grad():
        for mb, mbd in enumerate(mbs):
            FREE_FORWARD["mb"] = mb
            try:
                forward(mbd)
            finally:
                FREE_FORWARD["mb"] = None
    for (layer_number, mb), got in fwd_maps.items():
        own = mbs[mb]["own"]
        free, free_gates = free_maps[(layer_number, mb)]
        rows += int(own.sum())
        differs += int((got[own] != free[own]).any(1).sum())
        if own.any():
            gates = fwd_gates[(layer_number, mb)]
            gate_diff = max(gate_diff, float((gates[own] - free_gates[own]).abs().max()))
    return {"rows": rows, "differs": differs, "gate_max_abs_diff": gate_diff}


def decide(args, pm, recs, layers, result=None):
    """ReplayPolicy per sample. With ``result``: checks the report against the records at fault
    (STALE, and MISSING) and records what it decided in ``result["policy"]``."""
    from routereplay.trainer_adapter import ReplayPolicy

    policy = ReplayPolicy(current_version=CURRENT, max_staleness=1, on_violation=args.policy)
    report = policy.decide(pm, recs, layers)
    if result is None:
        return report
    bad = sorted(r for d in report.decisions for r in d.records)
    kinds = sorted(k for d in report.decisions for k in d.kinds)
    at_fault = np.isin(pm.sample, [d.sample for d in report.decisions])
    if args.policy == "drop":
        mask_ok = np.array_equal(report.loss_mask, (pm.sample >= 0) & ~at_fault)
        mask_ok &= bool(report.replay_mask.all())
    else:
        mask_ok = np.array_equal(report.replay_mask, ~at_fault)
        mask_ok &= np.array_equal(report.loss_mask, pm.sample >= 0)
    sc = report.scalars()
    key = "dropped" if args.policy == "drop" else "own_routing"
    pr = result.setdefault("policy", {"ok": True, "rows": [], "samples": []})
    pr["records_at_fault"] = bad
    pr["kinds"] = kinds
    pr["rows"].append(sc[f"replay/{key}_rows"])
    pr["samples"].append(sc[f"replay/{key}_samples"])
    pr["ok"] &= bool(
        bad == [STALE, MISSING]
        and kinds == ["missing", "staleness"]
        and mask_ok
        and sc[f"replay/{key}_rows"] == int(at_fault.sum()) > 0
    )
    return report


def _moe_layers(chunks):
    """(global layer number, MoELayer) of every MoE layer of this rank."""
    for chunk in chunks:
        for mod in chunk.modules():
            if hasattr(mod, "router") and hasattr(mod, "local_expert_indices"):
                yield mod.router.layer_number, mod


def _extras(
    args, model, replayer, mbs, forward, stats, result, TargetShapeError, R2Recorder
) -> bool:
    """R2 mode, the target-shape check and the bypass refusal."""
    from routereplay.trainer_adapter import ReplayConfigError, check_replay_config

    ok = True
    # R2: record during an old-logprob pass, replay the recorded routes in the update.
    r2 = R2Recorder(replayer)
    old = []
    with torch.no_grad():
        for i, mbd in enumerate(mbs):
            with r2.record(i):
                old.append(forward(mbd).detach())
    stats.clear()
    for i in range(len(mbs)):  # the truth for the replay hook is what was recorded
        rec = r2.recorded(i).long().cpu().numpy()
        mbs[i] = {**mbs[i], "truth": rec}
    with replayer.step():
        for i, mbd in enumerate(mbs):
            with r2.replay(i):
                new = forward(mbd)
            new.sum().backward()
            ok &= bool(torch.equal(new.detach(), old[i]))
    r2_ok = all(st["bad"] == 0 and st["fwd"] > 0 for st in stats.values())
    result["r2"] = {"same_loss": ok, "routes_match": r2_ok}
    ok &= r2_ok
    r2.clear()

    # A target one row short must raise, not silently drop a token.
    t = mbs[0]["targets"]
    short = type(t)(t.layers, t.experts[:, :-1], t.num_experts)
    try:
        with replayer.step(), replayer.micro_batch(short):
            forward(mbs[0])
        result["short_target_raises"] = False
        ok = False
    except TargetShapeError as e:
        result["short_target_raises"] = str(e)[:120]
    # Malformed targets are refused before they reach the routers.
    from routereplay.trainer_adapter import RouteLayerMismatchError

    n = t.num_tokens
    bad_inputs = {
        "top_k": torch.zeros(len(t.layers), n, K + 1, dtype=torch.long),
        "expert_range": torch.full((len(t.layers), n, K), E, dtype=torch.long),
        "num_experts": type(t)(t.layers, t.experts, E * 2),
        "missing_layer": {t.layers[0]: torch.zeros(n, K, dtype=torch.long)},
    }
    refused_targets = []
    for name, bad in bad_inputs.items():
        try:
            with replayer.step():
                replayer.set_targets(bad)
        except (TargetShapeError, RouteLayerMismatchError):
            refused_targets.append(name)
    result["refused_targets"] = refused_targets
    ok &= len(refused_targets) == len(bad_inputs)
    # A no-grad forward while targets wait for recompute would pop them: refused.
    try:
        with replayer.step():
            with replayer.micro_batch(t):
                forward(mbs[0])
            with torch.no_grad():
                forward(mbs[0])
        result["nograd_forward_in_step_raises"] = False
        ok = False
    except ReplayConfigError:
        result["nograd_forward_in_step_raises"] = True
    from routereplay.trainer_adapter._megatron import NATIVE

    if replayer.legacy and not NATIVE:
        # A vendor patch whose routing calls its own top-k (not the release's, which the replayer
        # wraps) must be caught at the first replayed forward, not route silently. (On a release
        # with RouterReplay the original top-k still consults the router's replay state.)
        from megatron.core.transformer.moe import router as mrouter

        from routereplay.trainer_adapter import _legacy

        name = _legacy.topk_function_name(mrouter)
        wrapped = getattr(mrouter, name)
        setattr(mrouter, name, wrapped.__routereplay_original__)
        try:
            with replayer.step(), replayer.micro_batch(t):
                forward(mbs[0])
            result["bypass_detected"] = False
            ok = False
        except ReplayConfigError as e:
            result["bypass_detected"] = "without reaching the replay hook" in str(e)
            ok &= result["bypass_detected"]
        finally:
            setattr(mrouter, name, wrapped)
    # Bypassing configurations are refused.
    refused = []
    bypass = [
        ("moe_router_fusion", True),
        ("moe_router_load_balancing_type", "sinkhorn"),
        ("moe_expert_capacity_factor", 1.0),
    ]
    if replayer.legacy:
        bypass += [
            ("moe_input_jitter_eps", 0.01),
            ("moe_token_dispatcher_type", "alltoall_seq"),
            ("enable_cuda_graph", True),
        ]
    for field, val in bypass:
        cfg = _cfg_copy(model.config, field, val)
        try:
            check_replay_config(cfg, legacy=replayer.legacy)
        except ReplayConfigError:
            refused.append(field)
    result["refused"] = refused
    ok &= len(refused) == len(bypass)
    return ok


def _cfg_copy(cfg, field, val):
    import copy

    c = copy.copy(cfg)
    object.__setattr__(c, field, val)
    return c


if __name__ == "__main__":
    sys.exit(main())
