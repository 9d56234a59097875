"""Replay on megatron-core releases without RouterReplay (0.12.3, 0.13.1, 0.14.0, 0.15.3), CPU.

Each release's wheel is installed (``pip install --no-deps --target``, about 2 MB each) into
``~/.cache/routereplay/megatron-core/<version>`` and put first on ``PYTHONPATH`` of the processes
that run (the replay checks' ranks fork from a harness server started with that path,
``tests/gpu/harness.py``):

- tests/trainer/_legacy_topk_check.py: the legacy top-k against the release's own function
  (replaying the router's own choice is bit-exact in gates, map, counts and gradients; other
  experts are selected exactly; with no action the release's function runs untouched);
- tests/gpu/replay_check.py: a real GPTModel (layer 1 dense), THD-packed records, two micro-batches
  forward then backward with full activation recompute, hooks proving every (token, MoE layer)
  used the replayed experts in forward and recompute, R2 record/replay, the guards, the refused
  configurations, with every ``torch.cuda`` call from routereplay's code made to raise.

The multi-rank matrix (TP+SP, CP, EP, PP 1F1B, VPP) for all four releases is
``.venv/bin/python tests/trainer/legacy_matrix.py``; CI runs TP2+SP on the oldest and PP2 on the
newest.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import assert_policy, run_check  # noqa: E402

RELEASES = ["0.12.3", "0.13.1", "0.14.0", "0.15.3"]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "routereplay"


def release_path(version: str) -> Path:
    """A directory holding exactly megatron-core ``version`` (installed once per machine)."""
    target = CACHE / "megatron-core" / version
    if not (target / "megatron" / "core" / "package_info.py").is_file():
        # Installed aside and renamed: two test workers may want the same release at once.
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
        try:
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                 "--target", str(tmp), f"megatron-core=={version}"],
                check=True,
            )  # fmt: skip
            if not (target / "megatron" / "core" / "package_info.py").is_file():
                shutil.rmtree(target, ignore_errors=True)  # a half install of an older run
                with contextlib.suppress(OSError):  # another worker renamed its copy first
                    tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@pytest.fixture(scope="module", params=RELEASES)
def release(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    return request.param, {"PYTHONPATH": str(release_path(request.param))}


def test_topk_replay_matches_the_releases_own_function(release) -> None:
    version, env = release
    p = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_legacy_topk_check.py"))],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    r = json.loads(line[7:])
    assert r["megatron"] == version
    want = "topk_softmax_with_capacity" if version < "0.14" else "topk_routing_with_score_function"
    assert r["function"] == want
    assert len(r["cases"]) == 7
    for case in r["cases"]:
        assert case["bitwise"] and case["reproduces"], case
        assert case["selects_replayed"] and case["passthrough"], case


def test_replay_full_recompute_r2_guards_without_cuda(release, redis_url: str) -> None:
    version, env = release
    (r,) = run_check(1, "--extras", "--recompute", "full", "--no-cuda", redis_url=redis_url,
                     env=env)  # fmt: skip
    assert r["megatron"] == version and r["replay_path"] == "legacy"
    assert r["ok"], r
    assert r["router_layer_numbers"] == [2, 3, 4]  # layer 1 is dense
    assert r["targets_equal_truth"] == [True, True]
    assert r["router_grads_nonzero"] and r["expert_count_mismatches"] == []
    for layer, st in r["router_rows"].items():
        assert st["bad"] == 0 and st["fwd"] > 0 and st["rec"] == st["fwd"], (layer, st)
    assert r["r2"] == {"same_loss": True, "routes_match": True}
    assert "router sees 128 tokens but the replay target has 127 rows" in r["short_target_raises"]
    assert r["nograd_forward_in_step_raises"]
    assert r["bypass_detected"] is True
    assert r["refused"] == [
        "moe_router_fusion", "moe_router_load_balancing_type", "moe_expert_capacity_factor",
        "moe_input_jitter_eps", "moe_token_dispatcher_type", "enable_cuda_graph",
    ]  # fmt: skip
    assert r["refused_targets"] == ["top_k", "expert_range", "num_experts", "missing_layer"]


def test_own_routing_full_recompute_without_cuda(release, redis_url: str) -> None:
    """A stale and a missing record's samples take the router's own top-k through each
    release's top-k function; recompute repeats it although the router weights changed."""
    version, env = release
    res = run_check(1, "--policy", "own_routing", "--recompute", "full", "--perturb-router",
                    "--no-cuda", redis_url=redis_url, env=env)  # fmt: skip
    assert res[0]["megatron"] == version and res[0]["replay_path"] == "legacy"
    assert_policy(res, "own_routing", perturbed=True)


