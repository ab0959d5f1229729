"""The embedded Postgres from the ``pgserver`` wheel, when no system binaries are usable (unix socket only)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

from eventlight.core.errors import ServiceUnavailableError
from eventlight.ops.pg_system import PG_SETTINGS, blocked_dir, postmaster, wait_pg_ready
from eventlight.ops.postgres import PG_PROBE_TIMEOUT_S, import_pgserver
from eventlight.ops.procs import log_tail, wait_exit
from eventlight.ops.state import PgServer
from eventlight.store.jetstream import pg_errors

_log = logging.getLogger(__name__)

_START_WAIT_S = 60.0
"""Seconds an interrupted start waits for pgserver's thread (initdb, then ``pg_ctl`` with its 10 s)."""


def _socket_dsn(port: int, sock: str) -> str:
    return f"postgresql://postgres@/postgres?host={sock}&port={port}"


async def ensure_pgserver(state: Path) -> PgServer:
    data = state / "pg-pgserver"
    running = postmaster(data)
    if running:
        dsn = _socket_dsn(running[1], running[2])
        await wait_pg_ready(dsn, data / "log")
        return PgServer(dsn, running[0], "pgserver", False)
    pid, dsn = await _start_pgserver(data)
    if await _alter_system(dsn):  # first start: max_connections/shared_buffers need a restart
        await stop_pgserver(state)
        pid, dsn = await _start_pgserver(data)
    _log.info("started pgserver postgres pid %d on %s", pid, dsn)
    return PgServer(dsn, pid, "pgserver", True)


async def _start_pgserver(data: Path) -> tuple[int, str]:
    """Start pgserver's cluster in ``data`` (initdb the first time).

    Returns:
        The postmaster pid and its unix-socket DSN.

    Raises:
        ServiceUnavailableError: pgserver failed or postgres did not come up, or (as root) a
            folder above ``data`` is closed to others, which pgserver would make world-readable.
    """
    _refuse_pgserver_chmod(data)
    pgserver = import_pgserver()
    _forget_pgserver_handle(pgserver, data)
    try:
        await _get_server(pgserver, data)
    except Exception as e:
        raise ServiceUnavailableError("pgserver", f"{type(e).__name__}: {e}; {log_tail(data / 'log')}") from e
    running = postmaster(data)
    if not running:
        raise ServiceUnavailableError("pgserver", f"postgres is not running; log:\n{log_tail(data / 'log')}")
    dsn = _socket_dsn(running[1], running[2])
    await wait_pg_ready(dsn, data / "log")
    return running[0], dsn


async def _get_server(pgserver: Any, data: Path) -> None:
    """``pgserver.get_server`` (initdb, ``pg_ctl -w start``) on a thread, which no cancel can stop.

    Cancelled (Ctrl+C), it still waits for the thread to end, up to ``_START_WAIT_S``, before it
    gives up: the postmaster the thread started is then there for the caller's clean-up to stop, not
    left to come up after it (and asyncio's own shutdown no longer waits for the thread).
    """
    start = asyncio.ensure_future(asyncio.to_thread(pgserver.get_server, data, cleanup_mode=None))
    try:
        await asyncio.shield(start)
    except asyncio.CancelledError:
        _log.info("interrupted: waiting for pgserver's start of postgres in %s to end, to stop it again", data)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(start, _START_WAIT_S)
        raise


def _refuse_pgserver_chmod(data: Path) -> None:
    """As root, pgserver chmods every folder above its data o+rx (``/root`` too): refuse that."""
    blocked = blocked_dir(data.parent, -1, set()) if os.geteuid() == 0 else None
    if blocked:
        raise ServiceUnavailableError(
            "pgserver",
            f"as root, pgserver would make {blocked} world-readable; put EVENTLIGHT_STATE_DIR "
            "elsewhere (e.g. /var/tmp/eventlight), `apt-get install postgresql`, or set EVENTLIGHT_PG_DSN",
        )


def _forget_pgserver_handle(pgserver: Any, data: Path) -> None:
    """get_server caches one handle per folder and process, even after its server stopped."""
    pgserver.PostgresServer._instances.pop(data.resolve(), None)


async def _alter_system(dsn: str) -> bool:
    """``ALTER SYSTEM SET`` the embedded settings; return whether a restart is needed for them."""
    conn = await pg_errors.connect(dsn, timeout_s=PG_PROBE_TIMEOUT_S)
    try:
        for name, value in PG_SETTINGS.items():
            await conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        await conn.execute("SELECT pg_reload_conf()")
        await asyncio.sleep(0.1)  # the reload is asynchronous
        return bool(await conn.fetchval("SELECT count(*) FROM pg_settings WHERE pending_restart"))
    finally:
        await conn.close()


async def stop_pgserver(state: Path, only_pid: int | None = None) -> str | None:
    """Fast shutdown (SIGINT, what ``pg_ctl stop -m fast`` sends) of the pgserver postmaster; with
    ``only_pid``, only when that is its pid.

    Raises:
        ServiceUnavailableError: It did not stop in 30 s.
    """
    running = postmaster(state / "pg-pgserver")
    if not running or (only_pid is not None and running[0] != only_pid):
        return None
    os.kill(running[0], signal.SIGINT)
    if not await wait_exit(running[0], 30.0):
        raise ServiceUnavailableError("pgserver", f"postgres pid {running[0]} did not stop in 30 s")
    return f"postgres pid {running[0]}"
