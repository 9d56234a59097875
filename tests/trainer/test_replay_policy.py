"""Per-sample replay policy (pure numpy): which samples break the policy and why, what ``drop``
and ``own_routing`` do to the batch's masks and targets, and the report's scalars."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay.client import RouteRecord
from routereplay.trainer_adapter import (
    VIOLATION_KINDS,
    MissingWeightsError,
    ReplayPolicy,
    ReplayPolicyError,
    RouteAlignmentError,
    batch_coverage,
    filler_experts,
    gather_targets,
    padded_position_map,
    sample_from_record,
    shared_prefix_sample,
    step_scalars,
    thd_position_map,
)

E, K = 8, 2
LAYERS = (1, 2, 3)


def rec(T: int, rid: str, version: str | None = "step-5", invalid=(), prompt=None) -> RouteRecord:
    rng = np.random.default_rng(T * 31 + len(rid))
    experts = np.argsort(rng.random((T, 3, E)), axis=2)[:, :, :K].astype(np.uint8)
    valid = np.ones(T, bool)
    valid[-1] = False  # the last sampled token: no route
    valid[list(invalid)] = False
    tokens = rng.integers(3, 100, T)
    if prompt is not None:
        tokens[: len(prompt)] = prompt
    return RouteRecord(tokens, experts, valid, LAYERS, 4, E, prompt_len=T // 2,
                       metadata={"request_id": rid, "choice": 0},
                       weight_versions=() if version is None else ((version, 0, T),))  # fmt: skip


def batch():
    """Five records, one per sample: 0 fine, 1 stale (step-3), 2 missing from the store,
    3 fine, 4 with half its rows invalid."""
    recs = [
        rec(10, "a"),
        rec(8, "b", version="step-3"),
        None,
        rec(7, "d"),
        rec(12, "e", invalid=range(1, 6)),
    ]
    lengths = [10, 8, 9, 7, 12]
    samples = [sample_from_record(i, r, length=lengths[i]) for i, r in enumerate(recs)]
    return recs, samples, lengths


POLICY = dict(current_version="step-5", max_staleness=1, min_coverage=0.8)


def test_raise_is_the_default_and_words_errors_as_check() -> None:
    recs, samples, _ = batch()
    pm = padded_position_map(samples, 12, records=recs)
    policy = ReplayPolicy(**POLICY)
    assert policy.on_violation == "raise"
    with pytest.raises(ReplayPolicyError) as decided:
        policy.decide(pm, recs, LAYERS)
    with pytest.raises(ReplayPolicyError) as checked:
        policy.check(batch_coverage(pm, recs, LAYERS))
    assert str(decided.value) == str(checked.value)
    msg = str(decided.value)
    assert msg.startswith("batch refused by the replay policy: b-0: 7 rows from weights 'step-3'")
    assert "record 2: no route record (9 positions)" in msg
    assert "e-0: coverage 0.500 below 0.8" in msg
    assert "a-0" not in msg and "d-0" not in msg
    # A batch that keeps the policy gets a report with nothing decided.
    ok = padded_position_map([samples[0], samples[3]], 12)
    r = policy.decide(ok, recs, LAYERS)
    assert r.decisions == () and r.kept == (0, 1) and r.replay_mask.all()
    assert r.loss_mask.sum() == 10 + 7


def test_drop_decides_per_sample_with_reasons_and_loss_mask() -> None:
    recs, samples, lengths = batch()
    pm = padded_position_map(samples, 12, padding_side="left", records=recs)
    r = ReplayPolicy(**POLICY, on_violation="drop").decide(pm, recs, LAYERS)
    assert [d.sample for d in r.decisions] == [1, 2, 4]
    assert [d.action for d in r.decisions] == ["drop"] * 3
    assert [d.kinds for d in r.decisions] == [("staleness",), ("missing",), ("coverage",)]
    assert [d.routes for d in r.decisions] == [("b-0",), ("record 2",), ("e-0",)]
    assert [d.rows for d in r.decisions] == [8, 9, 12]
    assert r.decisions[0].reasons == (
        "b-0: 7 rows from weights 'step-3', more than 1 versions behind 'step-5'",
    )
    assert r.dropped == (1, 2, 4) and r.kept == (0, 3) and r.own_routing == ()
    want = np.zeros((5, 12), bool)
    for b in (0, 3):
        want[b, 12 - lengths[b] :] = True  # left padding
    assert np.array_equal(r.loss_mask, want)
    assert r.replay_mask.all()  # dropping changes no route
    assert r.select(["s0", "s1", "s2", "s3", "s4"]) == ["s0", "s3"]
    with pytest.raises(ValueError, match="3 items for a batch of 5 samples"):
        r.select([1, 2, 3])
    # Re-packed without them, the batch keeps the policy.
    kept = r.select(samples)
    again = ReplayPolicy(**POLICY, on_violation="drop").decide(
        padded_position_map(kept, 12, records=recs), recs, LAYERS
    )
    assert again.decisions == () and again.kept == (0, 1)


def test_own_routing_on_a_thd_pack_masks_exactly_the_samples_positions() -> None:
    recs, samples, lengths = batch()
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cup = np.concatenate([[0], np.cumsum([12] * 5)])  # each sequence padded to 12
    pm = thd_position_map(samples, cu, cu_seqlens_padded=cup, records=recs)
    r = ReplayPolicy(**POLICY, on_violation="own_routing").decide(pm, recs, LAYERS)
    assert r.own_routing == (1, 2, 4) and r.dropped == () and r.kept == (0, 1, 2, 3, 4)
    want = np.ones((1, 60), bool)
    for s in (1, 2, 4):
        want[0, cup[s] : cup[s] + lengths[s]] = False
    assert np.array_equal(r.replay_mask, want)
    assert r.loss_mask.sum() == sum(lengths)  # every sample keeps its loss; padding has none
    # The targets carry the mask in router row order; replayed rows are untouched.
    t = gather_targets(pm, recs, LAYERS, own_routing=r.own_routing)
    plain = gather_targets(pm, recs, LAYERS)
    assert np.array_equal(t.replay_mask, want[0]) and t.own_rows == 8 + 9 + 12
    assert np.array_equal(t.experts, plain.experts) and plain.replay_mask is None
    assert t.select((2, 3)).replay_mask is t.replay_mask


def test_missing_record_gets_fillers_and_skips_the_token_check() -> None:
    recs, samples, _ = batch()
    pm = padded_position_map(samples, 12, records=recs)
    ids = np.zeros((5, 12), np.int64)
    for b, r in enumerate(recs):
        if r is not None:
            ids[b, : r.num_tokens] = r.token_ids
    ids[2, :9] = 99  # the missing record's sample: the trainer's tokens, nothing to compare
    pm.check_tokens(recs, ids)
    t = gather_targets(pm, recs, LAYERS, input_ids=ids)
    rows = np.arange(9) * 5 + 2  # sequence-major rows of sample 2
    assert np.array_equal(t.experts[:, rows], np.broadcast_to(
        filler_experts(pm.position[2, :9], E, K), (3, 9, K)))  # fmt: skip
    assert not t.valid[rows].any()
    cov = batch_coverage(pm, recs, LAYERS)
    assert cov.missing == 9 and cov.as_metrics()["replay/rows_missing"] == 9
    assert cov.coverage == pytest.approx((cov.replayed + cov.filled) / (10 + 8 + 9 + 7 + 12))
    with pytest.raises(RouteAlignmentError, match="pass the sample's length"):
        sample_from_record(2, None)
    with pytest.raises(RouteAlignmentError, match=r"records \[2\] are missing"):
        shared_prefix_sample([0, 2], recs)


def test_a_sample_of_several_records_is_judged_on_its_own_positions() -> None:
    prompt = np.arange(3, 9)
    group = [rec(10, "g1", prompt=prompt), rec(12, "g2", version="step-1", prompt=prompt)]
    recs = [rec(9, "a"), *group]
    samples = [sample_from_record(0, recs[0]), shared_prefix_sample([1, 2], recs, prompt_len=6)]
    pm = padded_position_map(samples, 20, records=recs)
    r = ReplayPolicy(current_version="step-5", max_staleness=2, on_violation="own_routing").decide(
        pm, recs, LAYERS, route_ids=["id-a", "id-g1", "id-g2"]
    )
    (d,) = r.decisions
    assert d.sample == 1 and d.records == (1, 2) and d.routes == ("id-g1", "id-g2")
    assert d.kinds == ("staleness",) and d.rows == 6 + 4 + 6
    assert d.reasons == ("id-g2: 5 rows from weights 'step-1', more than 2 versions behind "
                         "'step-5'",)  # fmt: skip
    assert r.replay_mask[0].all() and r.replay_mask[1, 16:].all()
    assert not r.replay_mask[1, :16].any()


def test_scalars_for_a_logger() -> None:
    recs, samples, _ = batch()
    pm = padded_position_map(samples, 12, records=recs)
    own = ReplayPolicy(**POLICY, on_violation="own_routing").decide(pm, recs, LAYERS)
    drop = ReplayPolicy(**POLICY, on_violation="drop").decide(pm, recs, LAYERS)
    s = own.scalars()
    assert {k: s[k] for k in list(s)[:6]} == {
        "replay/samples": 5.0,
        "replay/kept_samples": 5.0,
        "replay/dropped_samples": 0.0,
        "replay/dropped_rows": 0.0,
        "replay/own_routing_samples": 3.0,
        "replay/own_routing_rows": 29.0,
    }
    assert [s[f"replay/violations/{k}"] for k in VIOLATION_KINDS] == [1, 0, 1, 0, 1, 0, 0]
    assert s["replay/rows_missing"] == 9 and s["replay/rows_invalid"] == 1 + 1 + 1 + 6
    assert s["replay/rows_version/step-3"] == 7
    d = drop.scalars()
    assert (d["replay/kept_samples"], d["replay/dropped_samples"], d["replay/dropped_rows"]) == (
        2.0, 3.0, 29.0)  # fmt: skip
    assert all(isinstance(v, float) for v in d.values())
    step = step_scalars([own, drop])
    assert step["replay/own_routing_rows"] == 29 and step["replay/dropped_rows"] == 29
    assert step["replay/samples"] == 10
    assert step["replay/coverage"] == pytest.approx(own.coverage.coverage)


def test_on_violation_is_checked() -> None:
    with pytest.raises(ValueError, match="on_violation must be one of"):
        ReplayPolicy(on_violation="skip")  # type: ignore[arg-type]


def test_require_weights_own_routing_needs_no_weights_at_own_rows() -> None:
    """ReplayPolicy(require_weights=True): a record without the engine's weights breaks it
    ("missing_weights"); under own_routing its sample's rows keep the router's probabilities, so
    gather_targets(weights=True) needs no weights there."""
    recs = [batch()[0][i] for i in (0, 3)]
    samples = [sample_from_record(i, r) for i, r in enumerate(recs)]
    w = np.ones(recs[0].experts.shape, np.float32) / K
    w[~recs[0].valid] = 0
    recs[0].weights, recs[0].weights_dtype = w, "float32"  # recs[1] ("d-0") has none
    pm = padded_position_map(samples, 12, records=recs)
    with pytest.raises(ReplayPolicyError, match=r"d-0: no engine routing weights \(7 positions\)"):
        ReplayPolicy(require_weights=True).decide(pm, recs, LAYERS)
    assert ReplayPolicy().decide(pm, recs, LAYERS).decisions == ()  # not required: not judged
    r = ReplayPolicy(require_weights=True, on_violation="own_routing").decide(pm, recs, LAYERS)
    assert [(d.sample, d.kinds) for d in r.decisions] == [(1, ("missing_weights",))]
    assert r.scalars()["replay/violations/missing_weights"] == 1
    with pytest.raises(MissingWeightsError, match="route d-0"):
        gather_targets(pm, recs, LAYERS, weights=True)
    tg = gather_targets(pm, recs, LAYERS, weights=True, own_routing=r.own_routing)
    own = ~tg.replay_mask
    assert own.sum() == 7 and (tg.weights[:, own] == 0).all()  # d-0's tokens, not its padding
    assert (tg.weights[:, tg.valid & ~own] == 1 / K).all()
