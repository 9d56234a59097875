"""Batch coverage and the replay policy (pure numpy): what each position replays, the weight
versions present, and refusals that name the records at fault."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay.client import RouteRecord
from routereplay.trainer_adapter import (
    ReplayPolicy,
    ReplayPolicyError,
    batch_coverage,
    padded_position_map,
    sample_from_record,
)

E, K = 8, 2


def rec(T: int, rid: str, versions=(), filled=None, invalid=()) -> RouteRecord:
    rng = np.random.default_rng(T)
    experts = np.argsort(rng.random((T, 3, E)), axis=2)[:, :, :K].astype(np.uint8)
    valid = np.ones(T, bool)
    valid[-1] = False
    for i in invalid:
        valid[i] = False
    meta = {"request_id": rid, "choice": 0}
    if filled:
        meta["filled_rows"] = filled
    return RouteRecord(np.arange(T) + 3, experts, valid, (1, 2, 3), 4, E, prompt_len=T // 2,
                       metadata=meta, weight_versions=versions)  # fmt: skip


def test_counts_and_versions() -> None:
    a = rec(10, "a", versions=(("step-3", 0, 10),), filled=[[0, 4]])
    b = rec(8, "b", versions=(("step-2", 0, 5), ("step-3", 5, 8)), invalid=(2,))
    c = rec(6, "c")  # versions unknown
    recs = [a, b, c]
    pm = padded_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], 12)
    cov = batch_coverage(pm, recs, layers=(1, 2, 3))
    assert cov.positions == 36 and cov.no_route == 36 - 24
    assert (cov.replayed, cov.filled, cov.invalid) == (5 + 6 + 5, 4, 1 + 2 + 1)
    assert cov.versions == {"step-3": 9 + 2, "step-2": 4, "<unknown>": 5}
    assert cov.coverage == pytest.approx(20 / 24)
    assert cov.per_layer()[2] == {"replayed": 16, "filled": 4, "invalid": 4}
    m = cov.as_metrics()
    assert m["replay/rows_filled"] == 4 and m["replay/rows_version/step-2"] == 4
    names = [r.route for r in cov.records]
    assert names == ["a-0", "b-0", "c-0"]


def test_policy_refuses_and_names_records() -> None:
    a = rec(10, "a", versions=(("step-3", 0, 10),))
    b = rec(8, "b", versions=(("step-2", 0, 5), ("step-3", 5, 8)), invalid=(1, 2, 3))
    c = rec(6, "c")
    recs = [a, b, c]
    pm = padded_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], 12)
    cov = batch_coverage(pm, recs)
    ReplayPolicy().check(cov)  # the default accepts everything
    with pytest.raises(ReplayPolicyError) as e:
        ReplayPolicy(require_version="step-3").check(cov)
    msg = str(e.value)
    assert "b-0: 2 rows from weights 'step-2'" in msg and "c-0" in msg and "a-0" not in msg
    ReplayPolicy(current_version="step-3", max_staleness=1).check(
        batch_coverage(pm, [a, b, rec(6, "c", versions=(("step-3", 0, 6),))])
    )
    with pytest.raises(ReplayPolicyError, match=r"b-0: .* more than 0 versions behind"):
        ReplayPolicy(current_version="step-3", max_staleness=0).check(cov)
    with pytest.raises(ReplayPolicyError, match="unknown weights"):
        ReplayPolicy(allow_unknown_version=False).check(cov)
    with pytest.raises(ReplayPolicyError, match=r"b-0: 4 positions without a route"):
        ReplayPolicy(max_invalid_rows=1).check(cov)
    with pytest.raises(ReplayPolicyError, match=r"b-0: coverage 0\.500 below 0\.9"):
        ReplayPolicy(min_coverage=0.9).check(cov)
    with pytest.raises(ReplayPolicyError, match="trailing step number"):
        ReplayPolicy(current_version="latest", max_staleness=1).check(cov)
