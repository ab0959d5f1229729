"""Processes and their files: pids, daemons, log tails, ports remembered across starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path

import psutil

from eventlight.net import free_port, port_free

_log = logging.getLogger(__name__)

PG_CTL_TIMEOUT_S = 60
STOP_TIMEOUT_S = 10.0


def pid_running(pid: int, marker: str) -> bool:
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


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


async def wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for ``pid`` to exit; reaps it if it is our child."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_running(pid, ""):
            return True
        await asyncio.sleep(0.05)
    return False


def remembered_port(port_file: Path) -> int:
    """The port stored in ``port_file`` if still free, else a new free one (stored)."""
    try:
        port = int(port_file.read_text())
    except (OSError, ValueError):
        port = 0
    if not 0 < port < 65536:  # an edited file: port_free would raise OverflowError
        port = 0
    if port and not port_free(port):
        _log.warning("port %d from %s is taken by another process; picking a new one", port, port_file)
        port = 0
    port = port or free_port()
    port_file.write_text(f"{port}\n")
    return port


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def spawn_daemon(argv: list[str], output: Path) -> int:
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


async def run(argv: list[str], cwd: Path, timeout_s: float = PG_CTL_TIMEOUT_S) -> tuple[int, str]:
    """Run a command to completion; output goes through a temp file (pg_ctl may hang pipes).

    The command runs in a session of its own, so a Ctrl-C at the terminal reaches only this process;
    when the call is cancelled (that Ctrl-C), it still waits for the command to end (within the
    timeout) before it gives up, so that what the command did (a postmaster ``pg_ctl start`` forked)
    is there for the caller's clean-up to undo, not left to come up after it.

    Returns:
        The exit code and the combined stdout/stderr text.
    """
    with tempfile.TemporaryFile() as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout_s + 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            rc = -1
        except asyncio.CancelledError:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout_s + 10)
            raise
        out.seek(0)
        return rc, out.read().decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# NATS
