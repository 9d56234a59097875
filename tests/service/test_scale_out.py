"""Scale-out on loopback: two `routereplay serve` replicas (one vLLM engine each) over one
3-master Redis Cluster.

Routes written through either replica are readable through the other and through `RouteStore`
directly; a trainer batch spans both; one replica killed mid-load loses nothing the other
served (nor anything it had answered itself); a request id in flight on one replica is refused
on the other, and a dead replica's ids are free again after one lease.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import routereplay_test_hold as _test_hold

from routereplay.client import RouteNotFoundError, RoutesClient, RouteStore, decode_record
from routereplay.local_redis import redis_cluster
from routereplay.trainer_adapter import gather_targets, sample_from_record, thd_position_map

from engines import MODEL_NAME, Service, service_spec, start_services

pytestmark = pytest.mark.vllm

LEASE_S = 10.0  # renewed every third of it: only a replica stalled for seconds lets one lapse


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    with redis_cluster(3) as url:
        yield url.replace("redis://", "redis+cluster://")


@dataclass
class Replicas:
    a: Service
    b: Service
    proc_b: subprocess.Popen  # the last test kills B
    hold_dir: Path  # a file here named by a held request's id releases it


@pytest.fixture(scope="module")
def replicas(
    cluster_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    """Replicas A and B, with the scheduler's test hold (``tests/plugins/vllm_test_hold``)."""
    flags = ("--route-prefix", "so", "--request-id-lease-s", str(LEASE_S))
    hold = tmp_path_factory.mktemp("hold")
    env = {_test_hold.ENV: str(hold)}
    specs = [
        service_spec(cluster_url, tiny_model, tmp_path_factory.mktemp(name), *flags, env=env)
        for name in ("replica-a", "replica-b")
    ]
    with start_services(specs) as [(a, _), (b, proc_b)]:
        yield Replicas(a, b, proc_b, hold)


def complete(svc: Service, prompt: str, rid: str | None = None, **kw: object) -> dict:
    headers = {"X-Request-Id": rid} if rid else {}
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "return_token_ids": True, **kw}  # fmt: skip
    r = httpx.post(svc.url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(resp: dict, i: int = 0) -> list[int]:
    c = resp["choices"][i]
    return c["prompt_token_ids"] + c["token_ids"]


def store(cluster_url: str) -> RouteStore:
    return RouteStore.from_url(cluster_url, prefix="so")


def test_routes_written_through_either_replica_are_read_through_both(
    replicas: Replicas, cluster_url: str
) -> None:
    a, b = replicas.a, replicas.b
    via_a = complete(a, "written through replica A", n=2, temperature=0.8, seed=3)
    via_b = complete(b, "written through replica B")
    st = store(cluster_url)
    try:
        for resp, n in ((via_a, 2), (via_b, 1)):
            for i in range(n):
                h = resp["choices"][i]["routed_experts"]
                assert h["status"] == "stored", h
                direct = st.get(h["route_id"])
                assert direct.token_ids.tolist() == tokens_of(resp, i)
                for svc in (a, b):
                    r = httpx.get(f"{svc.url}/v1/routes/{h['route_id']}", timeout=30)
                    assert r.status_code == 200, r.text
                    rec = decode_record(r.content)
                    assert rec.token_ids.tolist() == direct.token_ids.tolist()
                    assert np.array_equal(rec.experts, direct.experts)
        # Keys landed on more than one master: the cluster is really sharding them.
        slots = {st.redis.cluster_keyslot(f"so:{{{c['routed_experts']['route_id']}}}:m")
                 for c in via_a["choices"] + via_b["choices"]}  # fmt: skip
        assert len(slots) == 3
    finally:
        st.close()
    # The two engines are the same model and seed: one prompt routes identically on both.
    same_a = complete(a, "one prompt, two replicas")
    same_b = complete(b, "one prompt, two replicas")
    assert tokens_of(same_a) == tokens_of(same_b)
    st = store(cluster_url)
    try:
        ra = st.get(same_a["choices"][0]["routed_experts"]["route_id"])
        rb = st.get(same_b["choices"][0]["routed_experts"]["route_id"])
    finally:
        st.close()
    assert np.array_equal(ra.experts[ra.valid], rb.experts[rb.valid])


def test_a_trainer_batch_spans_both_replicas(replicas: Replicas, cluster_url: str) -> None:
    """One packed (THD) micro-batch of samples generated on A and on B: one batched read from
    the cluster, and the replay targets are each sample's own rows."""
    a, b = replicas.a, replicas.b
    resps = [complete(svc, f"batch sample {i}") for i, svc in enumerate((a, b, a, b))]
    ids = [r["choices"][0]["routed_experts"]["route_id"] for r in resps]
    st = store(cluster_url)
    try:
        records = st.get_many(ids)
    finally:
        st.close()
    # The same batch through one replica's batch endpoint: identical records.
    with RoutesClient(b.url) as rc:
        via_b = rc.get_many(ids)
    for x, y in zip(records, via_b, strict=True):
        assert np.array_equal(x.experts, y.experts) and np.array_equal(x.token_ids, y.token_ids)
    samples = [sample_from_record(i, rec) for i, rec in enumerate(records)]
    lens = [rec.num_tokens for rec in records]
    cu = np.concatenate([[0], np.cumsum(lens)])
    pmap = thd_position_map(samples, cu, records=records)
    layers = list(records[0].moe_layers)
    input_ids = np.concatenate([np.asarray(tokens_of(x)) for x in resps])[None, :]
    targets = gather_targets(pmap, records, layers, input_ids=input_ids)
    assert targets.experts.shape == (len(layers), int(cu[-1]), records[0].top_k)
    for i, rec in enumerate(records):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        got = targets.experts[:, rows][:, rec.valid]
        want = np.moveaxis(rec.experts[rec.valid], 1, 0)
        assert np.array_equal(got, want), f"sample {i} ({ids[i]})"
        assert targets.valid is not None and targets.valid[rows].sum() == rec.valid.sum()


def test_an_id_in_flight_on_one_replica_is_refused_on_the_other(
    replicas: Replicas, cluster_url: str
) -> None:
    a, b = replicas.a, replicas.b
    rid = _test_hold.PREFIX + "shared-rid"  # A's engine parks it until the test releases it
    done: dict[str, dict] = {}

    def held_request() -> None:
        done["r"] = complete(a, "long " * 8, rid=rid, ignore_eos=True)

    st = store(cluster_url)
    t = threading.Thread(target=held_request)
    t.start()
    try:
        # A holds the id once its claim (a lease in the cluster) exists.
        deadline = time.monotonic() + 60
        while not st.redis.exists(st.keys.claim(rid)):
            assert time.monotonic() < deadline and t.is_alive(), "A never claimed the id"
            time.sleep(0.01)
        r = httpx.post(b.url + "/v1/completions", headers={"X-Request-Id": rid},
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1},
                       timeout=60)  # fmt: skip
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "request_id_in_flight"
        assert t.is_alive()  # still held on A
    finally:
        (replicas.hold_dir / rid).touch()
        t.join()
        st.close()
    h = done["r"]["choices"][0]["routed_experts"]
    assert h["status"] == "stored" and h["route_id"] == f"{rid}-0"
    # Finished on A: B accepts the id now (an idempotent retry overwrites the route).
    again = complete(b, "retried on B", rid=rid)
    assert again["choices"][0]["routed_experts"]["status"] == "stored"


