"""The load of ``routereplay bench service``: GRPO groups sent at a bounded concurrency, timed.

A group is one prompt sampled ``n`` times (one request with ``n`` choices, as GRPO rollouts
are sent), with ``ignore_eos`` so every choice generates its ``max_tokens``. Concurrency counts
sequences in flight: at concurrency C with groups of n, C // n requests are in flight (groups
shrink to C at C < n). Every request asks for ``return_token_ids``, so each server does the same
work and the routes can be checked against the tokens. Streamed requests also time the first
token (TTFT) and the gaps between a choice's chunks (ITL).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

__all__ = ["Choice", "Group", "LevelLoad", "make_groups", "run_level"]

_INDEX = re.compile(rb'"index":\s*(\d+)')
_TOKENS = re.compile(rb'"token_ids":\s*\[([0-9,\s]*)\]')
_UNFINISHED = re.compile(rb'"finish_reason":\s*null')


@dataclass(frozen=True)
class Group:
    """One request: ``prompt`` sampled ``n`` times, each choice ``max_tokens`` long."""

    index: int
    prompt: list[int]
    n: int
    max_tokens: int
    seed: int


@dataclass
class Choice:
    """What one choice's response said: its tokens and its route field (a handle or base64)."""

    group: int
    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    route: Any


@dataclass
class LevelLoad:
    """One level's timings and responses."""

    concurrency: int
    stream: bool
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    response_bytes: int = 0
    choices: list[Choice] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _span(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition("-")
    return int(lo), int(hi or lo)


def make_groups(
    count: int, n: int, prompt_tokens: str, max_tokens: str, vocab: int, seed: int
) -> list[Group]:
    """``count`` groups: prompt lengths and completion lengths drawn uniformly from the
    ``"lo-hi"`` (or single-number) spans, prompt ids from [3, vocab)."""
    rng = np.random.default_rng(seed)
    (plo, phi), (mlo, mhi) = _span(prompt_tokens), _span(max_tokens)
    out = []
    for i in range(count):
        length = int(rng.integers(plo, phi + 1))
        prompt = rng.integers(3, vocab, size=length).tolist()
        out.append(Group(i, prompt, n, int(rng.integers(mlo, mhi + 1)), seed * 100_003 + i))
    return out


def _body(model: str, g: Group, stream: bool) -> dict[str, Any]:
    body = {"model": model, "prompt": g.prompt, "n": g.n, "max_tokens": g.max_tokens,
            "temperature": 1.0, "seed": g.seed, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _parse_json(data: dict[str, Any], g: Group, lv: LevelLoad) -> None:
    prompt = data.get("prompt_token_ids")
    for c in data["choices"]:
        p = c.get("prompt_token_ids") or prompt or []
        lv.choices.append(Choice(g.index, c["index"], list(p), list(c.get("token_ids") or []),
                                 c.get("routed_experts")))  # fmt: skip
    lv.completion_tokens += int(data["usage"]["completion_tokens"])


async def _one_json(client: httpx.AsyncClient, model: str, g: Group, lv: LevelLoad) -> None:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=_body(model, g, False))
    lat = time.perf_counter() - t0
    if r.status_code != 200:
        lv.errors.append(f"{r.status_code}: {r.text[:200]}")
        return
    lv.latencies.append(lat)
    lv.response_bytes += len(r.content)
    _parse_json(r.json(), g, lv)


class _StreamState:
    """Per-choice token ids and chunk times of one streamed request."""

    def __init__(self, g: Group) -> None:
        self.last: dict[int, float] = {}
        self.tokens: dict[int, list[int]] = {i: [] for i in range(g.n)}
        self.prompt: list[int] = []
        self.routes: dict[int, Any] = {}
        self.first: float | None = None

    def chunk(self, line: bytes, now: float, lv: LevelLoad) -> None:
        m = _INDEX.search(line)
        if m is not None:
            i = int(m.group(1))
            if self.first is None:
                self.first = now
            if i in self.last:
                lv.itl.append(now - self.last[i])
            self.last[i] = now
            # Most chunks carry a token or two of one choice: their index, ids and arrival
            # time are all they hold, read without a JSON parse so that the client does not
            # become the bottleneck at high concurrency.
            t = _TOKENS.search(line)
            if t is not None and _UNFINISHED.search(line) and b"prompt_token_ids" not in line:
                self.tokens[i].extend(int(x) for x in t.group(1).split(b",") if x.strip())
                return
        self._parse(json.loads(line[6:]), lv)

    def _parse(self, data: dict[str, Any], lv: LevelLoad) -> None:
        if "error" in data:
            raise RuntimeError(f"error event: {data['error']}")
        if data.get("usage") and not data.get("choices"):
            lv.completion_tokens += int(data["usage"]["completion_tokens"])
        self.prompt = self.prompt or data.get("prompt_token_ids") or []
        for c in data.get("choices") or []:
            self.prompt = self.prompt or c.get("prompt_token_ids") or []
            self.tokens[c["index"]].extend(c.get("token_ids") or [])
            if c.get("routed_experts") is not None:
                self.routes[c["index"]] = c["routed_experts"]


async def _one_stream(client: httpx.AsyncClient, model: str, g: Group, lv: LevelLoad) -> None:
    st = _StreamState(g)
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=_body(model, g, True)) as r:
        if r.status_code != 200:
            lv.errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                b = line.encode()
                lv.response_bytes += len(b)
                st.chunk(b, time.perf_counter(), lv)
    lv.latencies.append(time.perf_counter() - t0)
    if st.first is not None:
        lv.ttft.append(st.first - t0)
    for i in range(g.n):
        lv.choices.append(Choice(g.index, i, st.prompt, st.tokens[i], st.routes.get(i)))


async def run_level(
    base: str, model: str, groups: list[Group], concurrency: int, stream: bool
) -> LevelLoad:
    """Send ``groups`` with ``concurrency`` sequences in flight; the level's timings."""
    lv = LevelLoad(concurrency, stream)
    in_flight = max(1, concurrency // max(groups[0].n, 1))
    sem = asyncio.Semaphore(in_flight)
    limits = httpx.Limits(max_connections=in_flight + 4, max_keepalive_connections=in_flight + 4)
    one = _one_stream if stream else _one_json
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:

        async def send(g: Group) -> None:
            async with sem:
                try:
                    await one(client, model, g, lv)
                except (httpx.HTTPError, RuntimeError) as e:
                    lv.errors.append(f"{type(e).__name__}: {e}"[:300])

        t0 = time.perf_counter()
        await asyncio.gather(*(send(g) for g in groups))
        lv.wall_s = time.perf_counter() - t0
    return lv
