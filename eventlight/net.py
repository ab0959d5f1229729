"""Network addresses: free local ports, and URLs/DSNs that are safe to print.

The one place for both: the embedded servers, the LLM proxy, the local LLM, the tests and the
benchmarks pick ports with ``free_port``; every message that names a server passes its URL through
``redact`` first.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

__all__ = ["NATS_SCHEMES", "free_port", "port_free", "redact", "redact_unparsed", "server_urls", "tcp_listener"]


def tcp_listener(host: str) -> socket.socket:
    """An unbound TCP socket for a server on ``host`` (IPv6 when it holds a ``:``).

    Created as ``IPPROTO_TCP``, not protocol 0: asyncio turns Nagle's algorithm off only on sockets
    that say they are TCP, and with it on, a response written in two parts on a kept-alive
    connection waits for the client's delayed ACK (~40 ms a request measured on ``eventlight serve``
    and the LLM proxy, which hand uvicorn a socket of their own).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)


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

    ``scheme://user:secret@host`` becomes ``scheme://user:***@host`` (a password holding an ``@``:
    up to the last one before the host); a NATS token (``nats://secret@host``) becomes
    ``nats://***@host``; ``password=…`` in a key/value DSN or a query string becomes ``password=***``.
    URLs inside a longer text (an error message) are masked too.
    """
    url = re.sub(r"(?i)(password=)[^&\s]*", r"\1***", url)
    return _CREDS_RE.sub(_mask, url)


def redact_configured(value: str, text: str) -> str:
    """``text`` (an error message about the configured URL or DSN ``value``) safe to print.

    A well-formed URL is masked as ``redact`` does. A value that is not a URL (no ``scheme://``:
    a password-only file, ``user:pw@host``) cannot be parsed for its secret, so the value and each
    of its parts of four characters or more are replaced by ``***`` wherever they appear, and the
    rest of the text is redacted as usual.
    """
    if "://" not in value:
        parts = {value, *re.split(r"[:@/?=&\s]+", value)}
        for part in sorted(parts, key=len, reverse=True):
            if len(part) >= 4:
                text = text.replace(part, "***")
                text = text.replace(part.lower(), "***")
    return redact(text)


def redact_unparsed(url: str, what: str, error: BaseException) -> str:
    """The one-line message for ``url``, which its parser refused with ``error`` (``what``: ``"a NATS
    URL"``), safe to print.

    With ``user:password@`` in it, ``redact`` masks the password; so it does when the port is a number
    (out of range). Otherwise the password cannot be told from the rest: ``nats://user:secret`` (the
    host forgotten) reads as host ``user`` and port ``secret``, and the parser's error quotes that
    port; so the address and every quoted value of the error are masked. A port that is not a
    number is said so (``its port 'x' is not a number``), not in the parser's Python words
    (``invalid literal for int() with base 10``).
    """
    authority = url.split("://", 1)[-1].split("/", 1)[0]
    ports = [host.rpartition(":")[2] for host in authority.rpartition("@")[2].split(",")]
    quoted = _NOT_A_NUMBER.search(str(error))  # the parsers' own words: a Python message to a user
    bad_port = quoted is not None and quoted[1] in ports
    if "@" in authority or authority.rpartition(":")[2].isdigit():
        why = f"its port {redact(quoted[1])!r} is not a number" if bad_port and quoted else redact(str(error))
        return f"{redact(url)} is not {what}: {why}"
    scheme = url.split("://", 1)[0] + "://" if "://" in url else ""
    why = "its port is not a number" if bad_port else re.sub(r"'[^']*'|\"[^\"]*\"", "'***'", str(error))
    return f"{scheme}*** is not {what}: {why} (the address is not shown: it may hold a password)"


# asyncpg: "invalid literal for int() with base 10: 'x'";
# urllib (NATS URLs): "Port could not be cast to integer value as 'x'"
_NOT_A_NUMBER = re.compile(
    r"(?:invalid literal for int\(\) with base 10:|Port could not be cast to integer value as) '(.*)'"
)


_CREDS_RE = re.compile(r"(?<![\w+.-])([a-zA-Z][\w+.-]*://)([^/\s,]*)@")


def _mask(m: re.Match[str]) -> str:
    scheme, creds = m.group(1), m.group(2)
    if ":" in creds:
        return f"{scheme}{creds.split(':', 1)[0]}:***@"
    return f"{scheme}***@" if scheme.lower().startswith(("nats", "tls", "ws")) else m.group(0)


NATS_SCHEMES = ("nats", "tls", "ws", "wss")
"""The URL schemes nats-py connects with (``Client._parse_server_uri``): TCP (``nats``, ``tls``)
and WebSocket (``ws``, ``wss``). Any other (``http://``) it reads as a host named after the scheme
and tries until its connect timeout."""


def server_urls(url: str | Sequence[str]) -> list[str]:
    """The NATS servers named by ``url``: one URL, several separated by commas, or a list of them.

    ``host:port`` without a scheme gets ``nats://``. ``EVENTLIGHT_NATS_URL`` takes the same form, so a
    cluster is given by all its servers (``nats://a:4222,nats://b:4222,nats://c:4222``).

    Raises:
        InvalidInputError: No server is named; a scheme nats-py does not connect with (one of
            ``NATS_SCHEMES``), or WebSocket and TCP servers mixed (nats-py refuses them); a port out
            of range or not a number.
    """
    from eventlight.core.errors import InvalidInputError  # which imports this module

    parts = url.split(",") if isinstance(url, str) else [p for u in url for p in u.split(",")]
    urls = [p.strip() if "://" in p else f"nats://{p.strip()}" for p in parts if p.strip()]
    if not urls:
        raise InvalidInputError(f"no NATS server in {redact(str(url))!r}")
    for u in urls:
        scheme = u.split("://", 1)[0]
        if scheme not in NATS_SCHEMES:
            raise InvalidInputError(
                f"{redact(u)} is not a NATS URL: its scheme is {scheme}://; NATS takes "
                f"{', '.join(s + '://' for s in NATS_SCHEMES)} (e.g. nats://127.0.0.1:4222)"
            )
        try:
            urlsplit(u).port  # noqa: B018 - parsing it raises on a port out of range or not a number
        except ValueError as e:
            raise InvalidInputError(redact_unparsed(u, "a NATS URL", e)) from None
    if len({u.split("://", 1)[0] in ("ws", "wss") for u in urls}) > 1:
        raise InvalidInputError("NATS URLs mix WebSocket (ws://, wss://) and TCP (nats://, tls://) servers")
    return urls