def test_a_replica_killed_mid_load_loses_nothing_the_other_served(
    replicas: Replicas, cluster_url: str
) -> None:
    """24 requests split over A and B; B is SIGKILLed (engine and all) while they run. Every
    request either replica answered has its whole route stored; the ones B never answered have
    no route or a whole one (never a partial record); their ids are free again after a lease."""
    a, b, proc_b = replicas.a, replicas.b, replicas.proc_b
    n = 24
    results: dict[int, dict | Exception] = {}
    # B's last three requests are 40 times longer than the rest: at any pace of the machine,
    # they are still generating when B's first short answer comes back and B is killed.
    long_on_b = {19, 21, 23}

    def one(i: int) -> None:
        svc = a if i % 2 == 0 else b
        max_tokens = 1900 if i in long_on_b else 48
        try:
            results[i] = complete(svc, f"load {i} " * 6, rid=f"kill-{i}", max_tokens=max_tokens,
                                  ignore_eos=True)  # fmt: skip
        except (httpx.HTTPError, AssertionError) as e:
            results[i] = e

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        # Kill B once it has answered something (so some of its routes exist) but not all.
        deadline = time.monotonic() + 300
        while not any(isinstance(results.get(i), dict) for i in range(1, n, 2)):
            assert time.monotonic() < deadline, "B answered nothing"
            time.sleep(0.05)
        os.killpg(proc_b.pid, signal.SIGKILL)
        for f in futures:
            f.result()

    served_a = [i for i in range(0, n, 2) if isinstance(results[i], dict)]
    served_b = [i for i in range(1, n, 2) if isinstance(results[i], dict)]
    lost_b = [i for i in range(1, n, 2) if not isinstance(results[i], dict)]
    assert len(served_a) == n // 2, {i: results[i] for i in range(0, n, 2)}
    assert served_b and lost_b, f"B served {served_b}, lost {lost_b}: the kill missed the load"
    print(f"B killed: A served {len(served_a)}, B served {len(served_b)}, B cut off {len(lost_b)}")
    st = store(cluster_url)
    try:
        for i in served_a + served_b:
            resp = results[i]
            assert isinstance(resp, dict)
            h = resp["choices"][0]["routed_experts"]
            assert h["status"] == "stored", (i, h)
            rec = st.get(h["route_id"])
            assert rec.token_ids.tolist() == tokens_of(resp), i
            assert rec.experts.shape[0] == h["num_rows"]
            # Readable through the surviving replica too.
            assert httpx.get(f"{a.url}/v1/routes/{h['route_id']}", timeout=30).status_code == 200
        for i in lost_b:
            try:
                rec = st.get(f"kill-{i}-0")  # stored just before the kill: must be whole
            except RouteNotFoundError:
                continue
            assert rec.num_tokens == len(rec.token_ids) and rec.experts.shape[0] == rec.num_tokens
    finally:
        st.close()
    # The ids B held lapse within one lease (nothing renews them now): a retry on A is accepted.
    st = store(cluster_url)
    try:
        for i in lost_b[:3]:
            key = st.keys.claim(f"kill-{i}")
            assert st.redis.pttl(key) <= LEASE_S * 1000  # -2 once lapsed
            deadline = time.monotonic() + 300
            while st.redis.exists(key):
                assert time.monotonic() < deadline, f"the claim on kill-{i} never lapsed"
                time.sleep(0.05)
    finally:
        st.close()
    for i in lost_b[:3]:
        retried = complete(a, f"load {i} " * 6, rid=f"kill-{i}")
        assert retried["choices"][0]["routed_experts"]["status"] == "stored"
    assert httpx.get(a.url + "/ready", timeout=10).status_code == 200
