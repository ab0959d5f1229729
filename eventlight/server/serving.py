"""``LightningStoreServer``: a store served over HTTP from the running event loop (Agent-lightning 0.3.0's name).

0.3.0's server starts uvicorn in a thread (or processes) and guards its store with a lock.
eventlight's stores belong to the event loop that opened them, so this one serves on that loop:
``await server.start()`` binds ``host:port`` and returns once it accepts connections; every
method of ``LightningStore`` called on the server goes straight to the wrapped store.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from eventlight.net import tcp_listener
from eventlight.server.app import create_app
from eventlight.server.limits import DEFAULT_BODY_MIN_BYTES_PER_S, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from eventlight.store.base import LightningStore, LightningStoreCapabilities

__all__ = ["DEFAULT_PORT", "LightningStoreServer", "PortInUseError"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 4747
"""Agent-lightning's default (``agl store --port 4747``)."""
_STARTUP_TIMEOUT_S = 30.0
_SHUTDOWN_TIMEOUT_S = 5.0
"""Seconds ``stop`` gives requests in flight before uvicorn cancels them."""
_CUT_READS_AFTER_S = 4.0
"""Seconds into ``stop`` when requests still sending their body answer 503 (before uvicorn's cancel)."""


class PortInUseError(OSError):
    """The server's ``host:port`` is taken (another server, or anything else, listens there)."""


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the host process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port`` (no ``SO_REUSEPORT``: a second server cannot share it).

    Raises:
        PortInUseError: The port is taken. OSError: Another reason (a host that is not ours, ...).
    """
    sock = tcp_listener(host)  # Nagle off on every accepted connection
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a listener still blocks
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(e.errno, f"port {port} on {host} is already in use (another server?)") from None
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class LightningStoreServer:
    """Serve ``store`` with Agent-lightning's ``/v1/agl`` routes and OTLP ``/v1/traces``.

    Args:
        store: The store to serve, opened by the caller (``stop()`` leaves it open).
        host: Interface to bind; default ``127.0.0.1`` (``0.0.0.0`` to be reachable from others).
        port: TCP port; default 4747 (0.3.0's).
        token: When set, every request must send ``Authorization: Bearer <token>``.
        max_body_bytes: Ceiling of a request body (413 above it).
        max_buffered_bytes: Ceiling of the request-body bytes held at once (503 with ``Retry-After``
            above it); default 256 MiB, or 4 × ``max_body_bytes`` when larger.
        body_timeout_s: Seconds a request body may go without a byte arriving (408 after; ``None``: no
            timeout, and no minimum rate).
        body_min_bytes_per_s: The least average rate of a request body, in bytes per second, with
            ``body_timeout_s`` of slack (408 after; ``None``: none; default 1 KiB/s).
        identity: What ``/v1/agl/health`` names (default: the store's class).

    Use as ``async with LightningStoreServer(store, port=...) as server:`` or ``start()``/``stop()``.
    """

    def __init__(
        self,
        store: LightningStore,
        host: str | None = None,
        port: int | None = None,
        *,
        token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_buffered_bytes: int | None = None,
        body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
        body_min_bytes_per_s: float | None = DEFAULT_BODY_MIN_BYTES_PER_S,
        identity: dict[str, Any] | None = None,
    ):
        self.store = store
        self.host = host or "127.0.0.1"
        self.port = DEFAULT_PORT if port is None else int(port)
        self.app = create_app(
            store,
            identity=identity,
            token=token,
            max_body_bytes=max_body_bytes,
            max_buffered_bytes=max_buffered_bytes,
            body_timeout_s=body_timeout_s,
            body_min_bytes_per_s=body_min_bytes_per_s,
        )
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        """The wrapped store's, with ``otlp_traces``: this server takes OTLP/HTTP traces."""
        return {**self.store.capabilities, "otlp_traces": True}

    @property
    def endpoint(self) -> str:
        """``http://host:port`` (the address clients use; ``127.0.0.1`` when bound to every interface)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def otlp_traces_endpoint(self) -> str:
        """``<endpoint>/v1/traces``."""
        return f"{self.endpoint}/v1/traces"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)  # every LightningStore method, straight to the store

    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self._server is not None and self._server.started

    async def start(self) -> None:
        """Bind and serve on the running loop; returns once connections are accepted. Idempotent.

        Raises:
            PortInUseError: The port is taken (at once: a second server on it never starts).
            RuntimeError: The server did not come up within 30 s.
        """
        if self.is_running():
            return
        sock = bind(self.host, self.port)
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(_SHUTDOWN_TIMEOUT_S),
        )
        server = _EmbeddedServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"eventlight-serve:{self.port}")
        self._server, self._task = server, task
        self.app.state.body_reads.reopen()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not server.started:
            if task.done():
                self._server, self._task = None, None
                failure = task.exception() if not task.cancelled() else None
                raise RuntimeError(f"the store server exited during startup: {failure!r}") from failure
            if time.monotonic() > deadline:
                await self.stop()
                raise RuntimeError(f"the store server did not start within {_STARTUP_TIMEOUT_S} s")
            await asyncio.sleep(0.01)
        log.info("store server on %s (%s)", self.endpoint, type(self.store).__name__)

    async def run_forever(self) -> None:
        """``start()``, then serve until cancelled (or the server stops), then ``stop()``."""
        await self.start()
        try:
            assert self._task is not None
            await asyncio.shield(self._task)
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop serving; idempotent. The store stays open.

        A request arriving from now on answers 503 (``ServiceUnavailableError``, retryable); requests
        in flight get 5 s, and those still sending their body after 4 s answer the same 503 (not
        uvicorn's cancel with a traceback a second later).
        """
        server, task = self._server, self._task
        self._server, self._task = None, None
        if server is None or task is None:
            return
        server.should_exit = True
        reads = self.app.state.body_reads
        reads.stop()
        done, _ = await asyncio.wait({task}, timeout=_CUT_READS_AFTER_S)
        if not done:
            reads.cut()
            done, _ = await asyncio.wait({task}, timeout=_SHUTDOWN_TIMEOUT_S + 2 - _CUT_READS_AFTER_S)
        if done:
            task.result()  # the server's own failure, raised here as before
            return
        server.force_exit = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    async def __aenter__(self) -> LightningStoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
