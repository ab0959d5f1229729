"""``eventlight serve``: the store over HTTP (Agent-lightning's ``/v1/agl`` routes, OTLP ``/v1/traces``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import uuid
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.markup import escape

from eventlight.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_UNAVAILABLE,
    CliError,
    NamespaceOpt,
    _lease,
    _release,
    console,
)
from eventlight.cli.discovery import _need_nats, _need_pg, _no_namespace
from eventlight.cli.status import _stream_state
from eventlight.settings import Settings


class Backend(StrEnum):
    jetstream = "jetstream"
    memory = "memory"


def _check_port(host: str, port: int) -> None:
    """Fail at once when ``host:port`` is taken (before connecting to anything)."""
    from eventlight.server.serving import PortInUseError, bind

    try:
        bind(host, port).close()
    except PortInUseError as e:
        raise CliError(f"{e.strerror}: choose another with --port", EXIT_UNAVAILABLE) from None
    except OSError as e:
        raise CliError(str(e.strerror or e)) from None


async def _open_store(settings: Settings, backend: Backend) -> Any:
    from eventlight.store.jetstream import JetStreamLightningStore
    from eventlight.store.memory import InMemoryLightningStore

    if backend is Backend.memory:
        return await InMemoryLightningStore().__aenter__()
    nats = await _need_nats(settings)
    if await _stream_state(nats.url, settings) is None:
        raise _no_namespace(settings, f"no stream {settings.stream_name}")
    pg = await _need_pg(settings)
    return await JetStreamLightningStore(settings, nats_url=nats.url, pg_dsn=pg.url).start()


async def _serve(
    settings: Settings, backend: Backend, host: str, port: int, token: str | None, limits: dict[str, Any]
) -> int:
    """Serve until SIGTERM, holding a lease on the embedded servers meanwhile (no trainer's run stops
    them under it; the last to give one up stops the servers a run started)."""
    lease = await _lease(settings, "eventlight serve") if backend is Backend.jetstream else None
    try:
        return await _serve_store(settings, backend, host, port, token, limits)
    finally:
        await _release(lease)


async def _serve_store(
    settings: Settings, backend: Backend, host: str, port: int, token: str | None, limits: dict[str, Any]
) -> int:
    """Serve ``backend`` until SIGTERM; ``limits``: ``LightningStoreServer``'s body limits by name."""
    from eventlight.server.serving import LightningStoreServer

    store = await _open_store(settings, backend)
    identity = {
        "instance": f"srv-{uuid.uuid4().hex[:8]}",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "port": port,
        "namespace": settings.namespace,
        "store": type(store).__name__,
    }
    server = LightningStoreServer(store, host, port, token=token, identity=identity, **limits)
    stop = asyncio.Event()
    code = 0

    def _on_term() -> None:
        nonlocal code
        code = EXIT_TERMINATED
        stop.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, _on_term)
    try:
        await server.start()
        auth = "bearer token required" if token else "no token (anyone who can connect may write)"
        bound = f" (listening on {host}:{port})" if host in ("0.0.0.0", "", "::") else ""
        console.print(
            f"serving {escape(type(store).__name__)} of namespace {settings.namespace} on {server.endpoint}"
            f"{bound} ({identity['instance']}; {auth}); OpenAPI at {server.endpoint}/docs; Ctrl+C to stop"
        )
        if not token and host not in ("127.0.0.1", "localhost", "::1"):
            console.print(
                f"warning: {host} is reachable from other machines and no token is set: anyone who can "
                "connect may read and write this store (set --token or $EVENTLIGHT_SERVER_TOKEN)"
            )
        await stop.wait()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        with contextlib.suppress(Exception):
            await server.stop()
        await store.close()
    return code


def _positive(value: float) -> float:
    """A click callback: the value must be a positive, finite number (checked here rather than by a
    range, whose ``[x>=0.001]`` label would squeeze the help's description column)."""
    if not value > 0 or value == float("inf"):
        raise typer.BadParameter(f"{value} is not a positive, finite number")
    return value


