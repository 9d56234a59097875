"""``routereplay bench routes``: the entropy estimates on routes whose entropy is known, and the
report from saved routes (serving them needs vLLM: ``routereplay bench routes`` without
``--load``, see docs/storage.md)."""

from __future__ import annotations

import math

import msgpack
import numpy as np

from routereplay.bench.routes import main, route_stats
from routereplay.client import RouteRecord, encode_record


def _rec(ex: np.ndarray, E: int) -> RouteRecord:
    T, M, _ = ex.shape
    return RouteRecord(
        token_ids=np.arange(T), experts=ex.astype(np.uint8), valid=np.ones(T, bool),
        moe_layers=range(M), num_layers=M, num_experts=E,
    )  # fmt: skip


def test_constant_routes_have_zero_entropy_and_code_to_almost_nothing() -> None:
    ex = np.tile(np.array([3, 5], np.uint8), (4000, 2, 1))
    s = route_stats([_rec(ex, 8)], 8, 2)
    assert s["H0"] == 1.0  # per layer, over its slots: ids 3 and 5 equally often
    assert s["Hcond"] < 0.01 and s["Hkeep"] < 0.01  # only each stream's first token costs
    assert s["ours"] < 0.05 and s["zstd"] < 0.05


def test_iid_uniform_ids_measure_log2_e() -> None:
    rng = np.random.default_rng(0)
    recs = [_rec(rng.integers(0, 8, (2000, 3, 2)), 8) for _ in range(4)]
    s = route_stats(recs, 8, 2)
    for key in ("H0", "Hcond"):  # i.i.d.: no context helps
        assert abs(s[key] - 3.0) < 0.02, (key, s[key])
    # keep model: changed with p = 7/8, then a uniform new id (3 bits)
    p = 7 / 8
    want = -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) + p * 3.0
    assert abs(s["Hkeep"] - want) < 0.03
    assert s["bound"] == (math.log2(8) + math.log2(7)) / 2
    assert 3.0 <= s["ours"] < 3.2


def test_report_from_saved_routes(tmp_path, capsys) -> None:
    rng = np.random.default_rng(1)
    recs = [_rec(rng.integers(0, 8, (300, 4, 2)), 8) for _ in range(3)]
    path = tmp_path / "routes.msgpack"
    path.write_bytes(msgpack.packb([encode_record(r) for r in recs]))
    assert main(["--load", str(path)]) == 0
    out = capsys.readouterr().out
    assert "3 routes, 900 tokens, 4 MoE layers, 8 experts, top-2" in out
    for row in ("served (real router)", "generated uniform", "generated skewed"):
        assert row in out
