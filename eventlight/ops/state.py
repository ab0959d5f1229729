"""Where the embedded servers keep their state, and the record of what runs (``services.json``).

Layout of ``settings.state_dir`` (every path is the project's own; nothing else is touched)::

    services.json        URLs/DSNs and pids of what runs, for other processes (``read_services``);
                         mode 600: a configured DSN's password may be in it
    services.lock        held while ``ensure_services`` runs (``prepare_services``: until the
                         namespace is applied), and while leases are taken, given up or counted,
                         so two processes do not race
    leases/, stop_when_unused.json  who uses the servers now, and which ones stop when no one
                         does (``eventlight.ops.leases``)
    nats/nats.conf       generated config: 127.0.0.1:<port>, JetStream with sync_interval always
    nats/port            the port picked the first time and reused after
    nats/nats.pid        written by nats-server; ``stop_services`` signals only this pid
    nats/nats.log        server log; its tail goes into errors
    nats/nats.out        stdout/stderr of nats-server (config errors before the log opens)
    nats/js/             JetStream store
    pg/data/             system-binary cluster (initdb + pg_ctl); postmaster.pid inside
    pg/port              the port picked the first time and reused after
    pg/server.log        server log; pg/ is also the unix socket folder (none when its path is too
                         long or holds a quote, a backslash or a comma: TCP only)
    pg/data/eventlight.conf  listen/port/socket/fsync/max_connections/shared_buffers, included
                         from postgresql.conf; binaries follow the data's PG_VERSION
    pg-pgserver/         the cluster of the ``pgserver`` fallback (unix socket only)

Postgres refuses to run as root: as root the system binaries run as ``postgres`` through
``runuser``, so every folder above ``state_dir`` must be enterable by that user.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.ops.procs import pid_running
from eventlight.settings import Settings

LOCK_TIMEOUT_S = 120.0


class Services(msgspec.Struct, frozen=True):
    """Where the servers are.

    Attributes:
        nats_url: URL of the NATS server to connect to.
        pg_dsn: Postgres DSN asyncpg accepts (TCP, or a unix socket for pgserver).
        started: Servers this call started, e.g. ``"nats-server pid 123"``; empty when every
            server was already running or external (and always empty from ``read_services``).
        nats_pid: Pid of the embedded nats-server, ``None`` when external.
        pg_pid: Pid of the embedded postmaster, ``None`` when external.
        pg_kind: ``"system"``, ``"pgserver"`` or ``"external"``.
    """

    nats_url: str
    pg_dsn: str
    started: list[str] = msgspec.field(default_factory=list)
    nats_pid: int | None = None
    pg_pid: int | None = None
    pg_kind: str = "external"


class PgServer(msgspec.Struct, frozen=True):
    """The Postgres in use: its DSN, the embedded postmaster's pid, its kind, started by this call."""

    dsn: str
    pid: int | None
    kind: str
    started: bool


# ---------------------------------------------------------------------------------------------
# public API: services


def read_services(settings: Settings) -> Services | None:
    """Read ``<state_dir>/services.json`` written by ``ensure_services``.

    Args:
        settings: Gives the state folder.

    Returns:
        The recorded services (``started`` empty), or ``None`` when there is no file, it is
        unreadable, or an embedded server it names is no longer running.
    """
    services = read_record(settings)
    if services is None or not all(pid_running(pid, "") for pid in embedded_pids(services)):
        return None
    return services


def read_record(settings: Settings) -> Services | None:
    """``<state_dir>/services.json`` as written (``started`` empty), whether or not the servers it
    names still run; ``None`` when there is no file or it is unreadable."""
    return record_at(Path(settings.state_dir))


def record_at(state: Path) -> Services | None:
    """``read_record`` of the state folder ``state``."""
    path = state / "services.json"
    try:
        services = msgspec.json.decode(path.read_bytes(), type=Services)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return msgspec.structs.replace(services, started=[])


def embedded_pids(services: Services) -> list[int]:
    """The pids of the embedded servers ``services`` names (none for external ones)."""
    return [pid for pid in (services.nats_pid, services.pg_pid) if pid is not None]


def existing_state_dir(settings: Settings) -> Path | None:
    state = Path(settings.state_dir).absolute()
    return state if state.is_dir() else None


def state_dir(settings: Settings) -> Path:
    """``settings.state_dir``, created if missing.

    Raises:
        InvalidInputError: It is a file, or it cannot be created or written.
    """
    state = Path(settings.state_dir).absolute()
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "it is a file, not a folder" if state.exists() else e.strerror
        raise InvalidInputError(f"cannot use {state} as the state folder (EVENTLIGHT_STATE_DIR): {why}") from None
    return state


@contextlib.asynccontextmanager
async def state_lock(state: Path) -> AsyncIterator[None]:
    """Hold an exclusive flock on ``<state>/services.lock`` (polled; up to 120 s)."""
    with _open_lock_file(state) as f:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServiceUnavailableError(str(state), "services.lock held too long") from None
                await asyncio.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _open_lock_file(state: Path) -> Any:
    try:
        return open(state / "services.lock", "a+b")  # closed by the caller's `with`
    except OSError as e:
        raise InvalidInputError(
            f"cannot use {state} as the state folder (EVENTLIGHT_STATE_DIR): {e.strerror} ({e.filename})"
        ) from None


def write_services_file(state: Path, services: Services) -> None:
    """Write ``services.json`` readable by its owner only: beside the embedded servers it records a
    configured server's URL or DSN (``_record``), password included."""
    tmp = state / f"services.json.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of a killed writer would keep its mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(services)))
    tmp.replace(state / "services.json")


# ---------------------------------------------------------------------------------------------
# processes and ports
