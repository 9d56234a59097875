"""The JSON form of a route record: every list equal to the record's arrays (numbers padded with
spaces are still JSON numbers), at every shape and width the records hold."""

from __future__ import annotations

import json

import numpy as np
import pytest

from routereplay.client import RouteRecord
from routereplay.service.serving.route_json import route_json


def record(T: int, experts: int, weights: bool, seed: int = 0) -> RouteRecord:
    rng = np.random.default_rng(seed)
    valid = np.ones(T, dtype=bool)
    if T:
        valid[-1] = False
    dtype = np.uint8 if experts <= 256 else np.uint16
    w = None
    if weights:
        w = rng.random((T, 3, 4)).astype(np.float32)
        w[~valid] = 0
    return RouteRecord(
        token_ids=rng.integers(0, 2**32, T),
        experts=rng.integers(0, experts, (T, 3, 4)).astype(dtype),
        valid=valid, moe_layers=(0, 2, 5), num_layers=6, num_experts=experts,
        prompt_len=T // 2, model="m", metadata={"request_id": "r", "choice": 1},
        weight_versions=[("v1", 0, T)] if T else (), weights=w,
        weights_dtype="float32" if weights else None,
    )  # fmt: skip


@pytest.mark.parametrize("T", [0, 1, 2, 9, 1000])
@pytest.mark.parametrize(("experts", "weights"), [(8, False), (256, True), (1000, False)])
def test_every_list_reads_back_as_the_records_arrays(T: int, experts: int, weights: bool) -> None:
    rec = record(T, experts, weights)
    j = json.loads(route_json("r-1", rec))
    assert j["token_ids"] == rec.token_ids.tolist() and j["valid"] == rec.valid.tolist()
    assert j["experts"] == rec.experts.tolist()
    assert (j["route_id"], j["model"], j["moe_layers"], j["num_layers"]) == (
        "r-1",
        "m",
        [0, 2, 5],
        6,
    )
    assert j["prompt_len"] == T // 2 and j["metadata"] == {"request_id": "r", "choice": 1}
    assert j["weight_versions"] == ([["v1", 0, T]] if T else [])
    if weights:
        assert j["weights_dtype"] == "float32"
        assert np.array_equal(np.asarray(j["weights"], dtype=np.float32).reshape(T, 3, 4),
                              rec.weights)  # fmt: skip
    else:
        assert "weights" not in j and "weights_dtype" not in j


def test_a_windowed_view_renders_its_rows_only() -> None:
    rec = record(300, 128, True)
    j = json.loads(route_json("r", rec.rows(17, 290)))
    assert j["experts"] == rec.experts[17:290].tolist() and len(j["token_ids"]) == 273
