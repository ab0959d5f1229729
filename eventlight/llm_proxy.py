"""``LLMProxy``: an OpenAI-compatible endpoint that forwards to backends and records every call as a span.

Agent-lightning's ``agentlightning.llm_proxy.LLMProxy`` with the same public names, served in-process
(FastAPI app, ``uvicorn.Server.serve()`` as an asyncio task on the caller's event loop) and forwarding
with a ``Router`` built from an Agent-lightning ``model_list``::

    proxy = LLMProxy(model_list=[{"model_name": "m", "litellm_params": {
        "model": "hosted_vllm/Qwen3-4B", "api_base": "http://127.0.0.1:8000/v1"}}], store=store)
    await proxy.start()
    await store.add_resources({"main_llm": proxy.as_resource()})
    # a runner calls  llm.get_base_url(rollout_id, attempt_id) + "/chat/completions"

Routes:

* ``POST /rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions`` (also without ``/v1``):
  allocates one span sequence id from the store (unknown ids answer 404 and record nothing),
  forwards with ``stream`` forced off upstream, and publishes exactly ONE span named
  ``openai.chat.completion`` per call, successful or not (an upstream error gives status ``ERROR``
  with ``error.type``, ``http.status_code`` and ``error.message``; the client gets the upstream
  status and an OpenAI-style error body).
* ``POST /v1/chat/completions`` (also without ``/v1``): forwards and records nothing (warns once).
* ``GET /v1/models``, ``GET /health``.

A client asking for ``stream: true`` gets a synthetic SSE stream built from the complete upstream
answer (Agent-lightning's ``StreamConversionMiddleware``, peer failure C12), so token ids are never
lost to streaming; the span is the one of the non-stream call.

Span attributes follow the OpenTelemetry GenAI conventions flattened as Agent-lightning's tracer
writes them (``gen_ai.prompt.{i}.role``, ``gen_ai.completion.{i}.content``, ...), plus
``prompt_token_ids`` / ``response_token_ids`` when the backend returns them (vLLM
``return_token_ids``) and ``token_ids_incomplete=True`` when the response ids do not match
``usage.completion_tokens`` (peer failure C14). Resource attributes: ``agentlightning.rollout_id``,
``agentlightning.attempt_id``, ``agentlightning.span_sequence_id``.

Differences from Agent-lightning 0.3: one launch mode (asyncio, in-process; the event loop must stay
responsive — a blocking algorithm stalls the proxy); ``update_model_list`` takes effect at once on a
running proxy (``restart()`` still works); a 4xx is never retried; ``as_resource()`` endpoints end in
``/v1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if "LITELLM_LOCAL_MODEL_COST_MAP" not in os.environ:  # offline: never fetch the cost map at import
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

import httpx  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from litellm.exceptions import ServiceUnavailableError as LiteLLMUnavailable  # noqa: E402
from litellm.exceptions import Timeout as LiteLLMTimeout  # noqa: E402
from litellm.router import Router  # noqa: E402

from eventlight.core.errors import LLMUnavailableError  # noqa: E402
from eventlight.core.types import LLM, Event, OtelResource, ProxyLLM, Span, TraceStatus  # noqa: E402
from eventlight.llm_health import LLMCallHealth  # noqa: E402
from eventlight.net import free_port  # noqa: E402

if TYPE_CHECKING:
    from eventlight.store.base import LightningStore

log = logging.getLogger(__name__)

litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" banners on stdout
# LiteLLM's lazily imported modules (Router internals, GitHub Copilot auth types, thinking blocks) make
# pydantic warn "... using the `ReadOnly` qualifier" at the first calls, some on every call; harmless.
warnings.filterwarnings("ignore", message=r".*`ReadOnly` qualifier", category=UserWarning, module=r"pydantic\.")

__all__ = ["LLMProxy", "build_chat_span_attributes", "chat_completion_to_sse"]

SPAN_NAME = "openai.chat.completion"
_STARTUP_TIMEOUT_S = 30.0
_SHUTDOWN_TIMEOUT_S = 5.0
_SPAN_WAIT_S = 5.0
_CONTENT_PIECE = 28
_ARGUMENTS_PIECE = 40
# Request keys the proxy handles itself instead of passing to LiteLLM.
_OWN_KEYS = frozenset({"model", "messages", "stream", "stream_options"})
# Marks the start-up check's request: not counted in ``health``, no "unrouted call" warning.
_CHECK_HEADER = "x-eventlight-check"


def _error_message(response: httpx.Response) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the start of the body."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return " ".join(str(message).split())[:300]


# ---------------------------------------------------------------------------------------------
# Attribute helpers


def _attr_value(value: Any) -> Any:
    """An OpenTelemetry-legal attribute value: a primitive, a list of one primitive type, or JSON text."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and next(iter(kinds)) in (str, bool, int, float):
            return list(value)
    return json.dumps(value, default=str, ensure_ascii=False)


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else an empty one (fields of a response may be missing or null)."""
    return value if isinstance(value, Mapping) else {}


def _put(attrs: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        attrs[key] = _attr_value(value)


def _int_list(value: Any) -> list[int] | None:
    """``value`` as a list of ints, or ``None`` if it is not one."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _put_tool_calls(attrs: dict[str, Any], prefix: str, tool_calls: Any) -> None:
    if not isinstance(tool_calls, list):
        return
    for j, call in enumerate(tool_calls):
        if not isinstance(call, Mapping):
            continue
        function = _mapping(call.get("function"))
        _put(attrs, f"{prefix}.tool_calls.{j}.id", call.get("id"))
        _put(attrs, f"{prefix}.tool_calls.{j}.type", call.get("type") or "function")
        _put(attrs, f"{prefix}.tool_calls.{j}.name", function.get("name"))
        _put(attrs, f"{prefix}.tool_calls.{j}.arguments", function.get("arguments"))