def _positive_or_zero(value: float) -> float:
    """A click callback: the value must be 0 or a positive, finite number (as ``_positive``)."""
    return value if value == 0 else _positive(value)


def serve(
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0: every interface; then set --token).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port (Agent-lightning's default).")] = 4747,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="EVENTLIGHT_SERVER_TOKEN",
            show_envvar=True,
            help="Require 'Authorization: Bearer <token>' on every request (or give it in a file: see above).",
        ),
    ] = None,
    backend: Annotated[
        Backend, typer.Option(help="jetstream: the namespace on NATS + Postgres; memory: a store in this process.")
    ] = Backend.jetstream,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Largest request body (413 above).")] = 16 * 1024 * 1024,
    max_buffered_bytes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Most request-body bytes held by all requests at once (503 with Retry-After above); "
            "default 256 MiB, or 4 x --max-body-bytes when larger.",
        ),
    ] = None,
    body_timeout_s: Annotated[
        float,
        typer.Option(
            callback=_positive, help="Seconds (> 0) a request body may go without a byte arriving (408 after)."
        ),
    ] = 30.0,
    body_min_bytes_per_s: Annotated[
        float,
        typer.Option(
            "--body-min-rate",
            callback=_positive_or_zero,
            help="Least average rate of a request body, in bytes/s, with --body-timeout-s of slack "
            "(408 when further behind); 0: no minimum rate (only --body-timeout-s between bytes).",
        ),
    ] = 1024.0,
    namespace: NamespaceOpt = None,
) -> None:
    """Serve the namespace's store over HTTP: Agent-lightning 0.3.0's /v1/agl routes (its
    LightningStoreClient works against it), OTLP/HTTP traces at /v1/traces, OpenAPI at /docs.

    Writes through it are events on the namespace's stream like any other. Uses
    $EVENTLIGHT_NATS_URL / $EVENTLIGHT_PG_DSN, else the servers `eventlight up` or a trainer
    started; never starts them, and no trainer's run stops them while it serves (when it is the
    last to use the servers a run started, it stops them as it ends). A port that is taken fails
    at once (exit 1).

    The token of --token may instead be in $EVENTLIGHT_SERVER_TOKEN, or in a file that
    $EVENTLIGHT_SERVER_TOKEN_FILE names."""
    from eventlight.cli.common import _settings

    if token is not None:
        blank = not token.strip()
    else:  # Click drops an empty $EVENTLIGHT_SERVER_TOKEN; an empty one with a token file is fine
        given = [os.environ[v] for v in ("EVENTLIGHT_SERVER_TOKEN", "EVENTLIGHT_SERVER_TOKEN_FILE") if v in os.environ]
        blank = bool(given) and not any(g.strip() for g in given)
    if blank:  # `--token "$UNSET"` must not open the store to anyone
        raise CliError(
            "the token is empty (--token, $EVENTLIGHT_SERVER_TOKEN or $EVENTLIGHT_SERVER_TOKEN_FILE): give one,"
            " or leave them all out to serve without one"
        )
    settings = _settings(namespace)
    _check_port(host, port)
    token = token or settings.server_token
    limits = {
        "max_body_bytes": max_body_bytes,
        "max_buffered_bytes": max_buffered_bytes,
        "body_timeout_s": body_timeout_s,
        "body_min_bytes_per_s": body_min_bytes_per_s or None,  # 0: none (BodyLimit's None)
    }
    if max_buffered_bytes is not None and max_buffered_bytes < max_body_bytes:
        raise CliError(
            f"--max-buffered-bytes ({max_buffered_bytes}) must be at least --max-body-bytes ({max_body_bytes})"
        )
    try:
        code = asyncio.run(_serve(settings, backend, host, port, token, limits))
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except OSError as e:  # the port was taken between the check and the start
        raise CliError(str(e.strerror or e), EXIT_UNAVAILABLE) from None
    if code:
        raise typer.Exit(code)
