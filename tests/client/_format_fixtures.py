"""Blobs written by an earlier format version, kept so that newer readers are tested on them.

``python tests/client/_format_fixtures.py OUT [--client DIR]`` writes the fixture with the
installed ``routereplay.client``, or the ``client/`` directory of another checkout.
``data/format1.msgpack`` was written by format 1 (commit de1d71c: blake2b chunk addresses, no
``keep`` transform)::

    git worktree add /tmp/rr-v1 de1d71c
    .venv/bin/python tests/client/_format_fixtures.py tests/client/data/format1.msgpack \\
        --client /tmp/rr-v1/client

``make_records`` must stay byte-for-byte what it was: the tests compare the decoded blobs with
its output.
"""

from __future__ import annotations

import sys

import msgpack
import numpy as np


def make_records() -> dict[str, object]:
    from routereplay.client import RouteRecord, expert_dtype

    rng = np.random.default_rng(20261126)
    out: dict[str, object] = {}
    for name, T, E, K, style in (
        ("repeat-u8", 300, 128, 4, "repeat"),  # the delta transform
        ("distinct-u16", 70, 300, 3, "distinct"),  # plain, uint16 planes
        ("skewed-u8", 1200, 64, 8, "repeat"),  # long enough for several store chunks
    ):
        M = 3
        shape = (T, M, K)
        if style == "distinct":
            ex = np.argsort(rng.random((T * M, E)), axis=1)[:, :K].reshape(shape)
        else:
            ex = np.repeat(rng.integers(0, E, (1, M, K)), T, axis=0)
            flip = rng.random(shape) < 0.3
            ex = np.where(flip, rng.integers(0, E, shape), ex)
        valid = rng.random(T) < 0.9
        out[name] = RouteRecord(
            token_ids=rng.integers(0, 2**32, T, dtype=np.int64),
            experts=ex.astype(expert_dtype(E)),
            valid=valid,
            moe_layers=[1, 2, 3],
            num_layers=4,
            num_experts=E,
            prompt_len=T // 3,
            model="fixture",
        )
    return out


def write(path: str) -> None:
    from routereplay.client import encode_record
    from routereplay.client._layout import KeySchema, plan_put

    recs = make_records()
    doc: dict[str, object] = {"records": {}, "canonical": {}, "store": {}}
    for name, rec in recs.items():
        doc["records"][name] = encode_record(rec)  # type: ignore[index]
        doc["canonical"][name] = encode_record(rec, canonical_order=True)  # type: ignore[index]
        plan = plan_put(KeySchema("fx"), f"fx-{name}", rec, 128)
        doc["store"][name] = {  # type: ignore[index]
            "manifest": plan.manifest_blob,
            "chunks": [plan.chunk_blob(i) for i in range(len(plan.spans))],
        }
    with open(path, "wb") as f:
        f.write(msgpack.packb(doc, use_bin_type=True))


def _use_client(directory: str) -> None:
    """Import ``routereplay.client`` from ``directory`` instead of the installed one."""
    import importlib.util
    import os
    import types

    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    pkg = types.ModuleType("routereplay")
    pkg.__path__ = []
    sys.modules["routereplay"] = pkg
    spec = importlib.util.spec_from_file_location(
        "routereplay.client", os.path.join(directory, "__init__.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["routereplay.client"] = mod
    spec.loader.exec_module(mod)


if __name__ == "__main__":
    if "--client" in sys.argv:
        _use_client(sys.argv[sys.argv.index("--client") + 1])
    write(sys.argv[1])
