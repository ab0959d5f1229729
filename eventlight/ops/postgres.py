"""Postgres: probe a DSN, and pick the embedded server (system binaries, else ``pgserver``)."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pwd
import re
import shutil
import ssl
import subprocess
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

import asyncpg

from eventlight.core.errors import ServiceUnavailableError
from eventlight.store.jetstream import pg_errors

_log = logging.getLogger(__name__)

PG_PROBE_TIMEOUT_S = 3.0
PG_INSTALL_HINT = "install Postgres (`apt-get install postgresql`) or `pip install pgserver`"


REFUSALS = (
    asyncpg.InvalidAuthorizationSpecificationError,  # no such role, or pg_hba.conf has no entry for it
    asyncpg.InvalidPasswordError,
    asyncpg.InvalidCatalogNameError,  # no such database
)
"""What a Postgres that answers says when it will not take the connection."""

REFUSED = "refused the connection"
"""How ``pg_probe``'s answer begins when the server raised one of ``REFUSALS``."""

BUSY_NOW = "answered but takes no connection now"
"""How ``pg_probe``'s answer begins when the server said "too many clients" or that it is starting up
(``pg_errors.BUSY``): it is there, and a connection may be had a little later."""

UNUSABLE = "cannot be used with this DSN"
"""How ``pg_probe``'s answer begins when asyncpg refused the DSN's settings before connecting (a
root certificate ``sslmode=verify-full`` needs that does not exist)."""

_SSL_FILES = {
    "sslrootcert": "PGSSLROOTCERT",
    "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY",
    "sslcrl": "PGSSLCRL",
}
"""The DSN parameters naming a file asyncpg reads before it connects, with their environment variables."""


async def pg_probe(dsn: str, timeout_s: float = PG_PROBE_TIMEOUT_S) -> str | None:
    """Connect once and run ``SELECT 1``; return ``None`` on success, else why not, as a phrase:
    ``"did not answer (why)"``, or ``"refused the connection (why)"`` when the server answered
    but refused the role, password or database (``REFUSALS``), a setting the DSN's ``options``
    gives (any other error the server sends to a connection that is starting), or the DSN's
    ``sslmode`` (it rejected SSL, or its certificate failed the check); or ``"cannot be used with
    this DSN (why)"`` when asyncpg refused the DSN's settings before connecting (``sslmode=verify-full``
    and no root certificate: none in ``sslrootcert``, ``$PGSSLROOTCERT`` or ``~/.postgresql/root.crt``);
    or ``"answered but takes no connection now (why)"`` (``BUSY_NOW``) for "too many clients" or a
    server starting up."""
    try:
        conn = await pg_errors.connect(dsn, timeout_s=timeout_s)
    except ServiceUnavailableError as e:
        return _why_not(e, dsn)
    except asyncpg.PostgresError as e:  # e.g. options=-c no_such_setting=1: it raised out of the probe
        return f"{REFUSED} ({e})"
    try:
        with pg_errors.pg_errors(dsn, "SELECT 1"):
            await conn.fetchval("SELECT 1")
        return None
    except ServiceUnavailableError as e:
        return _why_not(e, dsn)
    finally:
        await conn.close()


def _why_not(e: ServiceUnavailableError, dsn: str) -> str:
    cause = e.__cause__ or e
    if _before_connecting(cause):
        return f"{UNUSABLE} ({_config_error(cause, dsn)})"
    if isinstance(cause, pg_errors.BUSY):
        return f"{BUSY_NOW} ({cause})"
    return f"{REFUSED if isinstance(cause, REFUSALS) or _ssl_refused(cause) else 'did not answer'} ({cause})"


def _ssl_refused(cause: BaseException) -> bool:
    """The server answered the DSN's ``sslmode`` with a refusal: it does not do SSL (asyncpg raises a
    bare ``ConnectionError`` saying so, where nothing listening is its subclass ``ConnectionRefusedError``),
    or its certificate failed the check."""
    return isinstance(cause, ssl.SSLError) or (type(cause) is ConnectionError and "SSL" in str(cause))


def _before_connecting(cause: BaseException) -> bool:
    """asyncpg raised ``cause`` while it read the DSN's settings, before any connection: a setting
    that cannot work, not a server that does not answer (a missing root certificate raises a bare
    ``FileNotFoundError`` there, as a missing unix socket does when connecting)."""
    if isinstance(cause, asyncpg.ClientConfigurationError):
        return True
    tb = cause.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_parse_connect_dsn_and_args":
            return True
        tb = tb.tb_next
    return False


def _config_error(cause: BaseException, dsn: str) -> str:
    """The first line of ``cause``; a ``FileNotFoundError`` without a file name (``ssl``'s) gets the
    SSL files the DSN or the environment names that do not exist."""
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if isinstance(cause, FileNotFoundError) and cause.filename is None:
        missing = [f"{name} {path}" for name, path in _ssl_files(dsn) if not Path(path).expanduser().exists()]
        if missing:
            return f"{', '.join(missing)}: no such file"
    return text


def _ssl_files(dsn: str) -> list[tuple[str, str]]:
    """The SSL files the DSN's query names, else their environment variables (``_SSL_FILES``)."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query)
    named = []
    for param, var in _SSL_FILES.items():
        path = query.get(param, [os.environ.get(var, "")])[0]
        if path:
            named.append((param, path))
    return named


def choose_pg_kind(state: Path) -> str:
    """Keep the kind whose data already exists; else system binaries, else pgserver.

    Raises:
        ServiceUnavailableError: Neither is available (with the install hint).
    """
    if (state / "pg" / "data" / "PG_VERSION").exists():
        return "system"
    if (state / "pg-pgserver" / "PG_VERSION").exists() or not _system_pg_usable():
        if _pgserver_importable():
            return "pgserver"
        raise ServiceUnavailableError("embedded postgres", f"no Postgres binaries found; {PG_INSTALL_HINT}")
    return "system"


def _system_pg_usable() -> bool:
    if system_bindir() is None:
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
        import_pgserver()
    except ImportError:
        return False
    return True


def import_pgserver() -> Any:
    with warnings.catch_warnings():  # platformdirs warns at import when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        import pgserver
    return pgserver


def _pg_version_key(bindir: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", bindir.parent.name)) or (0,)


def system_bindir(major: str | None = None) -> Path | None:
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
