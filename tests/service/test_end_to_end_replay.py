"""The whole R3 loop: routes a real vLLM engine chose, captured by the service into Redis, are
replayed exactly by a real Megatron-Core GPTModel of the same routing shape (CPU, gloo).

Megatron's weights are its own: replay, not the weights, decides the experts, and the hooks in
tests/gpu/replay_check.py check every router row of the packed batch (plain samples, a GRPO pair
packed as one shared prompt + two completions, a two-turn trajectory) against the records, in the
forward and in the activation recompute.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from openai import OpenAI

from routereplay.client import RouteStore

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.vllm, pytest.mark.megatron]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from harness import run_check  # noqa: E402


def _route_ids(resp) -> list[str]:
    handles = [c.model_extra["routed_experts"] for c in resp.choices]
    assert all(h["status"] == "stored" for h in handles), handles
    return [h["route_id"] for h in handles]


@pytest.fixture(scope="module")
def engine_route_ids(service) -> list[str]:
    llm = OpenAI(base_url=service.v1, api_key="-")

    def complete(prompt, **kw):
        return llm.completions.create(
            model=service.model, prompt=prompt, max_tokens=6, temperature=0.9, **kw
        )

    ids = _route_ids(complete("first plain sample", seed=11))
    ids += _route_ids(complete("second one", seed=12))
    ids += _route_ids(complete("a GRPO group prompt", n=2, seed=13))
    turn1 = _route_ids(complete("turn one of a chat", seed=14))
    with RouteStore.from_url(service.redis_url) as store:
        t1 = store.get(turn1[0])
    # Turn 2 re-sends all of turn 1 (prompt + completion) and a tool reply, as token ids.
    turn2 = _route_ids(complete([*t1.token_ids.tolist(), 7, 8, 9], seed=15))
    return ids + turn1 + turn2


@pytest.mark.parametrize(
    ("nproc", "args"),
    [(1, ("--recompute", "full")), (2, ("--tp", "2", "--sp", "--recompute", "selective"))],
    ids=["world1-full-recompute", "tp2-sp-selective-recompute"],
)
def test_vllm_routes_replay_exactly_in_megatron(
    service, engine_route_ids: list[str], nproc: int, args: tuple[str, ...]
) -> None:
    res = run_check(
        nproc, *args, "--route-ids", ",".join(engine_route_ids), redis_url=service.redis_url
    )
    for r in res:
        assert r["ok"], r
        assert r["records_from"] == "engine"
        assert r["router_layer_numbers"] == [1, 2, 3, 4]  # the tiny model: every layer MoE
        assert r["targets_equal_truth"] == [True] * r["args"]["micro_batches"]
        assert r["expert_count_mismatches"] == []
        for layer, st in r["router_rows"].items():
            assert st["fwd"] > 0 and st["bad"] == 0, (layer, st)
            assert st["rec"] == st["fwd"], (layer, st)
