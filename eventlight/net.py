"""Network addresses: free local ports, and URLs/DSNs that are safe to print.

The one place for both: the embedded servers, the LLM proxy, the local LLM, the tests and the
benchmarks pick ports with ``free_port``; every message that names a server passes its URL through
``redact`` first.
"""

from __future__ import annotations

import re
import socket

__all__ = ["free_port", "port_free", "redact"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS picks it; another process may take
    it before the caller binds, so bind soon); ``""`` and ``"::"`` mean every IPv4 address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "::") else "0.0.0.0", 0))
        port: int = s.getsockname()[1]
        return port


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` on ``host`` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


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
