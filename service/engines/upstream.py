"""Upstream engine backend: an existing ``vllm serve --enable-return-routed-experts`` server.

The request is forwarded (non-streaming, with ``return_token_ids``), vLLM's inline base64 ``.npy``
``choices[i].routed_experts`` is decoded and stored, and the client gets the small handle instead.
vLLM's server sends no routes on streamed responses, so a streamed request is served from one
upstream non-streaming call and re-emitted as SSE (one content chunk per choice): routes are
never lost, at the cost of time-to-first-token.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ..admission import label_cache_salt
from ..engine import (
    ChoiceDelta,
    ChoiceFinished,
    EngineBackend,
    EngineEvent,
    GenerationRequest,
    Logprob,
    PauseMode,
    PromptRendered,
    RLControl,
)
from ..errors import EngineUnavailableError, InvalidRequestError, ServiceError
from ..model_info import ModelInfo, moe_layout
from ..protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

__all__ = ["UpstreamBackend", "UpstreamError", "UpstreamRelease"]

log = logging.getLogger("routereplay.service")

# routereplay's own request fields; the upstream would reject or misread them.
_OWN_FIELDS = ("return_routed_experts", "routed_experts_weights", "stream", "stream_options")


class UpstreamError(ServiceError):
    """The upstream answered an error: relayed with its status and (OpenAI-schema) body."""

    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        err = body.get("error") if isinstance(body.get("error"), dict) else {}
        code = err.get("code")
        # vLLM's codes are HTTP status ints; this service's schema has string codes.
        super().__init__(
            str(err.get("message") or body)[:2000],
            param=err.get("param") if isinstance(err.get("param"), str) else None,
            code=str(code) if code is not None else f"upstream_{status_code}",
        )
        self.status_code = status_code
        self.type = str(err.get("type") or "upstream_error")


@dataclass(frozen=True)
class UpstreamRelease:
    """What the upstream vLLM server handles, read from it at start: its ``/version``; whether
    it honours ``routed_experts_prompt_start`` (vLLM 0.28 and later: an older one returns every
    row, which stored from the asked row would be shifted); whether it serves the RL routes
    (only under ``VLLM_SERVER_DEV_MODE=1``)."""

    version: str
    prompt_start: bool
    rl_api: bool

    def limits(self) -> list[str]:
        """One line per feature this upstream lacks, for the start-up log."""
        out = []
        if not self.prompt_start:
            out.append(
                f"upstream vLLM {self.version} predates routed_experts_prompt_start (0.28): it "
                "is not forwarded, and those requests store every row from row 0"
            )
        if not self.rl_api:
            out.append(
                f"upstream vLLM {self.version} serves no RL API (start it with "
                "VLLM_SERVER_DEV_MODE=1): the RL routes answer 400 not_supported"
            )
        return out


# The first release whose server honours routed_experts_prompt_start.
PROMPT_START_SINCE = (0, 28)


def _release_tuple(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def _load_config(path: str) -> Any:
    p = Path(path)
    if (p / "config.json").is_file():
        import json

        return json.loads((p / "config.json").read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


class UpstreamBackend(EngineBackend):
    def __init__(
        self,
        url: str,
        *,
        served_model_name: str | None = None,
        model_config_path: str | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # Sent as a bearer token to a vLLM started with --api-key; never logged.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.served_model_name = served_model_name
        self.model_config_path = model_config_path
        self.timeout_s = timeout_s
        self.client: httpx.AsyncClient | None = None
        self.upstream_model = ""
        self.release = UpstreamRelease("unknown", prompt_start=False, rl_api=False)
        self._rl = _UpstreamRL(self)

    @property
    def rl(self) -> RLControl:
        return self._rl

    @property
    def vllm_version(self) -> str | None:
        return self.release.version

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(self.timeout_s, connect=10.0),
            headers=self._headers,
            # Many concurrent long requests to one host: do not queue them in the pool.
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256),
        )
        try:
            r = await self.client.get("/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise RuntimeError(f"upstream {self.url} /v1/models failed: {e!r}") from e
        m = r.json()["data"][0]
        self.upstream_model = m["id"]
        self.release = await self._probe()
        for line in self.release.limits():
            log.warning("%s", line)
        # The upstream does not publish the layer layout; read the model's config (the path the
        # upstream loaded, when it is on this host, or the one configured).
        cfg_path = self.model_config_path or m.get("root") or m["id"]
        cfg = await asyncio.to_thread(_load_config, cfg_path)
        num_layers, moe, num_experts, top_k = moe_layout(cfg)
        self.info = ModelInfo(
            name=self.served_model_name or self.upstream_model,
            num_layers=num_layers,
            moe_layers=moe,
            num_experts=num_experts,
            top_k=top_k,
            max_model_len=int(m.get("max_model_len") or 0) or (1 << 30),
            root=m.get("root"),
        )

    async def _probe(self) -> UpstreamRelease:
        """The upstream's release and what it serves. A version it does not report (no
        ``/version``, or not a release number) is taken as one that has neither feature."""
        assert self.client is not None
        version = "unknown"
        try:
            r = await self.client.get("/version", timeout=10.0)
            if r.status_code == 200:
                version = str(r.json().get("version") or "unknown")
            # Any answer but 404 (an auth error included) means the route exists.
            rl_api = (await self.client.get("/is_paused", timeout=10.0)).status_code != 404
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise RuntimeError(f"upstream {self.url} /version failed: {e!r}") from e
        release = _release_tuple(version)
        prompt_start = release is not None and release >= PROMPT_START_SINCE
        return UpstreamRelease(version, prompt_start=prompt_start, rl_api=rl_api)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    @property
    def dead(self) -> bool:
        # The upstream may come back; this replica stays alive and reports not-ready meanwhile.
        return False

    async def check_ready(self) -> None:
        if self.client is None:
            raise EngineUnavailableError("upstream client not started", code="engine_not_started")
        try:
            r = await self.client.get("/health", timeout=5.0)
        except httpx.HTTPError as e:
            raise EngineUnavailableError(f"upstream unreachable: {e!r}") from e
        if r.status_code != 200:
            raise EngineUnavailableError(f"upstream /health answered {r.status_code}")

    def generate_chat(
        self, req: GenerationRequest[ChatCompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        return self._forward(req, "/v1/chat/completions", _chat_text)

    def generate_completion(
        self, req: GenerationRequest[CompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        return self._forward(req, "/v1/completions", _completion_text)

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        data = await self._post("/tokenize", self._body(req))
        return TokenizeResponse.model_validate(
            {k: data.get(k) for k in ("count", "max_model_len", "tokens", "token_strs")}
        )

    async def detokenize(self, req: DetokenizeRequest) -> str:
        return str((await self._post("/detokenize", self._body(req)))["prompt"])

    def _body(self, req: Any) -> dict[str, Any]:
        """The request as the client sent it (extensions included), for the upstream's model."""
        if getattr(req, "routed_experts_weights", None):
            # vLLM's server returns ids only; a record without the weights asked for is refused.
            raise InvalidRequestError(
                "routed_experts_weights: the upstream vLLM server returns no routing weights "
                "(only the in-process engine, --backend vllm --route-weights, captures them)",
                param="routed_experts_weights",
                code="unsupported",
            )
        body = {k: v for k, v in req.model_dump(exclude_unset=True).items() if k not in _OWN_FIELDS}
        if not self.release.prompt_start:
            body.pop("routed_experts_prompt_start", None)  # ignored there: every row comes back
        body["model"] = self.upstream_model
        return body

    async def _post(self, path: str, body: dict[str, Any], **kw: Any) -> Any:
        """POST to the upstream; its JSON answer, or its error relayed with its status."""
        assert self.client is not None
        try:
            r = await self.client.post(path, json=body, **kw)
        except httpx.HTTPError as e:
            raise EngineUnavailableError(
                f"upstream {self.url} failed: {e!r}", code="upstream_unreachable"
            ) from e
        try:
            # A response with inline routes of long sequences is MBs of JSON: parse it in a
            # worker thread, not on the event loop that serves every other request.
            data = await asyncio.to_thread(r.json) if len(r.content) > 1 << 20 else r.json()
        except ValueError:
            data = {"error": {"message": r.text[:500], "type": "upstream_error"}}
        if r.status_code >= 400:
            raise UpstreamError(r.status_code, data)
        return data

    async def _weight_version(self) -> str | None:
        """The upstream's weight version (None if it has no RL API or does not answer)."""
        assert self.client is not None
        if not self.release.rl_api:  # its /weight_info is a dev-mode route: nothing to ask
            return None
        try:
            r = await self.client.get("/weight_info", timeout=5.0)
            return str(r.json()["weight_version"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    async def _rendered(
        self, r: Any, prompt_ids: list[int], data: dict[str, Any], choices: list[dict[str, Any]]
    ) -> PromptRendered:
        """The prompt as the upstream ran it: its logprobs (chat: on the response, completions:
        on each choice), and for completions' echo its text (the upstream, asked for token ids,
        echoes none)."""
        raw = data.get("prompt_logprobs") or (
            choices[0].get("prompt_logprobs") if choices else None
        )
        plp = None
        if raw is not None:
            plp = [
                None if pos is None else {int(t): Logprob(**v) for t, v in pos.items()}
                for pos in raw
            ]
        text = None
        if isinstance(r, CompletionRequest) and r.echo:
            text = r.prompt if isinstance(r.prompt, str) else str(
                (await self._post("/detokenize", {"model": self.upstream_model,
                                                  "tokens": prompt_ids}))["prompt"]
            )  # fmt: skip
        return PromptRendered(prompt_token_ids=prompt_ids, prompt_text=text, prompt_logprobs=plp)

    async def _forward(
        self, req: GenerationRequest, path: str, text_of: Callable[[dict[str, Any]], str | None]
    ) -> AsyncIterator[EngineEvent]:
        body = self._body(req.request)
        if isinstance(req.request, ChatCompletionRequest):
            body.pop("echo", None)  # the serving layer echoes the last message
        body.update(stream=False, return_token_ids=True)
        # vLLM's server does not return weight-version spans: the version before and after the
        # call brackets them. Equal: every row had it. Different: the weights changed during the
        # request and the record says unknown rather than guess.
        before = await self._weight_version()
        if before is not None:
            # The upstream's prefix cache, partitioned by the weights' label (all it reports).
            body["cache_salt"] = label_cache_salt(before, req.request.cache_salt)
        data = await self._post(path, body, headers={"X-Request-Id": req.engine_request_id})
        after = await self._weight_version() if before is not None else None
        version = before if before is not None and before == after else None
        cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens"
        ) or 0
        choices = data.get("choices") or []
        # Chat puts prompt_token_ids on the response, completions on each choice.
        prompt_ids = data.get("prompt_token_ids") or (
            choices[0].get("prompt_token_ids") if choices else None
        )
        if not prompt_ids:
            raise EngineUnavailableError(
                "the upstream returned no prompt_token_ids (a vLLM without return_token_ids?)",
                code="upstream_incompatible",
            )
        yield await self._rendered(req.request, list(prompt_ids), data, choices)
        asked = req.request.routed_experts_prompt_start if self.release.prompt_start else 0
        for c in choices:
            out_ids = list(c.get("token_ids") or [])
            yield ChoiceDelta(
                index=c["index"],
                text=text_of(c) or "",
                token_ids=out_ids,
                raw_logprobs=c.get("logprobs"),
                last=True,  # the whole choice at once: its finish follows
                message=_message_extra(c),
            )
            b64 = c.get("routed_experts")
            arr, row_start, error = None, asked, None
            if b64:
                # A long sequence's inline array is MBs of base64: decode off the event loop.
                arr = await asyncio.to_thread(_decode_npy, b64)
                T = len(prompt_ids) + len(out_ids)
                row_start, error = _first_row(arr.shape[0], T, asked)
                arr = None if error is not None else arr
            else:
                error = (
                    "the upstream returned no routed_experts (is it started with "
                    "--enable-return-routed-experts?)"
                )
            yield ChoiceFinished(
                index=c["index"],
                finish_reason=c.get("finish_reason") or "stop",
                stop_reason=c.get("stop_reason"),
                output_token_ids=out_ids,
                num_cached_tokens=int(cached),
                routed_experts=arr,
                routes_row_start=row_start,
                routes_error=error,
                weight_versions=None if version is None else [(version, 0, max(len(out_ids), 1))],
            )


def _first_row(rows: int, T: int, asked: int) -> tuple[int, str | None]:
    """The token row the upstream's ``rows`` routes start at, for a sequence of ``T`` tokens
    whose routes were asked from row ``asked``: vLLM returns rows ``asked .. T - 1`` (the last
    token is never routed). Every row instead (an upstream that ignored the field): row 0. Any
    other count is no layout vLLM returns, and fails the route rather than store it shifted."""
    if rows == T - 1 - asked:
        return asked, None
    if asked and rows == T - 1:
        return 0, None
    return asked, (
        f"the upstream returned {rows} rows of routes for {T} tokens from row {asked} "
        f"(vLLM returns {max(T - 1 - asked, 0)}): not stored, since no row could be placed"
    )


def _message_extra(choice: dict[str, Any]) -> dict[str, Any] | None:
    """A chat choice's tool calls, which vLLM's tool parser made of its text."""
    calls = (choice.get("message") or {}).get("tool_calls")
    return {"tool_calls": calls} if calls else None


def _chat_text(choice: dict[str, Any]) -> str | None:
    return (choice.get("message") or {}).get("content")


def _completion_text(choice: dict[str, Any]) -> str | None:
    return choice.get("text")


def _decode_npy(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


class _UpstreamRL(RLControl):
    """The RL API forwarded to the upstream vLLM server (same paths and bodies)."""

    def __init__(self, backend: UpstreamBackend) -> None:
        self.b = backend

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        assert self.b.client is not None
        if not self.b.release.rl_api:
            raise NotImplementedError(
                f"the upstream vLLM {self.b.release.version} serves no RL API: start it with "
                "VLLM_SERVER_DEV_MODE=1"
            )
        try:
            r = await self.b.client.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise EngineUnavailableError(
                f"upstream {self.b.url} failed: {e!r}", code="upstream_unreachable"
            ) from e
        try:
            data = r.json()
        except ValueError:
            data = {"error": {"message": r.text[:500], "type": "upstream_error"}}
        if r.status_code >= 400:
            if isinstance(data.get("detail"), str):  # vLLM's RL routes answer FastAPI's shape
                data = {"error": {"message": data["detail"], "type": "upstream_error"}}
            elif isinstance(data.get("error"), str):
                data = {"error": {"message": data["error"], "type": "upstream_error"}}
            raise UpstreamError(r.status_code, data)
        return data

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        await self._call("POST", "/pause", params=params)

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    async def abort_requests(self, request_ids: list[str] | None) -> int:
        body = {"request_ids": request_ids} if request_ids else {}
        return int((await self._call("POST", "/abort_requests", json=body)).get("aborted", 0))

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._call("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._call("POST", "/shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        await self._call("POST", "/start_weight_update")

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._call("POST", "/update_weights", json={"update_info": update_info})

    async def finish_weight_update(self, weight_version: str | None) -> None:
        await self._call("POST", "/finish_weight_update", json={"weight_version": weight_version})

    async def update_weight_version(self, new_version: str) -> None:
        await self._call("POST", "/update_weight_version", json={"new_version": new_version})

    async def weight_version(self) -> str:
        return str((await self._call("GET", "/weight_info"))["weight_version"])

    async def reload_weights(
        self, checkpoint: Path, weight_version: str | None, root: Path
    ) -> None:
        # vLLM's server has no such route; its dev-mode /collective_rpc is the nearest, and is
        # off by default. Say so rather than pretend.
        raise NotImplementedError(
            "reload_weights is not part of vLLM's server API: update the upstream's weights "
            "through its weight transfer API (/start_weight_update, /update_weights, "
            "/finish_weight_update)"
        )

    async def world_size(self, include_dp: bool) -> int:
        params = {"include_dp": str(include_dp).lower()}
        return int((await self._call("GET", "/get_world_size", params=params))["world_size"])
