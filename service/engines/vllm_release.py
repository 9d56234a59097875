"""The installed vLLM release: whether the in-process engine serves it, and what of it it uses.

The engine supports vLLM :data:`OLDEST` through the :data:`NEWEST` minor line (``SUPPORTED``).
Within that range the service asks vLLM what it has rather than reading its version:

- routed-experts ids: every supported release (``enable_return_routed_experts`` and
  ``routed_experts_prompt_start``);
- routing weights (``--route-weights``): a vLLM whose capture sources equal a reviewed
  release's (``vllm_patches/route_weights.py``, ``REVIEWED``);
- weight-version spans on each output (``RequestOutput.weight_versions``): without them a
  route's ``weight_versions`` is empty (unknown);
- ``/shutdown_weight_transfer_engine``: ``AsyncLLM.shutdown_weight_transfer_engine``;
- the engine's retryable request error (``vllm.exceptions.RetryableRequestError``);
- ``logprob_token_ids`` (``SamplingParams.logprob_token_ids``): a request asking for it on a
  release without it is a 400 naming the release.

A release outside the range is refused at start by name (0.29 ends the engine on a request
whose ``routed_experts_prompt_start`` is its prompt length; 0.27-0.28 lack
``get_num_unfinished_requests``; a newer minor line has sources nobody here has read), and so is
one inside it lacking what every supported release has.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from dataclasses import dataclass

from ..errors import StartupRefused

__all__ = ["NEWEST", "OLDEST", "SUPPORTED", "VllmRelease", "check_release", "probe"]

OLDEST = (0, 30, 0)
NEWEST = (0, 33)  # the newest minor line whose sources were reviewed, every patch release of it
SUPPORTED = "0.30.0 to 0.33.x"

# What every supported release has and the engine uses unconditionally: (module, object,
# attribute or None).
_REQUIRED = (
    ("vllm.engine.arg_utils", "AsyncEngineArgs", "enable_return_routed_experts"),
    ("vllm.sampling_params", "SamplingParams", "routed_experts_prompt_start"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "get_num_unfinished_requests"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "pause_generation"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "init_weight_transfer_engine"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "finish_weight_update"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "get_weight_version"),
    ("vllm.renderers.params", "ChatParams", None),
    ("vllm.renderers.params", "TokenizeParams", None),
    ("vllm.exceptions", "VLLMClientError", None),
    ("vllm.exceptions", "GenerationError", None),
)


@dataclass(frozen=True)
class VllmRelease:
    """What the installed vLLM offers the service (:func:`probe`)."""

    version: str
    weight_versions: bool  # outputs carry weight-version spans
    transfer_shutdown: bool  # AsyncLLM.shutdown_weight_transfer_engine
    retryable_error: bool  # vllm.exceptions.RetryableRequestError
    route_weights: str | None  # the reviewed release the capture sources match; None: none
    route_weights_refusal: str | None  # why --route-weights cannot run on it (None: it can)
    logprob_token_ids: bool = False  # SamplingParams.logprob_token_ids

    def features(self) -> str:
        """One line: the features this release gives the service."""
        rw = f"weights (as {self.route_weights})" if self.route_weights else "no weights"
        return (
            f"vLLM {self.version}: ids, {rw}, "
            f"{'' if self.weight_versions else 'no '}weight-version spans, weight transfer"
            f"{'' if self.transfer_shutdown else ' without shutdown'}"
        )


def _has(module: str, name: str, attr: str | None) -> bool:
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    if attr is None:
        return True
    if dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
        return True
    return hasattr(obj, attr) or attr in getattr(obj, "__annotations__", {})


def _release_tuple(version: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]))


def probe() -> VllmRelease:
    """Ask the installed vLLM what it has (imports vLLM)."""
    import vllm

    from ..vllm_patches.route_weights import RouteWeightsUnsupported, reviewed_release

    try:
        reviewed, refusal = reviewed_release(), None
    except RouteWeightsUnsupported as e:
        reviewed, refusal = None, str(e)
    outputs = importlib.import_module("vllm.outputs")
    completion = getattr(outputs, "CompletionOutput", None)
    spans = completion is not None and "weight_versions" in inspect.signature(completion).parameters
    return VllmRelease(
        version=str(getattr(vllm, "__version__", "unknown")),
        weight_versions=spans,
        transfer_shutdown=_has(
            "vllm.v1.engine.async_llm", "AsyncLLM", "shutdown_weight_transfer_engine"
        ),
        retryable_error=_has("vllm.exceptions", "RetryableRequestError", None),
        route_weights=reviewed,
        route_weights_refusal=refusal,
        logprob_token_ids=_has("vllm.sampling_params", "SamplingParams", "logprob_token_ids"),
    )


def check_release(release: VllmRelease) -> None:
    """Raise :class:`StartupRefused` (one line naming the release and the range) unless the
    in-process engine serves ``release``."""
    at = _release_tuple(release.version)
    if at is None or at < OLDEST or at[:2] > NEWEST:
        raise StartupRefused(
            f"vLLM {release.version} is not a release routereplay's in-process engine serves "
            f"({SUPPORTED}); install one of those, or run this vLLM as `vllm serve` behind "
            "--backend upstream"
        )
    for module, name, attr in _REQUIRED:
        if not _has(module, name, attr):
            what = f"{module}.{name}" + (f".{attr}" if attr else "")
            raise StartupRefused(
                f"vLLM {release.version} has no {what}, which every release routereplay serves "
                f"({SUPPORTED}) has: its install is incomplete or patched"
            )
