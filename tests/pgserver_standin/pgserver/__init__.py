"""A stand-in for the ``pgserver`` wheel's ``get_server``, for the tests of an interrupted start.

As root, the real ``get_server`` adds a system user (``useradd pgserver``) and opens the folders
above its data and binaries to everyone: not something a test may do to the machine. This one does
the rest as the wheel does, with the same blocking calls on the caller's thread: ``initdb`` once,
then ``pg_ctl -w start`` with a unix socket in the data folder and no TCP, each a
``subprocess.run`` in the caller's process group (so a terminal's Ctrl+C reaches them too). The
binaries are the wheel's own when it is installed, else the system's; as root they run as
``postgres``. ``PGSERVER_STANDIN_DELAY_S`` holds the start back that long before ``initdb``
(an uninterruptible first step, as the wheel's lock and checks are).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pwd
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["PostgresServer", "get_server"]


def _bindir() -> Path:
    """The real wheel's binaries when it is installed, else the system's (as eventlight finds them)."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        wheel = Path(str(importlib.metadata.distribution("pgserver").locate_file("pgserver/pginstall/bin")))
        if (wheel / "initdb").is_file():
            return wheel
    from eventlight.ops.postgres import system_bindir

    found = system_bindir()
    if found is None:
        raise RuntimeError("no Postgres binaries for the pgserver stand-in")
    return found


def _run(argv: list[str]) -> None:
    if os.geteuid() == 0:
        argv = ["runuser", "-u", "postgres", "--", *argv]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class PostgresServer:
    _instances: dict[Path, PostgresServer] = {}

    def __init__(self, pgdata: Path):
        self.pgdata = pgdata


def get_server(pgdata: Path | str, cleanup_mode: str | None = "stop") -> Any:
    data = Path(pgdata)
    data.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(data, pw.pw_uid, pw.pw_gid)
    time.sleep(float(os.environ.get("PGSERVER_STANDIN_DELAY_S", "0")))
    bindir = _bindir()
    if not (data / "PG_VERSION").exists():
        _run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-instructions"])
    options = f'-h "" -k {data}'
    _run([str(bindir / "pg_ctl"), "-D", str(data), "-w", "-o", options, "-l", str(data / "log"), "start"])
    server = PostgresServer(data)
    PostgresServer._instances[data.resolve()] = server
    return server
