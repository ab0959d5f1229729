"""Start, reuse and stop the servers eventlight needs (``eventlight up`` / ``down``, a ``Trainer``'s run).

Who stops the embedded servers: ``eventlight down`` (``stop_services``), at once, whoever uses them.
Otherwise the servers ``use_services`` started (a ``Trainer``'s run) are stopped when the last
process holding a lease on them gives it up (``eventlight.ops.leases``): that run, another run,
``eventlight runner`` or ``eventlight serve``. ``eventlight up`` (``prepare_services``,
``ensure_services``) takes none: the servers it starts or reuses run until ``eventlight down``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.net import redact, redact_configured
from eventlight.ops.leases import Lease, clear_marks, live_leases, mark, marked, take_lease, unmark
from eventlight.ops.nats_server import ensure_nats, stop_nats
from eventlight.ops.pg_pgserver import ensure_pgserver, stop_pgserver
from eventlight.ops.pg_system import ensure_system_pg, postmaster, stop_system_pg
from eventlight.ops.postgres import BUSY_NOW, REFUSED, UNUSABLE, choose_pg_kind, pg_probe
from eventlight.ops.procs import pid_running, read_pid
from eventlight.ops.schema import apply_migrations
from eventlight.ops.state import (
    PgServer,
    Services,
    embedded_pids,
    existing_state_dir,
    read_services,
    record_at,
    state_dir,
    state_lock,
    write_services_file,
)
from eventlight.ops.streams import apply_streams
from eventlight.settings import Settings
from eventlight.store.jetstream.connect import connect_nats

_log = logging.getLogger(__name__)


async def ensure_services(settings: Settings) -> Services:
    """Use the configured servers, or start (or reuse) the embedded ones.

    NATS: ``settings.nats_url`` must answer within 2 s; without it nats-server from the venv
    runs under ``<state_dir>/nats``. Postgres: ``settings.pg_dsn`` when it answers within 3 s
    (when nothing answers, a warning and the embedded one; when it refuses the role, password or
    database, or the DSN cannot be used as it is, an error, before NATS is started); the embedded
    one uses the system binaries, else ``pgserver``. Servers left running by an earlier call are
    reused, on the same ports and data. If a later step fails, the servers this call started are
    stopped again; so is an embedded server it was starting when it is interrupted (Ctrl-C:
    ``CancelledError`` or ``KeyboardInterrupt``). The embedded servers it starts or reuses run
    until ``stop_services`` (``eventlight down``), even those a ``use_services`` holder (a
    ``Trainer``'s run) started.

    Args:
        settings: Service URLs and the state folder.

    Returns:
        Where the servers are; ``started`` lists those this call started.

    Raises:
        ServiceUnavailableError: A configured NATS URL does not answer, or an embedded server
            cannot be found or does not become ready (10 s for NATS, 60 s for Postgres).
        InvalidInputError: The configured Postgres refused the role, password, database or a DSN
            setting, or the DSN cannot be used (``sslmode=verify-full`` without a root certificate):
            no server is started then; the embedded NATS runs at another durability level than ``settings.durability``.
    """
    state = state_dir(settings)
    async with state_lock(state):
        services = await _start_or_reuse(settings, state)
        _write_record(settings, state, services)
        unmark(state, set(embedded_pids(services)))
    return services


async def _start_or_reuse(settings: Settings, state: Path) -> Services:
    """``ensure_services`` without the lock, which the caller holds, and without the record. A
    configured Postgres is probed first, so a DSN it refuses starts no server (``configured_pg``)."""
    configured = await configured_pg(settings, state)
    nats_ran = embedded_nats_running(state)
    try:
        nats_url, nats_pid, nats_started = await ensure_nats(settings, state)
    except (asyncio.CancelledError, KeyboardInterrupt):
        if not nats_ran:  # interrupted while the nats-server it started became ready: stop it
            with contextlib.suppress(Exception):
                await stop_nats(state)
        raise
    pg_ran = embedded_pg_running(state)
    try:
        pg = configured if configured is not None else await ensure_pg(state)
    except BaseException as e:
        if not pg_ran and isinstance(e, asyncio.CancelledError | KeyboardInterrupt):
            # interrupted (Ctrl-C) while it started the embedded Postgres: stop the one it started
            with contextlib.suppress(Exception):
                await stop_system_pg(state)
            with contextlib.suppress(Exception):
                await stop_pgserver(state)
        if nats_started:
            await stop_nats(state)
        raise
    started = [f"nats-server pid {nats_pid}"] if nats_started else []
    started += [f"postgres pid {pg.pid}"] if pg.started else []
    return Services(nats_url, pg.dsn, started, nats_pid, pg.pid, pg.kind)


def _started(services: Services) -> dict[str, int]:
    """The servers ``services.started`` names, by name to pid (as ``leases.marked``)."""
    pids = {"nats-server": services.nats_pid, "postgres": services.pg_pid}
    return {name: pid for name, pid in pids.items() if pid is not None and f"{name} pid {pid}" in services.started}


async def _stop_these(state: Path, servers: dict[str, int]) -> list[str]:
    """Stop the embedded servers ``servers`` names (name to pid), and only while they have that pid
    (the caller holds the lock). Returns what was stopped."""
    stopped = []
    if (pid := servers.get("nats-server")) is not None:
        stopped.append(await stop_nats(state, only_pid=pid))
    if (pid := servers.get("postgres")) is not None:
        stopped += [await stop_system_pg(state, only_pid=pid), await stop_pgserver(state, only_pid=pid)]
    return [s for s in stopped if s]


def embedded_nats_running(state: Path) -> bool:
    """Whether the embedded nats-server runs from ``state`` (its pid file's process, on its config)."""
    pid = read_pid(state / "nats" / "nats.pid")
    return pid is not None and pid_running(pid, str(state / "nats" / "nats.conf"))


def embedded_pg_running(state: Path) -> bool:
    """Whether an embedded Postgres (system binaries or pgserver) runs from ``state``."""
    return postmaster(state / "pg" / "data") is not None or postmaster(state / "pg-pgserver") is not None


def unrecorded_servers(settings: Settings) -> list[str]:
    """The embedded servers that run from ``settings.state_dir`` (by their pid files, as ``stop_services``
    finds them) while ``services.json`` names none that runs: those of an ``up`` killed (``kill -9``,
    an out-of-memory kill) before it finished, which is when it writes the record.

    Returns:
        E.g. ``["nats-server pid 123", "postgres pid 456"]``; ``[]`` when none runs or the record
        names a running one.
    """
    state = existing_state_dir(settings)
    if state is None or read_services(settings) is not None:
        return []
    found = [f"nats-server pid {read_pid(state / 'nats' / 'nats.pid')}"] if embedded_nats_running(state) else []
    for data in (state / "pg" / "data", state / "pg-pgserver"):
        if (running := postmaster(data)) is not None:
            found.append(f"postgres pid {running[0]}")
    return found


def _write_record(settings: Settings, state: Path, services: Services) -> None:
    if services.nats_pid is not None or services.pg_pid is not None:
        # only embedded servers are recorded: a program run against external (or configured)
        # servers must not overwrite the record `eventlight down` and `status` rely on
        write_services_file(state, _record(services, read_services(settings)))


def _record(services: Services, old: Services | None) -> Services:
    """What ``services.json`` keeps: the embedded servers. A server this call took from the
    environment (``EVENTLIGHT_PG_DSN`` beside the embedded NATS, or the reverse) leaves the record's
    embedded one of that kind in place while it still runs, so commands without the variable keep
    finding the embedded data (an ``up`` with the variable set used to point them at the external
    server)."""
    if old is None:
        return services
    if services.nats_pid is None and old.nats_pid is not None:
        services = msgspec.structs.replace(services, nats_url=old.nats_url, nats_pid=old.nats_pid)
    if services.pg_pid is None and old.pg_pid is not None:
        services = msgspec.structs.replace(services, pg_dsn=old.pg_dsn, pg_pid=old.pg_pid, pg_kind=old.pg_kind)
    return services


async def prepare_services(settings: Settings) -> Services:
    """Find or start NATS and Postgres (``ensure_services``), then apply the namespace's streams and tables.

    What a program needs before it opens a ``JetStreamLightningStore`` on a namespace, new or not::

        settings = Settings.from_env(namespace="scratch")
        services = await prepare_services(settings)
        async with JetStreamLightningStore(settings, nats_url=services.nats_url, pg_dsn=services.pg_dsn) as store:
            ...

    Both steps are idempotent. If applying fails, the servers this call started are stopped again,
    and only those. The state folder's lock is held until the namespace is applied and
    ``services.json`` is written after it, so no other ``up`` (which waits for the lock) and no
    ``status`` or ``runner`` (which read ``services.json``) can have been handed them by then.

    The embedded servers it starts or reuses run until ``stop_services`` (``eventlight down``); a
    program that should leave nothing running behind it uses ``use_services`` instead.

    Args:
        settings: Namespace, service URLs and the state folder.

    Returns:
        Where the servers are (``started`` lists those this call started).

    Raises:
        ServiceUnavailableError: A server cannot be started or reached.
        InvalidInputError: The configured Postgres refused the role, password, database or a DSN setting.
    """
    services, _ = await _prepare(settings, None)
    return services


async def _prepare(settings: Settings, lease_for: str | None) -> tuple[Services, Lease | None]:
    """``prepare_services``; with ``lease_for``, also a lease for it, taken under the same lock."""
    state = state_dir(settings)
    async with state_lock(state):
        services = await _start_or_reuse(settings, state)
        try:
            await _apply_namespace(settings, services)
        except BaseException:
            with contextlib.suppress(Exception):  # do not leave half a setup running
                await _stop_these(state, _started(services))
            raise
        _write_record(settings, state, services)
        if lease_for is None:
            unmark(state, set(embedded_pids(services)))
            return services, None
        mark(state, _started(services))
        return services, take_lease(state, lease_for)


@contextlib.asynccontextmanager
async def use_services(settings: Settings, *, what: str = "use_services") -> AsyncIterator[Services]:
    """``prepare_services`` for the length of an ``async with`` block, leaving nothing running after it
    that it started, unless someone else still uses it::

        async with use_services(Settings.from_env(namespace="scratch")) as services:
            async with JetStreamLightningStore(settings, nats_url=services.nats_url, pg_dsn=services.pg_dsn) as store:
                ...

    The block holds a lease on the state folder's embedded servers (``eventlight.ops.leases``). At
    its end, the servers it started are stopped unless another process or block holds a lease (a
    ``Trainer``'s run, ``eventlight runner``, ``eventlight serve``: the last of them stops them), or
    ``eventlight up`` / ``prepare_services`` / ``ensure_services`` used them since (they then run
    until ``eventlight down``). A process that ends without leaving the block (``kill -9``) holds no
    lease after. What a ``Trainer`` does for its run unless ``keep_services``.

    Args:
        settings: Namespace, service URLs and the state folder.
        what: Who holds the lease, for messages (``"Trainer"``).

    Yields:
        Where the servers are (``started`` lists those this call started).

    Raises:
        ServiceUnavailableError: A server cannot be started or reached.
        InvalidInputError: The configured Postgres refused the role, password or database.
    """
    services, lease = await _prepare(settings, what)
    assert lease is not None
    try:
        yield services
    finally:
        await _release_quietly(lease)


async def lease_services(settings: Settings, what: str) -> Lease | None:
    """Hold a lease on whatever embedded servers the state folder runs; starts none.

    For processes that use the servers ``eventlight up`` or a ``Trainer`` started, for as long as
    they run (``eventlight runner``, ``eventlight serve``): take it before looking for the servers,
    and give it up with ``release_services``.

    Args:
        settings: Gives the state folder.
        what: Who holds it, for messages (``"eventlight runner"``).

    Returns:
        The lease; ``None`` when the state folder does not exist (no embedded server runs).

    Raises:
        ServiceUnavailableError: The state folder's lock was held for more than 120 s.
        InvalidInputError: This user cannot write the state folder.
    """
    state = existing_state_dir(settings)
    if state is None:
        return None
    async with state_lock(state):
        return take_lease(state, what)


async def release_services(lease: Lease | None) -> list[str]:
    """Give ``lease`` up; then, if no one else holds one, stop the servers lease holders started.

    Args:
        lease: From ``lease_services`` (``None``: nothing to do); calling it again does nothing.

    Returns:
        What was stopped, e.g. ``["nats-server pid 123"]``.

    Raises:
        ServiceUnavailableError: The state folder's lock was held for more than 120 s, or
            ``pg_ctl stop`` failed. The lease is given up all the same.
    """
    if lease is None or lease.closed:
        return []
    try:
        async with state_lock(lease.state):
            lease.close()
            return await _stop_unused(lease.state)
    finally:
        lease.close()


async def _release_quietly(lease: Lease) -> None:
    """``release_services``, which logs its failure rather than hide the block's own outcome."""
    try:
        stopped = await release_services(lease)
    except Exception as e:
        _log.warning("could not stop the servers this run started (%s); `eventlight down` stops them", e)
        return
    if stopped:
        _log.info("stopped %s (no one else uses them)", ", ".join(stopped))


async def _stop_unused(state: Path) -> list[str]:
    """Stop the marked servers unless a lease is held (the caller holds the lock)."""
    servers = marked(state)
    if not servers:
        return []
    holders = live_leases(state)
    if holders:
        named = ", ".join(f"{name} pid {pid}" for name, pid in servers.items())
        _log.info("leaving %s running: %s still use(s) them", named, ", ".join(holders))
        return []
    stopped = await _stop_these(state, servers)
    clear_marks(state)
    record = record_at(state)
    if record is not None and not any(pid_running(pid, "") for pid in embedded_pids(record)):
        (state / "services.json").unlink(missing_ok=True)
    return stopped


async def _apply_namespace(settings: Settings, services: Services) -> None:
    nc = await connect_nats(services.nats_url, auth=settings.nats_auth)
    try:
        await apply_streams(nc, settings)
    finally:
        await nc.close()
    await apply_migrations(services.pg_dsn, settings.pg_schema, open_wait_s=settings.pg_open_wait_s)


async def stop_services(settings: Settings) -> list[str]:
    """Stop the embedded servers this project started in ``settings.state_dir`` (``eventlight down``).

    Only pids from the state folder's pid files whose command line names that folder are
    signalled, so a system NATS or Postgres is never touched. Calling it again does nothing. It
    stops them even while processes hold leases on them (``use_services``, a ``Trainer``'s run,
    ``eventlight runner``, ``eventlight serve``), with a warning naming those processes.

    Args:
        settings: Gives the state folder.

    Returns:
        What was stopped, e.g. ``["nats-server pid 123", "postgres pid 456"]``.

    Raises:
        ServiceUnavailableError: ``pg_ctl stop`` failed.
    """
    state = existing_state_dir(settings)
    if state is None:
        return []
    async with state_lock(state):
        holders = live_leases(state)
        stopped = [await stop_nats(state), await stop_system_pg(state), await stop_pgserver(state)]
        clear_marks(state)
        with contextlib.suppress(FileNotFoundError):
            (state / "services.json").unlink()
    stopped_names = [s for s in stopped if s]
    if holders and stopped_names:
        _log.warning("stopped %s while %s still used them", ", ".join(stopped_names), ", ".join(holders))
    return stopped_names


async def configured_pg(settings: Settings, state: Path) -> PgServer | None:
    """``settings.pg_dsn`` when it answers (also when it answers that it takes no connection now,
    "too many clients": ``apply_migrations`` and the store then wait for one, ``Settings.pg_open_wait_s``);
    ``None`` when none is set, or when nothing answers there (with a warning: the embedded one is used).

    Raises:
        InvalidInputError: The configured server answered but refused the role, password,
            database, or a setting the DSN asks for (``options``, ``sslmode``), or the DSN cannot be
            used as it is (``sslmode=verify-full`` and no root certificate): the data must not land
            in another server (the DSN redacted).
    """
    if not settings.pg_dsn:
        return None
    why = await pg_probe(settings.pg_dsn)
    if why is None or why.startswith(BUSY_NOW):  # busy: it is there; what connects next waits for room
        return PgServer(settings.pg_dsn, None, "external", False)
    if why.startswith((REFUSED, UNUSABLE)):
        raise InvalidInputError(
            redact_configured(
                settings.pg_dsn,
                f"EVENTLIGHT_PG_DSN {settings.pg_dsn}: Postgres {why}; fix the DSN, "
                "or unset EVENTLIGHT_PG_DSN to use the embedded Postgres",
            )
        )
    _log.warning("EVENTLIGHT_PG_DSN %s %s; using the embedded Postgres in %s", redact(settings.pg_dsn), why, state)
    return None


async def ensure_pg(state: Path) -> PgServer:
    """The embedded Postgres of ``state``, started or reused: system binaries, else ``pgserver``.

    Raises:
        ServiceUnavailableError: The embedded server cannot be found or started.
    """
    kind = choose_pg_kind(state)
    if kind == "system":
        return await ensure_system_pg(state)
    return await ensure_pgserver(state)
