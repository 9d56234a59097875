"""Packed training batches for experiments: THD-style rows of independent sequences, shared-prefix
GRPO groups and multi-turn trajectories, with the attention that makes each token see exactly
what it saw in the rollout.

A :class:`Pack` is one row ``[1, T]``: token ids, RoPE positions (restarting per sequence, and
continuing from the shared prompt in every completion of a group), a sequence id and a branch id
per token (branch 0: shared; ``c + 1``: completion ``c`` of a group). Token ``i`` may attend token
``j`` iff they are in the same sequence, ``j`` is shared or on ``i``'s branch, and ``pos_j <=
pos_i``: the same context as its own forward pass in the engine. :class:`PackedAttention` is that
attention as a Megatron core-attention module (RoPE applied there, at the pack's positions); its
output for every token equals an unpacked forward of that token's sequence.

The routes of a pack come from the trainer adapter's builders (``sample_from_record``,
``shared_prefix_sample``, ``multi_turn_sample``) placed with ``thd_position_map``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from routereplay.client import RouteRecord
from routereplay.trainer_adapter import (
    PositionMap,
    SampleMap,
    multi_turn_sample,
    sample_from_record,
    shared_prefix_sample,
    thd_position_map,
)

__all__ = ["Pack", "PackedAttention", "Target"]


@dataclass(frozen=True)
class Target:
    """A sampled token whose logprob the engine reported: where it sits in the pack, which
    position predicts it, and where its engine logprob comes from (record, completion index)."""

    index: int
    predictor: int
    record: int
    completion_index: int


@dataclass
class Pack:
    records: Sequence[RouteRecord]
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sequence: list[int] = field(default_factory=list)
    branch: list[int] = field(default_factory=list)
    samples: list[SampleMap] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def _append(self, sm: SampleMap, positions: Sequence[int], branch: Sequence[int]) -> int:
        start = len(self.tokens)
        seq = len(self.samples)
        self.tokens += [
            int(self.records[r].token_ids[t]) for r, t in zip(sm.record, sm.token, strict=True)
        ]
        self.positions += list(positions)
        self.branch += list(branch)
        self.sequence += [seq] * len(sm)
        self.samples.append(sm)
        self.lengths.append(len(sm))
        return start

    def add_sequence(self, index: int) -> None:
        """Record ``index`` as its own sequence; its completion tokens are targets."""
        r = self.records[index]
        start = self._append(sample_from_record(index, r), range(r.num_tokens), [0] * r.num_tokens)
        for j, t in enumerate(range(r.prompt_len, r.num_tokens)):
            self.targets.append(Target(start + t, start + t - 1, index, j))

    def add_group(self, indices: Sequence[int]) -> None:
        """A GRPO group (same prompt) packed as one prompt then each completion."""
        sm = shared_prefix_sample(indices, self.records)
        P = self.records[indices[0]].prompt_len
        positions, branch = list(range(P)), [0] * P
        for c, i in enumerate(indices):
            n = self.records[i].completion_len
            positions += range(P, P + n)
            branch += [c + 1] * n
        start = self._append(sm, positions, branch)
        offset = start + P
        for i in indices:
            for j in range(self.records[i].completion_len):
                predictor = start + P - 1 if j == 0 else offset + j - 1
                self.targets.append(Target(offset + j, predictor, i, j))
            offset += self.records[i].completion_len

    def add_trajectory(self, turns: Sequence[int]) -> None:
        """A multi-turn trajectory: the last turn's sequence, each earlier turn's prompt and
        completion re-sent in the next turn's prompt; every turn's completion is a target."""
        sm = multi_turn_sample(turns, self.records)
        L = len(sm)
        start = self._append(sm, range(L), [0] * L)
        for i in turns:
            r = self.records[i]
            for j, t in enumerate(range(r.prompt_len, r.num_tokens)):
                self.targets.append(Target(start + t, start + t - 1, i, j))

    # -- tensors ----------------------------------------------------------------------------------
    def position_map(self) -> PositionMap:
        cu = np.concatenate([[0], np.cumsum(self.lengths)])
        return thd_position_map(self.samples, cu, records=self.records)

    def input_ids(self) -> np.ndarray:
        return np.asarray(self.tokens, dtype=np.int64)[None]

    def visibility(self) -> np.ndarray:
        """``[T, T]`` bool: token i may attend token j (see the module docstring)."""
        seq = np.asarray(self.sequence)
        br = np.asarray(self.branch)
        pos = np.asarray(self.positions)
        same = seq[:, None] == seq[None, :]
        on_branch = (br[None, :] == 0) | (br[None, :] == br[:, None])
        return same & on_branch & (pos[None, :] <= pos[:, None])

    def attention_context(self, device: torch.device | str, theta: float) -> dict[str, Any]:
        return {
            "pos": torch.as_tensor(np.asarray(self.positions)[None], device=device),
            "vis": torch.as_tensor(self.visibility()[None], device=device),
            "theta": theta,
        }


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (as Qwen3 / Hugging Face): ``x`` ``[S, B, n, d]``, ``pos`` ``[B, S]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.t().to(torch.float32)[..., None] * inv  # [S, B, d/2]
    emb = torch.cat([ang, ang], -1)[:, :, None, :]  # [S, B, 1, d]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class PackedAttention(torch.nn.Module):
    """Megatron core attention over a :class:`Pack`: RoPE at the pack's positions, attention where
    its visibility allows. Set ``PackedAttention.CONTEXT`` (``Pack.attention_context``) before a
    forward; the model is built with Megatron's own RoPE off (``bridge.build_model``)."""

    CONTEXT: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.scale = config.kv_channels**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        ctx = self.CONTEXT
        pos, vis, theta = ctx["pos"], ctx["vis"], ctx["theta"]
        query = _rope(query, pos, theta)
        key = _rope(key, pos, theta)
        if key.shape[2] != query.shape[2]:  # grouped-query attention
            rep = query.shape[2] // key.shape[2]
            key = key.repeat_interleave(rep, 2)
            value = value.repeat_interleave(rep, 2)
        scores = torch.einsum("sbnh,tbnh->bnst", query.float(), key.float()) * self.scale
        scores = scores.masked_fill(~vis[:, None], float("-inf"))
        probs = torch.softmax(scores, -1).to(query.dtype)
        out = torch.einsum("bnst,tbnh->sbnh", probs, value)
        return out.reshape(out.shape[0], out.shape[1], -1)