def _token_ids(response: Mapping[str, Any]) -> tuple[list[int] | None, list[list[int]]]:
    """Prompt ids and per-choice response ids from a vLLM-style (or LiteLLM-wrapped) completion."""
    prompt_ids = _int_list(response.get("prompt_token_ids"))
    per_choice: list[list[int]] = []
    for choice in response.get("choices") or []:
        if not isinstance(choice, Mapping):
            continue
        ids = _int_list(choice.get("token_ids"))
        if ids is None:
            extra = choice.get("provider_specific_fields")
            if isinstance(extra, Mapping):
                ids = _int_list(extra.get("token_ids"))
        if ids is not None:
            per_choice.append(ids)
    if not per_choice:  # older instrumented vLLM: top-level list of lists
        legacy = response.get("response_token_ids")
        if isinstance(legacy, list):
            per_choice = [ids for ids in (_int_list(x) for x in legacy) if ids is not None]
    return prompt_ids, per_choice


def build_chat_span_attributes(
    request: Mapping[str, Any],
    response: Mapping[str, Any] | None = None,
    *,
    system: str | None = None,
    streaming: bool = False,
    error: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Flatten one chat-completion call into OpenTelemetry GenAI span attributes.

    Args:
        request: The client's JSON body (``model``, ``messages``, sampling parameters, ``tools``).
        response: The completion as a JSON dict, ``None`` when the call failed.
        system: ``gen_ai.system`` (the LiteLLM provider, e.g. ``"openai"`` or ``"hosted_vllm"``).
        streaming: Whether the client asked for a stream (recorded as ``llm.is_streaming``).
        error: ``{"type", "status_code", "message"}`` of a failed call.

    Returns:
        Flat attributes whose values are str/int/float/bool or lists of one of them; they
        unflatten without conflicts (``eventlight.attributes.unflatten_attributes``).
    """
    attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "llm.request.type": "chat"}
    _put(attrs, "gen_ai.system", system)
    _put(attrs, "gen_ai.request.model", request.get("model"))
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "n"):
        _put(attrs, f"gen_ai.request.{key}", request.get(key))
    max_tokens = request.get("max_tokens", request.get("max_completion_tokens"))
    _put(attrs, "gen_ai.request.max_tokens", max_tokens)
    stop = request.get("stop")
    _put(attrs, "gen_ai.request.stop", [stop] if isinstance(stop, str) else stop)
    attrs["llm.is_streaming"] = bool(streaming)

    for i, tool in enumerate(request.get("tools") or []):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping):
            _put(attrs, f"gen_ai.request.functions.{i}.name", function.get("name"))
            _put(attrs, f"gen_ai.request.functions.{i}.description", function.get("description"))
            _put(attrs, f"gen_ai.request.functions.{i}.parameters", function.get("parameters"))

    for i, message in enumerate(request.get("messages") or []):
        if not isinstance(message, Mapping):
            _put(attrs, f"gen_ai.prompt.{i}.content", message)
            continue
        _put(attrs, f"gen_ai.prompt.{i}.role", message.get("role"))
        _put(attrs, f"gen_ai.prompt.{i}.content", message.get("content"))
        _put(attrs, f"gen_ai.prompt.{i}.name", message.get("name"))
        _put(attrs, f"gen_ai.prompt.{i}.tool_call_id", message.get("tool_call_id"))
        _put_tool_calls(attrs, f"gen_ai.prompt.{i}", message.get("tool_calls"))

    if response is not None:
        _put(attrs, "gen_ai.response.id", response.get("id"))
        _put(attrs, "gen_ai.response.model", response.get("model"))
        finish_reasons: list[str] = []
        for choice in response.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            i = choice.get("index", len(finish_reasons))
            message = _mapping(choice.get("message"))
            prefix = f"gen_ai.completion.{i}"
            _put(attrs, f"{prefix}.role", message.get("role") or "assistant")
            _put(attrs, f"{prefix}.content", message.get("content"))
            _put(attrs, f"{prefix}.reasoning_content", message.get("reasoning_content"))
            _put(attrs, f"{prefix}.finish_reason", choice.get("finish_reason"))
            _put_tool_calls(attrs, prefix, message.get("tool_calls"))
            if choice.get("finish_reason"):
                finish_reasons.append(str(choice["finish_reason"]))
            logprobs = choice.get("logprobs")
            if i == 0 and isinstance(logprobs, Mapping) and logprobs.get("content") is not None:
                attrs["logprobs.content"] = json.dumps(logprobs["content"], default=str)
        if finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = finish_reasons
        usage = _mapping(response.get("usage"))
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                attrs[f"gen_ai.usage.{key}"] = value

        prompt_ids, per_choice = _token_ids(response)
        if prompt_ids is not None:
            attrs["prompt_token_ids"] = prompt_ids
        if per_choice:
            attrs["response_token_ids"] = per_choice[0]
            completion_tokens = usage.get("completion_tokens")
            if isinstance(completion_tokens, int) and sum(len(ids) for ids in per_choice) != completion_tokens:
                attrs["token_ids_incomplete"] = True

    if error is not None:
        _put(attrs, "error.type", error.get("type"))
        _put(attrs, "http.status_code", error.get("status_code"))
        _put(attrs, "error.message", error.get("message"))
    else:
        attrs["http.status_code"] = 200
    return attrs


# ---------------------------------------------------------------------------------------------
# Stream conversion


def _pieces(text: str, size: int, *, at_spaces: bool) -> Iterator[str]:
    """Split ``text`` into pieces of at most ``size`` characters (broken after a space when possible)."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if at_spaces and end < len(text):
            cut = text.rfind(" ", start, end)
            if cut > start:
                end = cut + 1
        yield text[start:end]
        start = end


def chat_completion_to_sse(completion: Mapping[str, Any], *, include_usage: bool = False) -> Iterator[bytes]:
    """Render a complete chat completion as an OpenAI server-sent-event stream.

    Per choice: a role chunk, reasoning and content in ~28-character pieces broken at spaces, each
    tool call announced (id, type, name) and then its arguments in 40-character pieces, and a
    final chunk with ``finish_reason`` (default ``tool_calls`` if there are tool calls, else
    ``stop``) that also carries the choice's ``token_ids`` when known (vLLM's stream shape; the
    first chunk carries ``prompt_token_ids``). A usage chunk follows when ``include_usage``, then
    ``data: [DONE]``.

    Args:
        completion: The non-streaming completion as a JSON dict.
        include_usage: Emit the usage chunk (``stream_options.include_usage``).

    Yields:
        Encoded ``data: ...\\n\\n`` events.
    """
    base: dict[str, Any] = {
        "id": completion.get("id") or f"chatcmpl-{int(time.time())}",
        "object": "chat.completion.chunk",
        "created": completion.get("created") or int(time.time()),
        "model": completion.get("model") or "",
    }
    if completion.get("system_fingerprint"):
        base["system_fingerprint"] = completion["system_fingerprint"]
    prompt_ids, _ = _token_ids(completion)

    def event(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        chunk = dict(base, choices=[choice] if choice is not None else [], **extra)
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    first = True
    for n, choice in enumerate(completion.get("choices") or []):
        index = choice.get("index", n)
        message = choice.get("message") or {}

        def delta(d: dict[str, Any], *, index: int = index) -> dict[str, Any]:
            return {"index": index, "delta": d, "logprobs": None, "finish_reason": None}

        if first and prompt_ids is not None:
            yield event(delta({"role": "assistant", "content": ""}), prompt_token_ids=prompt_ids)
        else:
            yield event(delta({"role": "assistant", "content": ""}))
        first = False
        for piece in _pieces(message.get("reasoning_content") or "", _CONTENT_PIECE, at_spaces=True):
            yield event(delta({"reasoning_content": piece}))
        for piece in _pieces(message.get("content") or "", _CONTENT_PIECE, at_spaces=True):
            yield event(delta({"content": piece}))
        tool_calls = message.get("tool_calls") or []
        for j, call in enumerate(tool_calls):
            function = call.get("function") or {}
            head = {
                "index": j,
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {"name": function.get("name"), "arguments": ""},
            }
            yield event(delta({"tool_calls": [head]}))
            for piece in _pieces(function.get("arguments") or "", _ARGUMENTS_PIECE, at_spaces=False):
                yield event(delta({"tool_calls": [{"index": j, "function": {"arguments": piece}}]}))
        last: dict[str, Any] = {
            "index": index,
            "delta": {},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason") or ("tool_calls" if tool_calls else "stop"),
        }
        ids = _int_list(choice.get("token_ids"))
        if ids is None and isinstance(choice.get("provider_specific_fields"), Mapping):
            ids = _int_list(choice["provider_specific_fields"].get("token_ids"))
        if ids is not None:
            last["token_ids"] = ids
        yield event(last)
    if include_usage and completion.get("usage") is not None:
        yield event(None, usage=completion["usage"])
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# Errors


def _error_response(status: int, message: str, err_type: str, *, param: Any = None) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _upstream_error(exc: BaseException) -> tuple[int, str, str]:
    """``(http_status, error_type, message)`` of an exception raised by LiteLLM.

    ``error_type`` is LiteLLM's exception class (e.g. ``ContextWindowExceededError``,
    ``BadRequestError``); ``message`` is the upstream's own error message when it sent one.
    """
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 16:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    if any(isinstance(e, (openai.APITimeoutError, LiteLLMTimeout, TimeoutError)) for e in chain):
        return 504, "Timeout", f"upstream timed out: {getattr(exc, 'message', exc)}"
    if any(isinstance(e, openai.APIConnectionError) for e in chain) and not any(
        isinstance(e, openai.APIStatusError) and e.response is not None and e.body is not None for e in chain
    ):
        return (
            502,
            "APIConnectionError",
            f"cannot reach the upstream model server: {getattr(exc, 'message', exc)}",
        )
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or not 400 <= status < 600:
        status = 502
    body = getattr(exc, "body", None)
    message = None
    if isinstance(body, Mapping):
        error = body.get("error")
        inner = error if isinstance(error, Mapping) else body
        message = inner.get("message")
    if not isinstance(message, str) or not message:
        message = str(getattr(exc, "message", None) or exc)
    return status, type(exc).__name__, message


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


# ---------------------------------------------------------------------------------------------
# The proxy


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the host process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        yield


def _outbound_ipv4() -> str:
    """The machine's default outbound IPv4 (no packet is sent); ``127.0.0.1`` when there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _check_model_list(model_list: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, entry in enumerate(model_list):
        if not isinstance(entry, Mapping):
            raise ValueError(f"model_list[{i}] must be a dict, got {type(entry).__name__}")
        name = entry.get("model_name")
        params = entry.get("litellm_params")
        if not isinstance(name, str) or not name:
            raise ValueError(f"model_list[{i}] needs a non-empty str 'model_name'")
        if not isinstance(params, Mapping) or not isinstance(params.get("model"), str):
            raise ValueError(f"model_list[{i}] ({name!r}) needs 'litellm_params' with a str 'model'")
        out.append({**entry, "litellm_params": dict(params)})
    return out


def _wants_token_ids(params: Mapping[str, Any]) -> bool:
    """Auto rule: vLLM deployments and OpenAI-compatible servers at an explicit, non-OpenAI ``api_base``."""
    model = str(params.get("model", ""))
    if model.startswith("hosted_vllm/"):
        return True
    api_base = params.get("api_base")
    if not model.startswith("openai/") or not isinstance(api_base, str) or not api_base:
        return False
    host = (urlparse(api_base).hostname or "").lower()
    return not (host.endswith("openai.com") or host.endswith("azure.com"))


class LLMProxy:
    """An OpenAI-compatible proxy that forwards with LiteLLM and records one span per LLM call.

    Args:
        port: TCP port to listen on; ``None`` picks a free one now (kept across restarts).
        model_list: LiteLLM ``model_list`` entries ``{"model_name": str, "litellm_params": {"model":
            "openai/<name>" | "hosted_vllm/<name>" | ..., "api_base": ..., "api_key": ...}}``.
        store: Where spans go; without one, routed calls are forwarded but not recorded.
        host: Interface to bind. ``0.0.0.0``/``::`` bind all and advertise the default outbound IPv4.
        num_retries: Extra tries after a retryable upstream failure (429, 408, 5xx, connection
            errors, timeouts); a 4xx is never retried.
        return_token_ids: Ask the backend for token ids (vLLM's ``return_token_ids: true`` in the
            request body). ``None`` (default): for ``hosted_vllm/`` deployments and ``openai/``
            deployments with an explicit non-OpenAI ``api_base``; ``True``: every deployment;
            ``False``: never. An ``extra_body`` already in ``litellm_params`` wins.
        request_timeout_s: Seconds to wait for one upstream answer.
        health: Where the outcome of every forwarded call is counted (``Trainer`` stops a run when
            most recent calls fail); default ``LLMCallHealth()``: more than half of the last 20.

    Raises:
        ValueError: A ``model_list`` entry is malformed, or ``num_retries < 0``.
    """

    def __init__(
        self,
        port: int | None = None,
        model_list: Sequence[Mapping[str, Any]] | None = None,
        store: LightningStore | None = None,
        host: str = "127.0.0.1",
        num_retries: int = 0,
        *,
        return_token_ids: bool | None = None,
        request_timeout_s: float = 600.0,
        health: LLMCallHealth | None = None,
    ):
        if num_retries < 0:
            raise ValueError(f"num_retries must be >= 0, got {num_retries}")
        self._host = host or "127.0.0.1"
        self._port = int(port) if port is not None else free_port(self._host)
        self._model_list = _check_model_list(model_list or [])
        self._store = store
        self._num_retries = num_retries
        self._return_token_ids = return_token_ids
        self._request_timeout_s = request_timeout_s
        self._router: Router | None = None
        self._server: _EmbeddedServer | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._warned_unrouted = False
        self._warned_no_store = False
        self.health = health if health is not None else LLMCallHealth()
        self._app = self._build_app()

    # -- configuration --------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The interface the server binds."""
        return self._host

    @property
    def port(self) -> int:
        """The TCP port (chosen at construction when none was given)."""
        return self._port

    @property
    def access_host(self) -> str:
        """The host written into URLs: ``host``, or the outbound IPv4 when binding all interfaces."""
        if self._host in ("0.0.0.0", "::", ""):
            return _outbound_ipv4()
        return self._host

    @property
    def endpoint(self) -> str:
        """Base URL of the unrouted API, ``http://<access_host>:<port>/v1``."""
        host = self.access_host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}/v1"

    @property
    def model_list(self) -> list[dict[str, Any]]:
        """A copy of the configured LiteLLM ``model_list``."""
        return [dict(e) for e in self._model_list]

    @property
    def app(self) -> FastAPI:
        """The ASGI application (for mounting elsewhere or for in-process test clients)."""
        return self._app

    def get_store(self) -> LightningStore | None:
        """The store spans go to."""
        return self._store

    def set_store(self, store: LightningStore | None) -> None:
        """Use ``store`` for sequence ids and spans from the next request on."""
        self._store = store

    def update_model_list(self, model_list: Sequence[Mapping[str, Any]]) -> None:
        """Replace the backends.

        Unlike Agent-lightning (where it only takes effect on the next ``restart()``), a running
        proxy routes new requests with the new list at once; requests in flight finish on the old one.

        Raises:
            ValueError: An entry is malformed.
        """
        self._model_list = _check_model_list(model_list)
        if self.is_running():
            self._router = self._build_router()

    def as_resource(
        self,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        model: str | None = None,
        sampling_parameters: dict[str, Any] | None = None,
    ) -> LLM:
        """The proxy as an ``LLM`` resource.

        Args:
            rollout_id: With ``attempt_id``, bake that attempt's route into a plain ``LLM``.
            attempt_id: See ``rollout_id``.
            model: Model name for clients; default: the only ``model_name`` configured.
            sampling_parameters: Defaults for clients, e.g. ``{"temperature": 0.7}``.

        Returns:
            ``ProxyLLM(endpoint="http://host:port/v1", ...)`` without ids (a runner resolves it
            with ``get_base_url(rollout_id, attempt_id)``), or ``LLM`` with endpoint
            ``http://host:port/rollout/<rid>/attempt/<aid>/v1`` with both ids.

        Raises:
            ValueError: Exactly one of the ids is given, or ``model`` is ``None`` and the model
                list holds zero or several different ``model_name`` values.
        """
        if (rollout_id is None) != (attempt_id is None):
            raise ValueError("rollout_id and attempt_id must be given together")
        if model is None:
            names = sorted({e["model_name"] for e in self._model_list})
            if len(names) != 1:
                raise ValueError(f"cannot pick a model: the model list has {len(names)} names {names}; pass model=")
            model = names[0]
        proxy_llm = ProxyLLM(endpoint=self.endpoint, model=model, sampling_parameters=dict(sampling_parameters or {}))
        if rollout_id is None:
            return proxy_llm
        return LLM(
            endpoint=proxy_llm.get_base_url(rollout_id, attempt_id),
            model=model,
            sampling_parameters=dict(sampling_parameters or {}),
        )

    # -- lifecycle ------------------------------------------------------------------------

    def is_running(self) -> bool:
        """Whether the server task is up and accepting connections."""
        return (
            self._serve_task is not None
            and not self._serve_task.done()
            and self._server is not None
            and self._server.started
        )

    async def start(self) -> None:
        """Bind ``host:port`` and serve on the running event loop; returns once it accepts connections.

        Calling it while running does nothing.

        Raises:
            OSError: The port cannot be bound (e.g. it is in use).
            RuntimeError: The server did not come up within 30 s.
        """
        if self.is_running():
            return
        if self._store is None:
            log.warning("LLMProxy starts without a store: calls are forwarded but no span is recorded")
        self._router = self._build_router()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"LLMProxy cannot bind {self._host}:{self._port}: {exc.strerror}") from exc
        config = uvicorn.Config(
            self._app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(_SHUTDOWN_TIMEOUT_S),
        )
        server = _EmbeddedServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"eventlight-llm-proxy:{self._port}")
        self._server, self._serve_task = server, task
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not server.started:
            if task.done():
                self._server, self._serve_task = None, None
                failure = task.exception() if not task.cancelled() else None
                raise RuntimeError(f"LLMProxy server exited during startup: {failure!r}") from failure
            if time.monotonic() > deadline:
                await self.stop()
                raise RuntimeError(f"LLMProxy did not start within {_STARTUP_TIMEOUT_S} s")
            await asyncio.sleep(0.01)
        log.info("LLMProxy serving on %s (%d model entries)", self.endpoint, len(self._model_list))

    async def stop(self) -> None:
        """Stop serving and wait for spans still being published; idempotent.

        Requests in flight get up to 5 s to finish before their connections are dropped.
        """
        server, task = self._server, self._serve_task
        self._server, self._serve_task = None, None
        if server is not None and task is not None:
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(task), _SHUTDOWN_TIMEOUT_S + 2)
            except TimeoutError:
                server.force_exit = True
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            except Exception:  # the server crashed earlier; nothing left to stop
                log.exception("LLMProxy server task ended with an error")
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=_SPAN_WAIT_S)
        self._router = None

    async def restart(self) -> None:
        """``stop()`` then ``start()`` on the same port (e.g. after ``update_model_list``).

        Raises:
            OSError: The port cannot be bound again.
            RuntimeError: The server did not come up.
        """
        await self.stop()
        await self.start()

    async def __aenter__(self) -> LLMProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def check(self, *, timeout_s: float = 120.0) -> None:
        """Send one short chat completion per model name through the running proxy to its backend.

        Run it before the first rollout: a backend that is down, or a local model that crashes on
        its first request, fails here with one line instead of failing every rollout. The check
        records no span and does not count towards ``health``.

        Args:
            timeout_s: Seconds to wait for each answer (a cold local model may take a while).

        Raises:
            LLMUnavailableError: A model did not answer with a completion; the message names the
                proxy endpoint, the backend ``api_base`` and the cause.
            RuntimeError: The proxy is not running.
        """
        if not self.is_running():
            raise RuntimeError("LLMProxy.check() needs a running proxy; call start() first")
        url = (
            f"http://127.0.0.1:{self._port}/v1/chat/completions"
            if self._host in ("0.0.0.0", "::", "")
            else (f"{self.endpoint}/chat/completions")
        )
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            for model in dict.fromkeys(e["model_name"] for e in self._model_list):
                backends = ", ".join(
                    str(e["litellm_params"].get("api_base") or e["litellm_params"]["model"])
                    for e in self._model_list
                    if e["model_name"] == model
                )
                where = f"model {model!r} through the LLM proxy at {self.endpoint} (backend {backends})"
                body = {"model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1}
                try:
                    r = await client.post(url, json=body, headers={_CHECK_HEADER: "1"})
                except httpx.HTTPError as exc:
                    raise LLMUnavailableError(where, f"{type(exc).__name__}: {exc}") from exc
                if r.status_code != 200:
                    raise LLMUnavailableError(where, f"HTTP {r.status_code}: {_error_message(r)}")
                log.info("LLM check passed: %s", where)

    # -- forwarding -----------------------------------------------------------------------

    def _build_router(self) -> Router | None:
        if not self._model_list:
            return None
        entries = []
        for entry in self._model_list:
            params = dict(entry["litellm_params"])
            want = self._return_token_ids if self._return_token_ids is not None else _wants_token_ids(params)
            extra = dict(params.get("extra_body") or {})
            if want and "return_token_ids" not in extra:
                extra["return_token_ids"] = True
                params["extra_body"] = extra
            entries.append({**entry, "litellm_params": params})
        router: Router = Router(model_list=entries, num_retries=0, timeout=self._request_timeout_s)
        return router

    def _system_of(self, model: Any) -> str | None:
        for entry in self._model_list:
            if entry["model_name"] == model:
                name = entry["litellm_params"]["model"]
                return name.split("/", 1)[0] if "/" in name else "openai"
        return None

    async def _forward(self, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """Call the backend without streaming; return the completion dict and the provider name.

        Raises:
            Exception: LiteLLM's error after the retries allowed for retryable failures.
        """
        router = self._router
        if router is None:
            raise LiteLLMUnavailable(
                message="the LLM proxy has no backend models; call update_model_list()",
                llm_provider="",
                model=str(body.get("model")),
            )
        kwargs = {k: v for k, v in body.items() if k not in _OWN_KEYS}
        attempt = 0
        while True:
            try:
                resp = await router.acompletion(model=body["model"], messages=body["messages"], stream=False, **kwargs)
                break
            except Exception as exc:
                status, _, message = _upstream_error(exc)
                if attempt >= self._num_retries or not _retryable(status):
                    raise
                attempt += 1
                delay = min(0.5 * 2 ** (attempt - 1), 8.0)
                log.warning(
                    "upstream failed (%s: %s); retry %d/%d in %.1f s",
                    status,
                    message,
                    attempt,
                    self._num_retries,
                    delay,
                )
                await asyncio.sleep(delay)
        completion: dict[str, Any] = resp.model_dump(mode="json", warnings=False)  # type: ignore[no-untyped-call]
        for choice in completion.get("choices") or []:
            extra = choice.get("provider_specific_fields")
            if isinstance(extra, dict) and choice.get("token_ids") is None and extra.get("token_ids") is not None:
                choice["token_ids"] = extra["token_ids"]
        hidden = getattr(resp, "_hidden_params", None) or {}
        return completion, hidden.get("custom_llm_provider")

    # -- spans ----------------------------------------------------------------------------

    async def _publish(self, store: LightningStore, span: Span) -> None:
        try:
            await store.add_many_spans([span])
        except Exception:
            log.exception(
                "LLMProxy could not record span %s (rollout %s, attempt %s, sequence %d)",
                span.span_id,
                span.rollout_id,
                span.attempt_id,
                span.sequence_id,
            )

    async def _record(self, store: LightningStore, span: Span) -> None:
        """Publish ``span``; wait at most 5 s (publication continues in the background after that)."""
        task = asyncio.create_task(self._publish(store, span), name=f"llm-proxy-span:{span.span_id}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        try:
            await asyncio.wait_for(asyncio.shield(task), _SPAN_WAIT_S)
        except TimeoutError:
            log.warning("recording span %s takes over %.0f s; answering the client first", span.span_id, _SPAN_WAIT_S)

    # -- HTTP -----------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="eventlight LLM proxy", docs_url=None, redoc_url=None, openapi_url=None)

        async def internal_error(request: Request, exc: Exception) -> JSONResponse:
            # Logged with its traceback by the server; the client gets JSON, never a traceback.
            log.error("LLMProxy failed on %s: %s: %s", request.url.path, type(exc).__name__, exc)
            return _error_response(500, f"LLM proxy internal error: {type(exc).__name__}: {exc}", "internal_error")

        app.add_exception_handler(Exception, internal_error)

        async def routed(request: Request, rollout_id: str, attempt_id: str) -> Response:
            return await self._handle_chat(request, rollout_id, attempt_id)

        async def unrouted(request: Request) -> Response:
            if not self._warned_unrouted and request.headers.get(_CHECK_HEADER) is None:
                self._warned_unrouted = True
                log.warning(
                    "LLMProxy got %s without /rollout/<id>/attempt/<id>: it is forwarded but not recorded "
                    "(resolve the ProxyLLM with get_base_url(rollout_id, attempt_id))",
                    request.url.path,
                )
            return await self._handle_chat(request, None, None)

        async def models() -> dict[str, Any]:
            names = sorted({e["model_name"] for e in self._model_list})
            now = int(time.time())
            return {
                "object": "list",
                "data": [{"id": n, "object": "model", "created": now, "owned_by": "eventlight"} for n in names],
            }

        async def models_routed(rollout_id: str, attempt_id: str) -> dict[str, Any]:
            return await models()

        async def health() -> dict[str, Any]:
            return {"status": "ok", "models": len(self._model_list)}

        for prefix in (
            "/rollout/{rollout_id}/attempt/{attempt_id}/v1",
            "/rollout/{rollout_id}/attempt/{attempt_id}",
        ):
            app.add_api_route(f"{prefix}/chat/completions", routed, methods=["POST"])
            app.add_api_route(f"{prefix}/models", models_routed, methods=["GET"])
        for prefix in ("/v1", ""):
            app.add_api_route(f"{prefix}/chat/completions", unrouted, methods=["POST"])
            app.add_api_route(f"{prefix}/models", models, methods=["GET"])
        app.add_api_route("/health", health, methods=["GET"])
        return app

    async def _resolve_sequence(
        self, store: LightningStore, rollout_id: str, attempt_id: str
    ) -> tuple[str, int] | JSONResponse:
        """Allocate the call's sequence id; a 404/503 response when the store refuses."""
        try:
            if attempt_id == "latest":
                latest = await store.get_latest_attempt(rollout_id)
                if latest is None:
                    raise ValueError(f"rollout {rollout_id!r} has no attempt")
                attempt_id = latest.attempt_id
            (sequence_id,) = await store.get_many_span_sequence_ids([(rollout_id, attempt_id)])
            return attempt_id, sequence_id
        except ValueError as exc:  # NotFoundError and InvalidInputError are ValueErrors
            return _error_response(
                404, f"unknown rollout {rollout_id!r} / attempt {attempt_id!r}: {exc}", "not_found_error"
            )
        except Exception as exc:
            log.exception("LLMProxy could not allocate a sequence id for %s/%s", rollout_id, attempt_id)
            return _error_response(
                503,
                f"the store could not allocate a span sequence id for rollout {rollout_id!r} / "
                f"attempt {attempt_id!r}: {type(exc).__name__}: {exc}",
                "store_unavailable",
            )

    async def _handle_chat(self, request: Request, rollout_id: str | None, attempt_id: str | None) -> Response:
        start_time = time.time()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error_response(400, f"request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error_response(
                400,
                "request body must be a JSON object with a 'messages' list",
                "invalid_request_error",
                param="messages",
            )
        if not body.get("model"):
            names = {e["model_name"] for e in self._model_list}
            if len(names) != 1:
                return _error_response(400, "request has no 'model'", "invalid_request_error", param="model")
            body["model"] = names.pop()
        streaming = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if streaming else False

        store = self._store if rollout_id is not None else None
        sequence_id = 0
        if rollout_id is not None and store is None and not self._warned_no_store:
            self._warned_no_store = True
            log.warning("LLMProxy has no store: routed calls are forwarded but not recorded")
        if store is not None and rollout_id is not None and attempt_id is not None:
            resolved = await self._resolve_sequence(store, rollout_id, attempt_id)
            if isinstance(resolved, JSONResponse):
                return resolved
            attempt_id, sequence_id = resolved

        completion: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        system = self._system_of(body["model"])
        try:
            completion, provider = await self._forward(body)
            system = provider or system
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            status, err_type, message = _upstream_error(exc)
            error = {"type": err_type, "status_code": status, "message": message}
            log.info("upstream error %d for model %r: %s", status, body.get("model"), message)
        if request.headers.get(_CHECK_HEADER) is None:
            status = 200 if error is None else error["status_code"]
            detail = "" if error is None else error["message"]
            self.health.record(ok=error is None, status=status, detail=detail, model=str(body.get("model")))

        if store is not None and rollout_id is not None and attempt_id is not None:
            span = self._make_span(
                body,
                completion,
                error,
                system=system,
                streaming=streaming,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence_id=sequence_id,
                start_time=start_time,
            )
            await self._record(store, span)

        if error is not None:
            return _error_response(error["status_code"], error["message"], error["type"])
        assert completion is not None
        if streaming:
            return StreamingResponse(
                _aiter(chat_completion_to_sse(completion, include_usage=include_usage)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(completion)

    @staticmethod
    def _make_span(
        body: dict[str, Any],
        completion: dict[str, Any] | None,
        error: dict[str, Any] | None,
        *,
        system: str | None,
        streaming: bool,
        rollout_id: str,
        attempt_id: str,
        sequence_id: int,
        start_time: float,
    ) -> Span:
        attributes = build_chat_span_attributes(body, completion, system=system, streaming=streaming, error=error)
        status = (
            TraceStatus(status_code="ERROR", description=error["message"]) if error else TraceStatus(status_code="OK")
        )
        span = Span.from_attributes(
            attributes=attributes,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            name=SPAN_NAME,
            trace_id=uuid.uuid4().hex,
            span_id=uuid.uuid4().hex[:16],
            start_time=start_time,
            end_time=time.time(),
            status=status,
            resource=OtelResource(
                attributes={
                    "service.name": "eventlight.llm_proxy",
                    "agentlightning.rollout_id": rollout_id,
                    "agentlightning.attempt_id": attempt_id,
                    "agentlightning.span_sequence_id": sequence_id,
                }
            ),
        )
        if error:
            span.events.append(
                Event(
                    name="exception",
                    attributes={
                        "exception.type": str(error["type"]),
                        "exception.message": str(error["message"]),
                    },
                    timestamp=span.end_time,
                )
            )
        return span


async def _aiter(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
