"""``PolicyServer``: serve the policy being trained as an OpenAI-compatible chat endpoint, vLLM style.

The LLM proxy forwards the runners' calls here (and records them as spans). Each answer carries
what vLLM's ``return_token_ids`` gives: a top-level ``prompt_token_ids`` and per-choice
``token_ids`` (ending with the EOS token when the model stopped), plus OpenAI ``logprobs`` when
asked, so the triplets hold exactly the tokens the policy produced and the prompt it saw.

Concurrent requests with the same sampling settings are generated as one left-padded batch: the
requests that arrive while a batch is generating form the next one. ``model`` in an answer is the
version of the weights that produced it (``set_version``).

Errors come back in OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``, as
the LLM proxy answers them (``eventlight.server.openai_errors``): a prompt longer than
``max_context_tokens`` (with ``max_tokens``) answers 400 ``invalid_request_error`` with ``code``
``context_length_exceeded`` (OpenAI's); a body that is not a JSON object, without messages, or with
a sampling field of the wrong type (``max_tokens``, ``temperature``, ``top_p``) answers 400
``invalid_request_error`` naming it in ``param``; a request still waiting for its generation when
the server stops answers 503 ``server_stopping`` at once, as the proxy's own; a failed generation
500 ``internal_error``; an unknown route 404, a wrong method 405, and any other failure 500, never a
traceback. Request bodies pass ``eventlight.server.limits.BodyLimit`` first, as the proxy's and
``eventlight serve``'s do: one over ``max_body_bytes`` answers 413 ``invalid_request_error``, one that
would take the bytes held by all requests past ``max_buffered_bytes`` 503 ``server_busy`` (with
``Retry-After``; a request's bytes count until it is parsed, not while it waits for its
generation), one that goes ``body_timeout_s`` without a byte, or falls that far behind
``body_min_bytes_per_s``, 408 ``request_timeout`` (and the connection is closed), and one still
arriving when the server stops 503 ``server_stopping``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eventlight.rl.policy import Generation, Policy
from eventlight.server.limits import (
    DEFAULT_BODY_MIN_BYTES_PER_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    BodyLimit,
    BodyReads,
    check_body_limits,
    max_buffered_bytes_for,
    release_body,
)
from eventlight.server.openai_errors import SERVER_STOPPING, body_refusal, openai_error

log = logging.getLogger(__name__)

__all__ = ["PolicyServer"]


@dataclass
class _Job:
    prompt_ids: list[int]
    key: tuple[float, float, int]
    future: asyncio.Future[Generation] = field(repr=False)


class _Stopping(Exception):
    """The server stopped before a request's generation was done."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        yield  # the host process owns SIGINT/SIGTERM


_SHUTDOWN_TIMEOUT_S = 5
"""Seconds ``stop`` leaves requests in flight (e.g. reading a body) before uvicorn cancels them."""


