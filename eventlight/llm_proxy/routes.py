"""The proxy's HTTP routes: one span per routed chat completion or Anthropic Messages call (mixed into ``LLMProxy``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eventlight.llm_health import LLMCallHealth
from eventlight.llm_proxy import anthropic_messages
from eventlight.llm_proxy.forwarding import Forwarding
from eventlight.llm_proxy.metrics import CONTENT_TYPE_LATEST, ProxyMetrics
from eventlight.llm_proxy.span_attributes import make_span
from eventlight.llm_proxy.sse import aiter_chunks, chat_completion_to_sse
from eventlight.llm_proxy.upstream import (
    CHECK_HEADER,
    STOPPING_TYPE,
    CallError,
    error_response,
    refuse_body,
    refuse_unauthorized,
    upstream_error,
)
from eventlight.server.auth import BearerAuth
from eventlight.server.limits import BodyLimit, BodyReads, release_body

if TYPE_CHECKING:
    from eventlight.store.base import LightningStore

log = logging.getLogger(__name__)

STOPPING = "the call was cancelled before the upstream answered (the LLM proxy stopped)"
"""The message of a call cut by ``LLMProxy.stop``: its 503 answer's and its span's ``error.message``."""


def _refuse_constant(name: str) -> Any:
    """``json.loads``' hook for ``NaN`` / ``Infinity`` / ``-Infinity``, which JSON does not have."""
    raise ValueError(f"{name} is not a JSON value")


