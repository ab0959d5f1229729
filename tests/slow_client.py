"""A client that sends its request body slowly, over a raw socket, for the body-limit tests.

Not asyncio streams: a server that answers and hangs up while the client still sends makes the
client's kernel get a reset, and ``asyncio.StreamReader`` then raises ``ConnectionResetError``
ahead of the answer it had already read; a socket's ``recv`` hands over what came before the reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

__all__ = ["Answer", "trickle_post"]


@dataclass(frozen=True)
class Answer:
    """The server's answer: its status, headers (lower-cased names), body, and whether the server
    closed the connection after it (read to its end or reset)."""

    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool


async def trickle_post(
    port: int, path: str, *, first: bytes, piece: bytes, count: int, every_s: float, last: bytes = b""
) -> Answer:
    """POST ``first``, then ``count`` times ``piece`` ``every_s`` apart, then ``last`` (one
    ``Content-Length`` for all of it) to ``127.0.0.1:port``, reading the answer as it comes.

    Raises:
        AssertionError: No whole answer within 30 s.
    """
    loop = asyncio.get_running_loop()
    length = len(first) + count * len(piece) + len(last)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}"
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)

    async def send() -> None:
        with contextlib.suppress(OSError):  # the server hung up: what it answered is read below
            await loop.sock_sendall(sock, head.encode() + b"\r\n\r\n" + first)
            for _ in range(count):
                await asyncio.sleep(every_s)
                await loop.sock_sendall(sock, piece)
            await loop.sock_sendall(sock, last)

    sender = asyncio.create_task(send())
    received = bytearray()
    try:
        async with asyncio.timeout(30):
            answer = None
            while answer is None:
                data = await _recv(loop, sock)
                if not data:
                    raise AssertionError(f"the connection ended before a whole answer: {bytes(received)!r}")
                received += data
                answer = _parse(bytes(received))
            closed = answer.headers.get("connection") == "close"
            while closed and await _recv(loop, sock):  # to its end: the server closes it
                pass
            return Answer(answer.status, answer.headers, answer.body, closed)
    except TimeoutError:
        raise AssertionError(f"no whole answer within 30 s: {bytes(received)!r}") from None
    finally:
        sender.cancel()
        sock.close()


async def _recv(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    try:
        return await loop.sock_recv(sock, 65536)
    except ConnectionResetError:
        return b""


def _parse(received: bytes) -> Answer | None:
    """The answer in ``received`` once it is whole (by its ``Content-Length``), else ``None``."""
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return None
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
    size = int(headers["content-length"])
    if len(body) < size:
        return None
    return Answer(int(status_line.split()[1]), headers, body[:size], closed=False)
