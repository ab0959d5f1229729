"""The embedded Postgres from the system binaries: initdb, pg_ctl, run as ``postgres`` when root."""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import shutil
import stat
import time
from pathlib import Path
from urllib.parse import quote

from eventlight.core.errors import ServiceUnavailableError
from eventlight.net import redact
from eventlight.ops.postgres import PG_INSTALL_HINT, pg_probe, system_bindir
from eventlight.ops.procs import (
    PG_CTL_TIMEOUT_S,
    STOP_TIMEOUT_S,
    log_tail,
    pid_running,
    remembered_port,
    run,
    wait_exit,
)
from eventlight.ops.state import PgServer

_log = logging.getLogger(__name__)

_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; PG adds "/.s.PGSQL.<port>"
PG_SETTINGS = {"fsync": "on", "max_connections": "200", "shared_buffers": "256MB"}


def _as_pg_user(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def blocked_dir(path: Path, uid: int, gids: set[int]) -> str | None:
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
    blocked = blocked_dir(home, pw.pw_uid, set(os.getgrouplist("postgres", pw.pw_gid)))
    if blocked:
        raise ServiceUnavailableError(
            "embedded postgres",
            f"Postgres refuses to run as root, so it runs as the `postgres` user, which cannot enter "
            f"{blocked}. Put EVENTLIGHT_STATE_DIR somewhere it can reach (e.g. /var/tmp/eventlight) "
            f"or set EVENTLIGHT_PG_DSN.",
        )
    return home


def postmaster(data: Path) -> tuple[int, int, str] | None:
    """(pid, port, socket dir) from ``postmaster.pid`` when that postmaster is running."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        pid, port, sock = int(lines[0]), int(lines[3]), lines[4].strip()
    except (OSError, ValueError, IndexError):
        return None
    return (pid, port, sock) if pid_running(pid, str(data)) else None


def _system_dsn(port: int, sock: str = "") -> str:
    """The embedded server's DSN: its unix socket in ``sock`` when it has one, else TCP on
    127.0.0.1 (where it also listens). The socket costs less CPU a round trip, in the client and
    in Postgres, than TCP on loopback (``bench/README.md``); Postgres listens on 127.0.0.1 only,
    so no other machine could use either."""
    if sock:
        return f"postgresql://postgres@/postgres?host={quote(sock, safe='/')}&port={port}"
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


async def ensure_system_pg(state: Path) -> PgServer:
    home = _prepare_pg_home(state)
    data = home / "data"
    running = postmaster(data)
    if running:
        dsn = _system_dsn(running[1], running[2])
        await wait_pg_ready(dsn, home / "server.log")
        return PgServer(dsn, running[0], "system", False)
    bindir = _pick_bindir(home)
    if not (data / "PG_VERSION").exists():
        await _initdb(bindir, home)
    port = remembered_port(home / "port")
    _write_pg_conf(data, home, port)
    await _pg_ctl(bindir, home, ["-D", str(data), "-l", str(home / "server.log"), "-w", "start"])
    running = postmaster(data)
    if not running:
        raise ServiceUnavailableError(_system_dsn(port), f"postgres exited; log tail:\n{log_tail(home / 'server.log')}")
    dsn = _system_dsn(port, running[2])
    await wait_pg_ready(dsn, home / "server.log")
    _log.info("started postgres pid %d on %s (binaries %s)", running[0], dsn, bindir)
    return PgServer(dsn, running[0], "system", True)


def _pick_bindir(home: Path) -> Path:
    """Binaries of the data folder's major version when it exists, else the newest found."""
    try:
        major = (home / "data" / "PG_VERSION").read_text().strip()
    except OSError:
        major = None
    bindir = system_bindir(major)
    if bindir is None:
        raise ServiceUnavailableError("embedded postgres", f"no Postgres binaries found; {PG_INSTALL_HINT}")
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
    rc, out = await run(_as_pg_user(argv), cwd=home)
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
    elif any(c in sock for c in "'\\,\""):  # a quote ends the setting's string, a comma splits its list
        _log.warning("%s holds a quote, a backslash or a comma; Postgres listens on TCP only", home)
        sock = ""
    lines = ["listen_addresses = '127.0.0.1'", f"port = {port}", f"unix_socket_directories = '{sock}'"]
    lines += [f"{k} = {v}" for k, v in PG_SETTINGS.items()]
    conf = data / "eventlight.conf"
    conf.write_text("# generated by eventlight.ops; rewritten at every start\n" + "\n".join(lines) + "\n")
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(conf, pw.pw_uid, pw.pw_gid)


async def _pg_ctl(bindir: Path, home: Path, args: list[str]) -> str:
    """Run ``pg_ctl`` (as ``postgres`` when root).

    Raises:
        ServiceUnavailableError: pg_ctl failed; includes its output and the server log tail.
    """
    rc, out = await run(_as_pg_user([str(bindir / "pg_ctl"), "-t", str(PG_CTL_TIMEOUT_S), *args]), cwd=home)
    if rc != 0:
        tail = log_tail(home / "server.log")
        raise ServiceUnavailableError("embedded postgres", f"pg_ctl {args[-1]} failed (rc {rc}): {out}\n{tail}")
    return out


async def wait_pg_ready(dsn: str, log: Path, timeout_s: float = 30.0) -> None:
    """Wait until ``dsn`` answers ``SELECT 1``.

    Raises:
        ServiceUnavailableError: It did not within ``timeout_s`` seconds; includes the log tail.
    """
    deadline = time.monotonic() + timeout_s
    while (why := await pg_probe(dsn)) is not None:
        if time.monotonic() > deadline:
            raise ServiceUnavailableError(redact(dsn), f"{why}; log tail:\n{log_tail(log)}")
        await asyncio.sleep(0.1)


async def stop_system_pg(state: Path, only_pid: int | None = None) -> str | None:
    """``pg_ctl stop -m fast`` of the embedded postmaster; with ``only_pid``, only when that is its
    pid. Returns what was stopped (``"postgres pid 123"``), ``None`` when nothing.

    Raises:
        ServiceUnavailableError: ``pg_ctl stop`` failed.
    """
    home = state / "pg"
    running = postmaster(home / "data")
    if not running or (only_pid is not None and running[0] != only_pid):
        return None
    await _pg_ctl(_pick_bindir(home), home, ["-D", str(home / "data"), "-m", "fast", "-w", "stop"])
    await wait_exit(running[0], STOP_TIMEOUT_S)
    return f"postgres pid {running[0]}"