class ChatRoutes(Forwarding):
    """The FastAPI app: chat completions (routed and unrouted), models, health, metrics."""

    _store: LightningStore | None
    _warned_unrouted: bool
    _warned_no_store: bool
    health: LLMCallHealth
    metrics: ProxyMetrics
    _token: str | None
    _max_body_bytes: int
    _max_buffered_bytes: int | None
    _body_timeout_s: float | None
    _body_min_bytes_per_s: float | None
    _body_reads: BodyReads

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="eventlight LLM proxy", docs_url=None, redoc_url=None, openapi_url=None)

        async def internal_error(request: Request, exc: Exception) -> JSONResponse:
            # Logged with its traceback by the server; the client gets JSON, never a traceback.
            log.error("LLMProxy failed on %s: %s: %s", request.url.path, type(exc).__name__, exc)
            return error_response(500, f"LLM proxy internal error: {type(exc).__name__}: {exc}", "internal_error")

        app.add_exception_handler(Exception, internal_error)
        # Inside BearerAuth: a request without the token gets its 401 whatever its size.
        app.add_middleware(
            BodyLimit,
            max_body_bytes=self._max_body_bytes,
            max_buffered_bytes=self._max_buffered_bytes,
            body_timeout_s=self._body_timeout_s,
            body_min_bytes_per_s=self._body_min_bytes_per_s,
            refuse=refuse_body,
            reads=self._body_reads,
        )
        if self._token:  # every route, /health and /metrics included
            hint = "the LLM proxy asks for a token: use it as the OpenAI or Anthropic client's api_key"
            app.add_middleware(
                BearerAuth, token=self._token, refuse=refuse_unauthorized, hint=hint, key_header="x-api-key"
            )

        async def routed(request: Request, rollout_id: str, attempt_id: str) -> Response:
            return await self._handle_chat(request, rollout_id, attempt_id)

        async def unrouted(request: Request) -> Response:
            if not self._warned_unrouted and request.headers.get(CHECK_HEADER) is None:
                self._warned_unrouted = True
                log.warning(
                    "LLMProxy got %s without /rollout/<id>/attempt/<id>: it is forwarded but not recorded "
                    "(resolve the ProxyLLM with get_base_url(rollout_id, attempt_id))",
                    request.url.path,
                )
            return await self._handle_chat(request, None, None)

        async def messages_routed(request: Request, rollout_id: str, attempt_id: str) -> Response:
            return await self._handle_messages(request, rollout_id, attempt_id)

        async def messages_unrouted(request: Request) -> Response:
            return await self._handle_messages(request, None, None)

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

        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        for prefix in (
            "/rollout/{rollout_id}/attempt/{attempt_id}/v1",
            "/rollout/{rollout_id}/attempt/{attempt_id}",
        ):
            app.add_api_route(f"{prefix}/chat/completions", routed, methods=["POST"])
            app.add_api_route(f"{prefix}/models", models_routed, methods=["GET"])
        app.add_api_route("/rollout/{rollout_id}/attempt/{attempt_id}/v1/messages", messages_routed, methods=["POST"])
        app.add_api_route("/v1/messages", messages_unrouted, methods=["POST"])
        for prefix in ("/v1", ""):
            app.add_api_route(f"{prefix}/chat/completions", unrouted, methods=["POST"])
            app.add_api_route(f"{prefix}/models", models, methods=["GET"])
        app.add_api_route("/health", health, methods=["GET"])
        app.add_api_route("/metrics", metrics, methods=["GET"])
        return app

    async def _resolve_sequence(
        self, store: LightningStore, rollout_id: str, attempt_id: str
    ) -> tuple[str, int] | CallError:
        """Allocate the call's sequence id; a 404/503 error when the store refuses."""
        try:
            if attempt_id == "latest":
                latest = await store.get_latest_attempt(rollout_id)
                if latest is None:
                    raise ValueError(f"rollout {rollout_id!r} has no attempt")
                attempt_id = latest.attempt_id
            (sequence_id,) = await store.get_many_span_sequence_ids([(rollout_id, attempt_id)])
            return attempt_id, sequence_id
        except ValueError as exc:  # NotFoundError and InvalidInputError are ValueErrors
            message = f"unknown rollout {rollout_id!r} / attempt {attempt_id!r}: {exc}"
            return CallError(404, "not_found_error", message)
        except Exception as exc:
            log.exception("LLMProxy could not allocate a sequence id for %s/%s", rollout_id, attempt_id)
            message = (
                f"the store could not allocate a span sequence id for rollout {rollout_id!r} / "
                f"attempt {attempt_id!r}: {type(exc).__name__}: {exc}"
            )
            return CallError(503, "store_unavailable", message)

    async def _read_body(self, request: Request) -> dict[str, Any] | CallError:
        """The request's JSON object with a ``messages`` list and a ``model`` (the only one, if left out).

        Its bytes are read without ``request.body()``'s cached copy, so none is left once parsed
        (the callers then ``release_body``: the bytes stop counting while the model answers).
        """
        raw = b"".join([chunk async for chunk in request.stream()])
        try:
            body = json.loads(raw, parse_constant=_refuse_constant)
            if b"\\ud" in raw.lower():  # an escaped surrogate: a lone one is no text (nor storable in a span)
                json.dumps(body, ensure_ascii=False).encode()
        except (json.JSONDecodeError, UnicodeError, ValueError) as exc:
            return CallError(400, "invalid_request_error", f"request body is not JSON: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return CallError(
                400, "invalid_request_error", "request body must be a JSON object with a 'messages' list", "messages"
            )
        # Checked here, not by LiteLLM: it fails on these before sending, as a 502 that counts as a backend failure.
        wrong = next((i for i, m in enumerate(body["messages"]) if not isinstance(m, dict)), None)
        if wrong is not None:
            got = type(body["messages"][wrong]).__name__
            return CallError(
                400, "invalid_request_error", f"messages[{wrong}] must be an object, got {got}", "messages"
            )
        for key, kind, what in (
            ("model", str, "a string"),
            ("stream", bool, "a boolean"),
            ("stream_options", dict, "an object"),
        ):
            value = body.get(key)
            if value is not None and not isinstance(value, kind):
                message = f"'{key}' must be {what}, got {type(value).__name__} {json.dumps(value)[:80]}"
                return CallError(400, "invalid_request_error", message, key)
        if not body.get("model"):
            names = {e["model_name"] for e in self._model_list}
            if len(names) != 1:
                return CallError(400, "invalid_request_error", "request has no 'model'", "model")
            body["model"] = names.pop()
        return body

    async def _handle_chat(self, request: Request, rollout_id: str | None, attempt_id: str | None) -> Response:
        body = await self._read_body(request)
        release_body(request.scope)  # parsed: no copy of the bytes is left while the model answers
        if isinstance(body, CallError):
            return body.openai_response()
        streaming = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if streaming else False
        outcome = await self._call(request, body, rollout_id, attempt_id, streaming=streaming)
        if isinstance(outcome, CallError):
            return outcome.openai_response()
        if streaming:
            return StreamingResponse(
                aiter_chunks(chat_completion_to_sse(outcome, include_usage=include_usage)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(outcome)

    async def _handle_messages(self, request: Request, rollout_id: str | None, attempt_id: str | None) -> Response:
        """Anthropic's Messages API, translated by LiteLLM to a chat completion (``anthropic_messages``)."""
        body = await self._read_body(request)
        release_body(request.scope)  # parsed: no copy of the bytes is left while the model answers
        if isinstance(body, CallError):
            return body.anthropic_response()
        translated = anthropic_messages.to_openai(body)
        if isinstance(translated, CallError):
            return translated.anthropic_response()
        chat, tool_names = translated
        streaming = bool(body.get("stream"))
        outcome = await self._call(
            request, chat, rollout_id, attempt_id, streaming=streaming, route=anthropic_messages.ROUTE
        )
        if isinstance(outcome, CallError):
            return outcome.anthropic_response()
        message = anthropic_messages.to_anthropic(outcome, tool_names)
        if streaming:
            return StreamingResponse(
                aiter_chunks(anthropic_messages.message_to_sse(message)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(message)

    async def _call(
        self,
        request: Request,
        body: dict[str, Any],
        rollout_id: str | None,
        attempt_id: str | None,
        *,
        streaming: bool,
        route: str | None = None,
    ) -> dict[str, Any] | CallError:
        """Forward one chat completion (``body`` in OpenAI's shape) and record its span.

        Returns:
            The completion as a JSON dict, or the error to answer: an unknown rollout/attempt (404,
            nothing forwarded or recorded), the store failing (503), or the upstream's error (its
            status; recorded as a span with status ``ERROR``).
        """
        if self._cut:  # stop() is cutting the calls in flight: this one would be cut next
            return CallError(503, STOPPING_TYPE, STOPPING)
        start_time = time.time()
        store = self._store if rollout_id is not None else None
        sequence_id = 0
        if rollout_id is not None and store is None and not self._warned_no_store:
            self._warned_no_store = True
            log.warning("LLMProxy has no store: routed calls are forwarded but not recorded")
        if store is not None and rollout_id is not None and attempt_id is not None:
            resolved = await self._resolve_sequence(store, rollout_id, attempt_id)
            if isinstance(resolved, CallError):
                return resolved
            attempt_id, sequence_id = resolved

        completion: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        system = self._system_of(body["model"])

        def span_of(rollout_id: str, attempt_id: str, completion: dict[str, Any] | None, error: Any) -> Any:
            return make_span(
                body,
                completion,
                error,
                system=system,
                streaming=streaming,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence_id=sequence_id,
                start_time=start_time,
                route=route,
            )

        try:
            completion, provider = await self._forward_unless_cut(body)
            system = provider or system
        except asyncio.CancelledError:  # stop() ran out of patience: the sequence id is spent, record why
            if store is not None and rollout_id is not None and attempt_id is not None:
                cancelled = {"type": "Cancelled", "status_code": 503, "message": STOPPING}
                self._record_soon(store, span_of(rollout_id, attempt_id, None, cancelled))  # stop() waits for it
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the request itself was cancelled, not only its call
                raise
            return CallError(503, STOPPING_TYPE, STOPPING)
        except Exception as exc:
            status, err_type, message = upstream_error(exc)
            error = {"type": err_type, "status_code": status, "message": message}
            log.info("upstream error %d for model %r: %s", status, body.get("model"), message)
        if request.headers.get(CHECK_HEADER) is None:
            status = 200 if error is None else error["status_code"]
            detail = "" if error is None else error["message"]
            self.health.record(ok=error is None, status=status, detail=detail, model=str(body.get("model")))
            self.metrics.record(
                model=str(body.get("model")),
                latency_s=time.time() - start_time,
                completion=completion,
                error_status=None if error is None else int(error["status_code"]),
            )

        if store is not None and rollout_id is not None and attempt_id is not None:
            await self._record(store, span_of(rollout_id, attempt_id, completion, error))

        if error is not None:
            return CallError(int(error["status_code"]), str(error["type"]), str(error["message"]))
        assert completion is not None
        return completion