def test_oldest_release_tp2_sequence_parallel(redis_url: str) -> None:
    res = run_check(2, "--tp", "2", "--sp", redis_url=redis_url,
                    env={"PYTHONPATH": str(release_path(RELEASES[0]))})  # fmt: skip
    for r in res:
        assert r["ok"] and r["replay_path"] == "legacy", r
        assert all(st["fwd"] == 128 and st["bad"] == 0 for st in r["router_rows"].values())


def test_newest_release_pp2_1f1b_selective_recompute(redis_url: str) -> None:
    env = {"PYTHONPATH": str(release_path(RELEASES[-1]))}
    res = run_check(2, "--pp", "2", "--micro-batches", "4", "--recompute", "selective",
                    redis_url=redis_url, env=env)  # fmt: skip
    assert sorted(r["router_layer_numbers"] for r in res) == [[2], [3, 4]]
    for r in res:
        assert r["ok"] and r["replay_path"] == "legacy", r
        assert all(st["bad"] == 0 and st["rec"] == st["fwd"] > 0
                   for st in r["router_rows"].values())  # fmt: skip


def test_legacy_path_on_the_installed_native_release(redis_url: str) -> None:
    """path='legacy' on this environment's megatron-core (which has RouterReplay): the same
    guarantees through the legacy mechanism, on a model built without the replay flag."""
    (r,) = run_check(1, "--replay-path", "legacy", "--recompute", "full", "--no-cuda",
                     redis_url=redis_url)  # fmt: skip
    assert r["ok"] and r["replay_path"] == "legacy", r
    assert all(st["bad"] == 0 and st["rec"] == st["fwd"] > 0 for st in r["router_rows"].values())


def test_own_routing_legacy_path_left_padded(redis_url: str) -> None:
    """path='legacy' on the installed release: own_routing on a left-padded batch, selective
    recompute with the router weights changed before the backward."""
    res = run_check(1, "--replay-path", "legacy", "--policy", "own_routing", "--layout",
                    "padded-left", "--recompute", "selective", "--perturb-router", "--no-cuda",
                    redis_url=redis_url)  # fmt: skip
    assert res[0]["replay_path"] == "legacy"
    assert_policy(res, "own_routing", perturbed=True)


def test_the_adapter_has_no_cuda_calls() -> None:
    """Static half of the device-agnostic proof: no ``torch.cuda`` reference and no ``.cuda()``
    call anywhere in trainer_adapter/ (devices come from tensors)."""
    offenders = []
    for f in sorted((ROOT / "trainer_adapter").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "cuda":
                offenders.append(f"{f.name}:{node.lineno}")
    assert offenders == [], offenders


def test_the_no_cuda_guard_catches_a_call_from_the_adapter() -> None:
    """The runtime half can fail: a torch.cuda call from a file in trainer_adapter/ raises under
    replay_check's guard, one from elsewhere passes."""
    code = (
        "import sys; sys.path.insert(0, {!r})\n"
        "import replay_check, torch\n"
        "replay_check._forbid_cuda_in_routereplay()\n"
        "torch.cuda.device_count()  # from here: allowed\n"
        "import routereplay.trainer_adapter as ta, os\n"
        "fake = os.path.join(os.path.dirname(ta.__file__), 'probe.py')\n"
        "try:\n"
        "    exec(compile('import torch; torch.cuda.device_count()', fake, 'exec'))\n"
        "    print('NOT CAUGHT')\n"
        "except RuntimeError as e:\n"
        "    print('CAUGHT', e)\n"
    ).format(str(ROOT / "tests" / "gpu"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "CAUGHT torch.cuda.device_count called from" in p.stdout, p.stdout
