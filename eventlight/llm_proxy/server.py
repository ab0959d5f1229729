"""``LLMProxy``: the in-process server (FastAPI under ``uvicorn.Server.serve()``): configuration and lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI
from litellm.router import Router

from eventlight.core.types import LLM, ProxyLLM
from eventlight.credentials import check_bearer_token
from eventlight.llm_health import LLMCallHealth
from eventlight.llm_proxy.forwarding import _SPAN_WAIT_S
from eventlight.llm_proxy.metrics import ProxyMetrics
from eventlight.llm_proxy.routes import ChatRoutes
from eventlight.llm_proxy.upstream import STOPPING_TYPE, check_model_list, check_models
from eventlight.net import free_port, tcp_listener
from eventlight.server.limits import (
    DEFAULT_BODY_MIN_BYTES_PER_S,
    DEFAULT_BODY_TIMEOUT_S,
    BodyReads,
    check_body_limits,
    max_buffered_bytes_for,
)
from eventlight.settings import proxy_token_from_env

if TYPE_CHECKING:
    from eventlight.store.base import LightningStore

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 30.0

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
"""32 MiB: a long conversation with a few images fits (a stored span holds at most 8 MiB of it)."""
_SHUTDOWN_TIMEOUT_S = 5.0
"""Seconds ``stop`` gives the calls in flight before it cuts those still waiting for their backend."""
_AFTER_CUT_S = 5.0
"""Seconds after the cut for the cut calls to answer 503, and the rest to end, before uvicorn cancels them."""


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


class LLMProxy(ChatRoutes):
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
        token: Bearer token every request must carry (``Authorization: Bearer <token>``, which the
            OpenAI SDK sends for ``api_key=<token>``); others get 401 with an OpenAI error body
            (``code: invalid_api_key``). ``None`` (default): ``$EVENTLIGHT_PROXY_TOKEN`` or the file
            ``$EVENTLIGHT_PROXY_TOKEN_FILE`` names, else no token; ``""``: no token, whatever the
            environment says. It never lands in a span, a log line or a metric, nor in ``as_resource()``:
            runners add it to the ``ProxyLLM`` they hand their agents (``LitAgentRunner(proxy_token=)``).
        max_body_bytes: Largest request body, in bytes (default ``DEFAULT_MAX_BODY_BYTES``, 32 MiB); a
            larger one gets 413 with an OpenAI error body (``invalid_request_error``, on every route),
            counted while it arrives (``eventlight.server.limits.BodyLimit``, as ``eventlight serve``):
            a ``Content-Length`` above it is refused before a byte is read, a chunked body as soon as
            it passes it, so a huge body is never buffered whole. Nothing is forwarded or recorded.
        max_buffered_bytes: The most request-body bytes held by all calls at once, each body's bytes
            counted as they come until the proxy has parsed it (not while its model answers, when it
            holds the parsed call and no copy of the bytes: a slow model does not make the proxy
            refuse new calls); a call that would pass it gets 503 with
            ``Retry-After: 1`` (``type`` ``server_busy``; the OpenAI SDK retries it). Default:
            256 MiB, or 4 × ``max_body_bytes`` when larger.
        body_timeout_s: Seconds a request body may go without a byte arriving; then 408 (``type``
            ``request_timeout``) and the connection is closed (default 30; ``None``: no timeout, and
            no minimum rate).
        body_min_bytes_per_s: The least average rate of a request body, in bytes per second, with
            ``body_timeout_s`` of slack; a body further behind gets 408 ``request_timeout`` and the
            connection is closed (default 1 KiB/s; ``None``: none).

    Raises:
        ValueError: A ``model_list`` entry is malformed, ``num_retries < 0``, ``max_body_bytes < 1``,
            ``max_buffered_bytes < max_body_bytes``, or ``body_timeout_s`` / ``body_min_bytes_per_s`` is
            not a positive number.
        InvalidInputError: ``$EVENTLIGHT_PROXY_TOKEN_FILE`` cannot be read or is empty, or the token
            holds a space or a character outside visible ASCII (no client could send it).
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
        token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_buffered_bytes: int | None = None,
        body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
        body_min_bytes_per_s: float | None = DEFAULT_BODY_MIN_BYTES_PER_S,
    ):
        if num_retries < 0:
            raise ValueError(f"num_retries must be >= 0, got {num_retries}")
        check_body_limits(max_body_bytes, max_buffered_bytes, body_timeout_s, body_min_bytes_per_s)
        self._max_body_bytes = max_body_bytes
        self._max_buffered_bytes = max_buffered_bytes or max_buffered_bytes_for(max_body_bytes)
        self._body_timeout_s = body_timeout_s
        self._body_min_bytes_per_s = body_min_bytes_per_s
        self._body_reads = BodyReads()  # the body limit's state: stop() refuses new calls, then cuts reads
        self._host = host or "127.0.0.1"
        self._port = int(port) if port is not None else free_port(self._host)
        self._model_list = check_model_list(model_list or [])
        self._store = store
        self._num_retries = num_retries
        self._return_token_ids = return_token_ids
        self._request_timeout_s = request_timeout_s
        self._router: Router | None = None
        self._server: _EmbeddedServer | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._forwarding: set[asyncio.Task[Any]] = set()  # calls waiting for their backend (stop() cuts them)
        self._cut = False
        self._warned_unrouted = False
        self._warned_no_store = False
        self.health = health if health is not None else LLMCallHealth()
        self.metrics = ProxyMetrics()  # served at /metrics
        self._token = (proxy_token_from_env() if token is None else token) or None
        if self._token is not None:
            check_bearer_token(self._token, "the LLM proxy's token" if token else "EVENTLIGHT_PROXY_TOKEN")
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
    def token(self) -> str | None:
        """The bearer token requests must carry, ``None`` when none is asked (``Trainer`` hands it to runners)."""
        return self._token

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
        self._model_list = check_model_list(model_list)
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

        The resource never holds the proxy's ``token`` (resources are events: stored, replayed and
        served); a runner with ``proxy_token`` set fills the ``api_key`` of each ``ProxyLLM`` it
        hands an agent.

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
        self._cut = False
        self._body_reads.reopen()
        sock = tcp_listener(self._host)  # Nagle off on every accepted connection
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
            timeout_graceful_shutdown=math.ceil(_SHUTDOWN_TIMEOUT_S + _AFTER_CUT_S),  # after stop()'s own cut
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
        auth = "bearer token required" if self._token else "no token asked"
        log.info("LLMProxy serving on %s (%d model entries; %s)", self.endpoint, len(self._model_list), auth)

    async def stop(self) -> None:
        """Stop serving and wait for spans still being published; idempotent.

        A call arriving from now on answers 503 with OpenAI's error object (``type``
        ``server_stopping``) at once. Calls in flight get up to 5 s to finish. Then those still
        sending their request body, or still waiting for their backend, are cut: each answers 503
        ``server_stopping`` (Anthropic's error object on the Messages route once its body is in), a
        routed one waiting for its backend is recorded as a span with status ``ERROR``
        (``error.type`` ``Cancelled``, ``http.status_code`` 503), and one warning says how many
        waited for their backend. A request still unanswered 5 s later has its connection dropped.
        """
        server, task = self._server, self._serve_task
        self._server, self._serve_task = None, None
        if server is not None and task is not None:
            server.should_exit = True
            self._body_reads.stop()
            done, _ = await asyncio.wait({task}, timeout=_SHUTDOWN_TIMEOUT_S)
            if not done:
                self._body_reads.cut()
                cut = self._cut_forwards()
                if cut:
                    log.warning(
                        "LLMProxy stops: %d call(s) still waiting for their model after %.0f s answer 503 (%s)",
                        cut, _SHUTDOWN_TIMEOUT_S, STOPPING_TYPE,
                    )  # fmt: skip
                done, _ = await asyncio.wait({task}, timeout=_AFTER_CUT_S + 2)
            if not done:
                server.force_exit = True
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            elif not task.cancelled() and task.exception() is not None:  # it crashed earlier: nothing to stop
                log.error("LLMProxy server task ended with an error", exc_info=task.exception())
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
        await check_models(url, self.endpoint, self._model_list, timeout_s, token=self._token)