class _BadRequest(Exception):
    """A request the server cannot take: 400 ``invalid_request_error``, naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code

    def response(self) -> JSONResponse:
        return openai_error(400, str(self), "invalid_request_error", param=self.param, code=self.code)


def _sampling_value(body: dict[str, Any], names: tuple[str, ...], default: float, *, whole: bool) -> float:
    """The first of ``names`` that ``body`` sets (``None`` counts as unset), else ``default``.

    Raises:
        _BadRequest: It is not a whole number >= 1 (``whole``) or a number >= 0.
    """
    name = next((n for n in names if body.get(n) is not None), None)
    if name is None:
        return default
    value = body[name]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if whole and not (number and isinstance(value, int) and value >= 1):
        raise _BadRequest(f"'{name}' must be a whole number >= 1, got {json.dumps(value)[:80]}", name)
    if not whole and not (number and value >= 0):
        raise _BadRequest(f"'{name}' must be a number >= 0, got {json.dumps(value)[:80]}", name)
    return float(value)


async def _read_json(request: Request) -> Any:
    """The request body, parsed, with no copy of its bytes left after (``request.json()`` keeps the
    bytes and the parsed copy on the request until it is answered, after its generation).

    Raises:
        ValueError: The body is not JSON (or not UTF-8).
    """
    raw = b"".join([chunk async for chunk in request.stream()])
    return json.loads(raw)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message, err_type = f"no route {request.method} {request.url.path}", "not_found_error"
    elif exc.status_code == 405:
        message, err_type = f"{request.url.path} does not accept {request.method}", "invalid_request_error"
    else:
        message, err_type = str(exc.detail), "invalid_request_error"
    return openai_error(exc.status_code, message, err_type)


async def _on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("policy server failed on %s", request.url.path, exc_info=exc)
    return openai_error(500, f"policy server internal error: {type(exc).__name__}: {exc}", "internal_error")


class PolicyServer:
    """An OpenAI-compatible endpoint that generates with a ``Policy`` in this process.

    Args:
        policy: The model to serve.
        host: Interface to bind.
        max_context_tokens: Longest prompt + ``max_tokens`` accepted (default: the model's context).
        max_batch: Most requests generated together.
        default_max_tokens: ``max_tokens`` when a request gives none.
        max_body_bytes: Largest request body, in bytes (413 above; default 16 MiB, far more than a
            chat request of any context the policy holds).
        max_buffered_bytes: The most request-body bytes held by all requests at once, each body's
            bytes counted as they come until the server has parsed it (not while it waits for its
            generation, when no copy of the bytes is left: slow generations do not make the server
            refuse new requests); 503 with ``Retry-After: 1`` above; default 256 MiB, or
            4 × ``max_body_bytes`` when larger.
        body_timeout_s: Seconds a request body may go without a byte arriving (408 after, the
            connection closed; default 30); ``None``: no timeout, and no minimum rate.
        body_min_bytes_per_s: The least average rate of a request body, in bytes per second, with
            ``body_timeout_s`` of slack (408 after, the connection closed; default 1 KiB/s);
            ``None``: none.

    Raises:
        ValueError: ``max_body_bytes < 1``, ``max_buffered_bytes < max_body_bytes``, or
            ``body_timeout_s`` / ``body_min_bytes_per_s`` is not a positive number.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        host: str = "127.0.0.1",
        max_context_tokens: int | None = None,
        max_batch: int = 32,
        default_max_tokens: int = 32,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_buffered_bytes: int | None = None,
        body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
        body_min_bytes_per_s: float | None = DEFAULT_BODY_MIN_BYTES_PER_S,
    ):
        check_body_limits(max_body_bytes, max_buffered_bytes, body_timeout_s, body_min_bytes_per_s)
        self.max_body_bytes = max_body_bytes
        self.max_buffered_bytes = max_buffered_bytes or max_buffered_bytes_for(max_body_bytes)
        self.body_timeout_s = body_timeout_s
        self.body_min_bytes_per_s = body_min_bytes_per_s
        self.body_reads = BodyReads()
        """The body limit's state (the bytes held, the reads in progress); ``stop`` cuts the reads."""
        self.policy = policy
        self.host = host
        self.max_context_tokens = max_context_tokens or policy.max_context
        self.max_batch = max_batch
        self.default_max_tokens = default_max_tokens
        self.version = "base"
        self.generated_batches = 0
        self._queue: asyncio.Queue[_Job] | None = None
        self._server: _Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._waiting: set[asyncio.Future[Generation]] = set()  # requests' generations not done yet
        self._stopping = False  # set by ``stop``: a request that reaches its generation after answers 503
        self.port = 0
        self.app = self._build_app()

    @property
    def endpoint(self) -> str:
        """``http://host:port/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def set_version(self, version: str) -> None:
        """Name the weights served from now on (answers carry it as ``model``)."""
        self.version = version

    async def start(self) -> str:
        """Bind a free port and serve on the running loop; returns ``endpoint``."""
        with socket.socket() as s:
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        self._queue = asyncio.Queue()
        self._stopping = False
        self.body_reads.reopen()
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_config=None,  # the host process configures logging
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=_SHUTDOWN_TIMEOUT_S,
        )
        self._server = _Server(config)
        self._tasks = [
            asyncio.create_task(self._server.serve(), name="policy-server"),
            asyncio.create_task(self._batcher(), name="policy-batcher"),
        ]
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()
                raise RuntimeError("the policy server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError("the policy server did not start within 30 s")
            await asyncio.sleep(0.02)
        log.info("policy server at %s", self.endpoint)
        return self.endpoint

    async def stop(self) -> None:
        """Stop serving; idempotent. Requests still waiting for their generation, or still sending
        their body, answer 503 at once (they hung until the event loop closed, and uvicorn printed a
        traceback for each). A request that reaches its generation only after this began (still
        reading its prompt's chat template) answers 503 too: nothing would generate for it."""
        self._stopping = True
        if self._server is not None:
            self._server.should_exit = True
            self.body_reads.cut()
        for task in self._tasks:
            if task.get_name() == "policy-batcher":
                task.cancel()
        for future in self._waiting:
            if not future.done():
                future.set_exception(_Stopping("the policy server stopped before this request's generation"))
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 10)
        self._tasks = []
        self._server = None

    async def __aenter__(self) -> PolicyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- batching ---------------------------------------------------------------------------

    async def _batcher(self) -> None:
        assert self._queue is not None
        while True:
            jobs = [await self._queue.get()]
            while not self._queue.empty() and len(jobs) < self.max_batch * 4:
                jobs.append(self._queue.get_nowait())
            by_key: dict[tuple[float, float, int], list[_Job]] = {}
            for job in jobs:
                by_key.setdefault(job.key, []).append(job)
            for (temperature, top_p, max_new), group in by_key.items():
                for i in range(0, len(group), self.max_batch):
                    await self._run(group[i : i + self.max_batch], temperature, top_p, max_new)

    async def _run(self, jobs: list[_Job], temperature: float, top_p: float, max_new: int) -> None:
        try:
            gens = await self.policy.call(
                self.policy.generate,
                [j.prompt_ids for j in jobs],
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new,
            )
            self.generated_batches += 1
        except Exception as exc:
            log.exception("generation failed for a batch of %d", len(jobs))
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(exc)
            return
        for j, g in zip(jobs, gens, strict=True):
            if not j.future.done():
                j.future.set_result(g)

    # -- HTTP -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="eventlight policy server")
        app.add_exception_handler(StarletteHTTPException, _on_http_error)
        app.add_exception_handler(Exception, _on_internal_error)
        app.add_middleware(
            BodyLimit,
            max_body_bytes=self.max_body_bytes,
            max_buffered_bytes=self.max_buffered_bytes,
            body_timeout_s=self.body_timeout_s,
            body_min_bytes_per_s=self.body_min_bytes_per_s,
            refuse=body_refusal("the policy server"),
            reads=self.body_reads,
        )

        @app.post("/v1/chat/completions")
        @app.post("/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            try:
                body = await _read_json(request)
            except ValueError as exc:
                return _BadRequest(f"the body is not JSON: {exc}").response()
            finally:
                release_body(request.scope)  # parsed: its bytes stop counting while it waits for a generation
            try:
                if not isinstance(body, dict):
                    raise _BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
                return await self._chat(body)
            except _BadRequest as exc:
                return exc.response()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.version, "object": "model", "owned_by": "eventlight"}]}

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "version": self.version}

        return app

    async def _chat(self, body: dict[str, Any]) -> JSONResponse:
        """Generate for one chat completion request.

        Raises:
            _BadRequest: The request cannot be taken (answered 400).
        """
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("messages must be a non-empty list", "messages")
        max_tokens = ("max_tokens", "max_completion_tokens")
        max_new = int(_sampling_value(body, max_tokens, self.default_max_tokens, whole=True))
        temperature = _sampling_value(body, ("temperature",), 1.0, whole=False)
        top_p = _sampling_value(body, ("top_p",), 1.0, whole=False)
        try:
            prompt_ids = await asyncio.to_thread(self.policy.chat_prompt_ids, messages)
        except Exception as exc:  # a malformed message the chat template rejects
            raise _BadRequest(f"cannot apply the chat template: {exc}", "messages") from None
        if len(prompt_ids) + max_new > self.max_context_tokens:
            raise _BadRequest(
                f"This model's maximum context length is {self.max_context_tokens} tokens; the prompt has "
                f"{len(prompt_ids)} and max_tokens is {max_new}",
                "messages",
                "context_length_exceeded",
            )
        assert self._queue is not None, "start() the server first"
        version = self.version
        if self._stopping:  # the batcher is gone: its generation would wait until uvicorn cancels it (500)
            return openai_error(503, "the policy server stopped before this request's generation", SERVER_STOPPING)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._waiting.add(future)
        await self._queue.put(_Job(prompt_ids, (round(temperature, 6), round(top_p, 6), max_new), future))
        try:
            gen = await future
        except _Stopping as exc:
            return openai_error(503, str(exc), SERVER_STOPPING)
        except Exception as exc:
            return openai_error(500, f"generation failed: {type(exc).__name__}: {exc}", "internal_error")
        finally:
            self._waiting.discard(future)
        return JSONResponse(self._completion(body, version, prompt_ids, gen))

    def _completion(self, body: dict[str, Any], version: str, prompt_ids: list[int], gen: Generation) -> dict[str, Any]:
        tok = self.policy.tokenizer
        text = tok.decode(gen.token_ids, skip_special_tokens=True)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": gen.finish_reason,
            "token_ids": gen.token_ids,
            "logprobs": None,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {"token": tok.convert_ids_to_tokens(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": version,
            "prompt_token_ids": prompt_ids,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": len(prompt_ids) + len(gen.token_ids),
            },
        }
