"""Bad input to ``eventlight serve``: each case gets its 4xx with a one-line message, and the server keeps serving.

Also the bearer token (401 without it or with another one) and the default bind address.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from google.rpc import code_pb2
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from slow_client import trickle_post

import eventlight as agl
from eventlight.core.errors import (
    EventlightError,
    InvalidInputError,
    InvalidTypeError,
    NotFoundError,
    RolloutNotFoundError,
    ServiceUnavailableError,
)
from eventlight.net import free_port

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PB = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
MAX_BODY = 64 * 1024


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(store, port=free_port(), token=TOKEN, max_body_bytes=MAX_BODY)
        async with server, httpx.AsyncClient(base_url=server.endpoint, headers=AUTH) as client:
            yield client


def _status(r: httpx.Response, kind: str) -> Status:
    """The answer's ``google.rpc.Status``, read in ``kind``'s encoding, which its Content-Type must name."""
    assert r.headers["content-type"] == kind, (r.headers, r.content)
    if kind == JSON["Content-Type"]:
        return json_format.Parse(r.text, Status())
    return Status.FromString(r.content)


def _pb_span(trace_id: bytes, span_id: bytes) -> bytes:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = trace_id, span_id, "s"
    return request.SerializeToString()


HUGE = b"[" + b"1," * MAX_BODY + b"1]"

# (name, method, path, kwargs, status, words the one-line message must hold)
REST_CASES: list[tuple[str, str, str, dict[str, Any], int, str]] = [
    (
        "wrong type in body",
        "POST",
        "/v1/agl/queues/rollouts/enqueue",
        {"json": {"rollouts": [{"input": 1, "mode": 123}]}},
        422,
        "$.rollouts[0].mode",
    ),
    (
        "body of the wrong shape",
        "POST",
        "/v1/agl/waits/rollouts",
        {"json": {"rollout_ids": "ro-1"}},
        422,
        "Expected `array`",
    ),
    (
        "body not JSON",
        "POST",
        "/v1/agl/rollouts",
        {"content": b"{nope", "headers": {"Content-Type": "application/json"}},
        400,
        "not valid JSON",
    ),
    ("wrong type in query", "GET", "/v1/agl/rollouts", {"params": {"limit": "many"}}, 422, "limit"),
    (  # found by a fresh user: a 500 from Postgres' bigint
        "limit beyond int64",
        "GET",
        "/v1/agl/rollouts",
        {"params": {"limit": "99999999999999999999"}},
        400,
        "at most 9223372036854775807",
    ),
    (  # found by a fresh user: a 500 from a RecursionError
        "body nested 5000 deep",
        "POST",
        "/v1/agl/queues/rollouts/enqueue",
        {"content": b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", "headers": {"Content-Type": "application/json"}},
        400,
        "nested too deeply",
    ),
    ("limit 0", "POST", "/v1/agl/rollouts/search", {"json": {"limit": 0}}, 400, "limit must be -1"),
    (
        "body not UTF-8",
        "POST",
        "/v1/agl/rollouts",
        {"content": b'{"input":"\xff\xfe"}', "headers": {"content-type": "application/json"}},
        400,
        "not valid UTF-8",
    ),
    ("bad sort order", "GET", "/v1/agl/workers", {"params": {"sort_order": "up"}}, 422, "sort_order"),
    ("unknown rollout status in query", "GET", "/v1/agl/rollouts", {"params": {"status_in": "zzz"}}, 422, "status_in"),
    ("unknown worker status in query", "GET", "/v1/agl/workers", {"params": {"status_in": "zzz"}}, 422, "status_in"),
    ("null status", "POST", "/v1/agl/rollouts/ro-000000000000", {"json": {"status": None}}, 422, "$.status"),
    ("unknown status name", "POST", "/v1/agl/rollouts/search", {"json": {"status_in": ["done"]}}, 422, "status_in"),
    (
        "unknown rollout",
        "POST",
        "/v1/agl/rollouts/ro-000000000000/attempts/latest",
        {"json": {"status": "failed"}},
        404,
        "ro-000000000000",
    ),
    ("unknown route", "GET", "/v1/agl/nothing-here", {}, 404, "no route GET /v1/agl/nothing-here"),
    ("unknown /v1 route", "POST", "/v1/logs", {"content": b"x"}, 404, "no route POST /v1/logs"),
    ("wrong method", "GET", "/v1/agl/queues/rollouts/enqueue", {}, 405, "does not accept GET"),
    (
        "oversized body",
        "POST",
        "/v1/agl/spans",
        {"content": HUGE, "headers": {"Content-Type": "application/json"}},
        413,
        f"limit of {MAX_BODY} bytes",
    ),
]

OTLP_CASES: list[tuple[str, dict[str, Any], int, str]] = [
    (
        "malformed protobuf",
        {"content": b"\xff\xff\xff\xff", "headers": PB},
        400,
        "not a protobuf ExportTraceServiceRequest",
    ),
    (
        "trace id of 5 bytes",
        {"content": _pb_span(b"\x01" * 5, b"\x02" * 8), "headers": PB},
        400,
        "traceId must be 16 bytes",
    ),
    ("all-zero span id", {"content": _pb_span(b"\x01" * 16, b"\x00" * 8), "headers": PB}, 400, "spanId is all zeros"),
    (
        "OTLP/JSON id not hex",
        {"json": {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "01" * 8}]}]}]}},
        400,
        "is not hex",
    ),
    ("OTLP/JSON not JSON", {"content": b"{", "headers": {"Content-Type": "application/json"}}, 400, "not JSON"),
    (  # a 500 from a RecursionError, with a traceback in the server's log
        "OTLP/JSON nested 5000 deep",
        {"content": b'{"resourceSpans": ' + b"[" * 5000 + b"]" * 5000 + b"}", "headers": JSON},
        400,
        "nested too deeply",
    ),
    (
        "unsupported content type",
        {"content": b"x", "headers": {"Content-Type": "text/plain"}},
        415,
        "Content-Type text/plain is not supported",
    ),
    (
        "unsupported encoding",
        {"content": b"x", "headers": {**PB, "Content-Encoding": "br"}},
        415,
        "Content-Encoding br",
    ),
    (
        "broken gzip",
        {"content": b"\x1f\x8bnot gzip", "headers": {**PB, "Content-Encoding": "gzip"}},
        400,
        "not valid gzip",
    ),
    (
        "trailing bytes after the gzip member",
        {
            "content": gzip.compress(_pb_span(b"\x01" * 16, b"\x02" * 8)) + b"junk",
            "headers": {**PB, "Content-Encoding": "gzip"},
        },
        400,
        "not valid gzip",
    ),
    (
        "OTLP/JSON resourceSpans a number",
        {"json": {"resourceSpans": 5}},
        400,
        "resourceSpans must be an array, got int",
    ),
    ("OTLP/JSON resourceSpans of numbers", {"json": {"resourceSpans": [5]}}, 400, "resourceSpans[0] is not an object"),
    (
        "OTLP/JSON scopeSpans a string",
        {"json": {"resourceSpans": [{"scopeSpans": "x"}]}},
        400,
        "resourceSpans[0].scopeSpans must be an array, got str",
    ),
    (
        "OTLP/JSON links an object",
        {
            "json": {
                "resourceSpans": [
                    {"scopeSpans": [{"spans": [{"traceId": "01" * 16, "spanId": "01" * 8, "links": {}}]}]}
                ]
            }
        },
        400,
        "spans[0].links must be an array, got dict",
    ),
    (
        "gzip bomb",
        {"content": gzip.compress(b"\x00" * (MAX_BODY + 10)), "headers": {**PB, "Content-Encoding": "gzip"}},
        413,
        "inflates",
    ),
]


async def _still_serving(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/agl/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


@pytest.mark.parametrize(
    ("name", "method", "path", "kwargs", "status", "words"), REST_CASES, ids=[c[0] for c in REST_CASES]
)
async def test_rest_bad_input(
    http: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
    name: str,
    method: str,
    path: str,
    kwargs: dict[str, Any],
    status: int,
    words: str,
) -> None:
    with caplog.at_level(logging.ERROR):
        r = await http.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert words in detail and "\n" not in detail and "Traceback" not in r.text, detail
    # bad input is no server fault: nothing in the server's log at ERROR (an invalid UTF-8 body
    # logged uvicorn's "Exception in ASGI application" with a traceback, a reviewer)
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []
    await _still_serving(http)


@pytest.mark.parametrize(("name", "kwargs", "status", "words"), OTLP_CASES, ids=[c[0] for c in OTLP_CASES])
async def test_otlp_bad_input(
    http: httpx.AsyncClient, name: str, kwargs: dict[str, Any], status: int, words: str
) -> None:
    r = await http.post("/v1/traces", **kwargs)
    assert r.status_code == status, r.content
    sent = kwargs.get("headers", JSON if "json" in kwargs else {})["Content-Type"]
    message = _status(r, JSON["Content-Type"] if "json" in sent else PB["Content-Type"]).message
    assert words in message and "\n" not in message, message
    await _still_serving(http)


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 4096):
        yield data[i : i + 4096]


@pytest.mark.parametrize("kind", [PB, JSON], ids=["protobuf", "json"])
@pytest.mark.parametrize(
    ("case", "status", "code", "words"),
    [
        ("no token", 401, code_pb2.UNAUTHENTICATED, "missing bearer token"),
        ("wrong token", 401, code_pb2.UNAUTHENTICATED, "wrong bearer token"),
        ("over the ceiling", 413, code_pb2.RESOURCE_EXHAUSTED, f"over the server's limit of {MAX_BODY} bytes"),
        ("over the ceiling in chunks", 413, code_pb2.RESOURCE_EXHAUSTED, "(sent in chunks)"),
        ("does not parse", 400, code_pb2.INVALID_ARGUMENT, "the body is not"),
        ("wrong method", 405, code_pb2.UNIMPLEMENTED, "does not accept GET"),
    ],
)
async def test_every_otlp_error_is_a_status_in_the_requests_encoding(
    http: httpx.AsyncClient, kind: dict[str, str], case: str, status: int, code: int, words: str
) -> None:
    """OTLP/HTTP: an error's body is a ``google.rpc.Status`` in the request's encoding, with that
    Content-Type. The token's 401 and the body ceiling's 413 were ``ErrorBody`` JSON, which a
    protobuf exporter cannot read (a reviewer); read here with the ``Status`` class itself."""
    headers = {**AUTH, **kind}
    body = b"{" if kind == JSON else b"\xff\xff\xff\xff"
    if case == "no token":
        del headers["Authorization"]
    elif case == "wrong token":
        headers["Authorization"] = "Bearer nope"
    async with httpx.AsyncClient(base_url=str(http.base_url)) as client:
        if case == "over the ceiling":
            r = await client.post("/v1/traces", content=b" " * (MAX_BODY + 1), headers=headers)
        elif case == "over the ceiling in chunks":
            r = await client.post("/v1/traces", content=_chunks(b" " * (MAX_BODY + 1)), headers=headers)
        elif case == "wrong method":
            r = await client.get("/v1/traces", headers=headers)
        else:
            r = await client.post("/v1/traces", content=body, headers=headers)
    assert r.status_code == status, r.content
    answer = _status(r, kind["Content-Type"])
    assert answer.code == code and words in answer.message and "\n" not in answer.message, answer
    if status == 401:
        assert r.headers["www-authenticate"].startswith("Bearer") and TOKEN not in r.text


async def test_a_body_taken_whole_is_held_once_while_the_app_runs() -> None:
    """``BodyLimit`` gathers a body in chunks and hands it on whole: it kept the chunks besides the
    whole body for as long as the app ran, twice the memory of every request in flight (many clients
    each sending a body just under the limit: 32 MiB held for each 16 MiB one)."""
    import tracemalloc

    from eventlight.server.limits import BodyLimit

    size, chunk = 8 * 1024 * 1024, 64 * 1024
    held: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        held.append(tracemalloc.get_traced_memory()[0])
        assert len(body) == size
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        sent += chunk
        return {"type": "http.request", "body": b"x" * chunk, "more_body": sent < size}

    async def send(message: Any) -> None:
        pass

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await BodyLimit(app, max_body_bytes=2 * size)({"type": "http", "headers": []}, receive, send)
    finally:
        tracemalloc.stop()
    assert held and (held[0] - before) / size < 1.2, f"{(held[0] - before) / size:.1f} times the body held"


@pytest.mark.parametrize(
    ("headers", "words"),
    [({}, "missing bearer token"), ({"Authorization": "Bearer nope"}, "wrong bearer token"),
     ({"Authorization": TOKEN}, "must be 'Bearer <token>'"), ({"Authorization": "Basic " + TOKEN}, "must be")],
    ids=["missing", "wrong", "no scheme", "other scheme"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/v1/agl/health", "/v1/traces", "/openapi.json"])
async def test_a_request_without_the_token_is_401(
    http: httpx.AsyncClient, headers: dict[str, str], words: str, path: str
) -> None:
    async with httpx.AsyncClient(base_url=str(http.base_url), headers=headers) as anonymous:
        r = await anonymous.post(path, json={}) if path == "/v1/traces" else await anonymous.get(path)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert words in r.json()["message" if path == "/v1/traces" else "detail"] and TOKEN not in r.text
    await _still_serving(http)


async def test_the_bearer_scheme_is_case_insensitive(http: httpx.AsyncClient) -> None:
    """RFC 7235: the scheme's case does not matter; the token's does (found by a fresh user)."""
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = await http.get("/v1/agl/health", headers={"Authorization": f"{scheme} {TOKEN}"})
        assert r.status_code == 200, (scheme, r.text)
    r = await http.get("/v1/agl/health", headers={"Authorization": f"Bearer {TOKEN.upper()}"})
    assert r.status_code == 401


async def test_clients_with_the_token_work_and_without_it_get_authentication_error(http: httpx.AsyncClient) -> None:
    good = agl.LightningStoreClient(str(http.base_url), token=TOKEN)
    bad = agl.LightningStoreClient(str(http.base_url), token="other")
    try:
        assert (await good.enqueue_rollout({"q": 1})).status == "queuing"
        with pytest.raises(agl.core.errors.AuthenticationError, match="wrong bearer token"):  # type: ignore[attr-defined]
            await bad.enqueue_rollout({"q": 1})
    finally:
        await good.close()
        await bad.close()


async def test_the_client_sends_an_id_as_one_path_segment(http: httpx.AsyncClient) -> None:
    """An id with URL syntax in it reaches the server as that id (a reviewer: ``update_worker("w?x=1")``
    wrote worker ``w``, and ``get_worker_by_id("w?x=1")`` read it back)."""
    client = agl.LightningStoreClient(str(http.base_url), token=TOKEN, retry_delays=())
    try:
        await client.update_worker("w", {"n": 1})
        for odd in ("w?x=1", "w#frag", "w%3F"):
            with pytest.raises(InvalidInputError, match="is not a valid id"):
                await client.update_worker(odd, {"n": 2})
            assert await client.get_worker_by_id(odd) is None
        assert (await client.get_worker_by_id("w")).heartbeat_stats == {"n": 1}  # type: ignore[union-attr]
        r = await client.enqueue_rollout({"q": 1})
        with pytest.raises(NotFoundError):
            await client.update_rollout(f"{r.rollout_id}?", status="cancelled")
        # servers decode %2F before routing: 'ro-1/attempts' started an attempt on a queued rollout
        # (a third reviewer)
        for odd in (f"{r.rollout_id}/attempts", "x/../../workers/w", "../resources/latest", "x/"):
            with pytest.raises(InvalidInputError, match="no id holds '/'"):
                await client.update_rollout(odd, metadata={"m": 1})
        assert (await client.get_rollout_by_id(r.rollout_id)).status == "queuing"  # type: ignore[union-attr]
        # an id that is not a string, or empty, names nothing: the stores' answers, not a refusal
        for nameless in ("", 5, None):
            assert await client.get_rollout_by_id(nameless) is None  # type: ignore[arg-type]
            assert await client.get_worker_by_id(nameless) is None  # type: ignore[arg-type]
            assert await client.get_resources_by_id(nameless) is None  # type: ignore[arg-type]
            for call in (
                lambda: client.update_rollout(nameless, status="cancelled"),  # type: ignore[arg-type]  # noqa: B023
                lambda: client.start_attempt(nameless),  # type: ignore[arg-type]  # noqa: B023
                lambda: client.get_latest_attempt(nameless),  # type: ignore[arg-type]  # noqa: B023
                lambda: client.wait_for_rollouts(rollout_ids=[r.rollout_id, nameless], timeout=0),  # noqa: B023
            ):
                with pytest.raises(RolloutNotFoundError):
                    await call()
        with pytest.raises(InvalidTypeError, match="rollout_ids must be a list"):
            await client.wait_for_rollouts(rollout_ids=r.rollout_id, timeout=0)  # type: ignore[arg-type]
        # dot segments are removed by HTTP clients: "." was the collection, and a new rollout or
        # resources entry was made (a second reviewer)
        before = len(await client.query_rollouts()), len(await client.query_resources())
        for dots in (".", ".."):
            with pytest.raises(NotFoundError):
                await client.update_rollout(dots, status="cancelled")
            with pytest.raises((InvalidInputError, NotFoundError)):  # as the store answers
                await client.update_resources(dots, {"p": agl.PromptTemplate(template="x")})
            assert await client.get_rollout_by_id(dots) is None
        assert (len(await client.query_rollouts()), len(await client.query_resources())) == before
        for call in (lambda: client.update_worker("search"), lambda: client.get_resources_by_id("latest")):
            with pytest.raises(InvalidInputError, match="names a route"):
                await call()
        with pytest.raises(InvalidTypeError, match="worker_id must be a string"):
            await client.update_worker(5)  # type: ignore[arg-type]
    finally:
        await client.close()


async def test_a_write_sent_but_never_answered_says_its_outcome_is_unknown() -> None:
    """A write whose answer was lost may have been stored: its error says so, where one that never
    left says only that the server cannot be reached (a reviewer: both read "cannot reach")."""

    async def take_and_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)  # the request arrived; no answer
        writer.close()

    server = await asyncio.start_server(take_and_drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dropping = agl.LightningStoreClient(f"http://127.0.0.1:{port}", retry_delays=())
    refused = agl.LightningStoreClient(f"http://127.0.0.1:{free_port()}", retry_delays=())
    try:
        with pytest.raises(ServiceUnavailableError, match="^no answer from .*outcome is unknown"):
            await dropping.enqueue_rollout({"q": 1})
        with pytest.raises(ServiceUnavailableError) as never_sent:
            await refused.enqueue_rollout({"q": 1})
        assert "outcome" not in str(never_sent.value)
        with pytest.raises(ServiceUnavailableError) as read:  # a read is retried, and never "unknown"
            await dropping.get_rollout_by_id("ro-1")
        assert "outcome" not in str(read.value)
    finally:
        await dropping.close()
        await refused.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("answer", "error", "says"),
    [
        (
            b"HTTP/1.1 504 Gateway Timeout\r\ncontent-length: 14\r\n\r\nupstream timed",
            ServiceUnavailableError,
            "outcome is unknown",
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", EventlightError, "not JSON ('hello')"),
        # an answer of another shape (another server, another version): raw msgspec / KeyError before
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", EventlightError, "not JSON ('')"),
        (
            b'HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n{"ok":1}',
            EventlightError,
            'not a list of Rollout (got {"ok":1})',
        ),
        (b'HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n[{"x":1}]', EventlightError, "not a Rollout (Object missing"),
        (
            b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 40\r\n\r\n<html>\n<h1>502 Bad Gateway</h1>\n</html>\n",
            ServiceUnavailableError,
            "POST /v1/agl/queues/rollouts/enqueue: HTTP 502 from http://127.0.0.1:",
        ),
        (  # a body that does not inflate: the answer is lost, the write may be stored
            b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 4\r\n\r\nnope",
            ServiceUnavailableError,
            "outcome is unknown",
        ),
    ],
)
async def test_what_stands_between_client_and_server_is_named(answer: bytes, error: type, says: str) -> None:
    """A gateway's 504 to a write may hide a stored write, and a 200 that is not JSON is no store
    server (a second reviewer: a bare EventlightError('upstream timed'), a raw msgspec error)."""

    async def answer_with(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_with, "127.0.0.1", 0)
    client = agl.LightningStoreClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", retry_delays=())
    try:
        with pytest.raises(error) as raised:
            await client.enqueue_rollout({"q": 1})
        assert says in str(raised.value)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_reads_answered_in_another_shape_say_so() -> None:
    """Every read of the client checks the answer's shape: a list for a page, an object for an entity
    (a reviewer: ``TypeError: list indices must be integers``, a raw ``msgspec.ValidationError``)."""

    async def answer_a_list(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n[1,2]")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_a_list, "127.0.0.1", 0)
    client = agl.LightningStoreClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", retry_delays=())
    calls = {
        "a page of Rollout": client.query_rollouts,
        "a page of Attempt": lambda: client.query_attempts("ro-1"),
        "a page of Span": lambda: client.query_spans("ro-1"),
        "a page of Worker": client.query_workers,
        "a Rollout": lambda: client.get_rollout_by_id("ro-1"),
        "a ResourcesUpdate": client.get_latest_resources,
        '{"sequence_id": <int>}': lambda: client.get_next_span_sequence_id("ro-1", "at-1"),
        "a dict": client.statistics,
    }
    try:
        for what, call in calls.items():
            with pytest.raises(EventlightError, match=f"not {re.escape(what)} .*got \\[1,2\\]"):
                await call()
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_openapi_describes_every_route_and_binds_loopback_by_default() -> None:
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(store, port=free_port())
        assert server.host == "127.0.0.1"
        async with server, httpx.AsyncClient(base_url=server.endpoint) as client:
            bound = {s.getsockname()[0] for srv in server._server.servers for s in srv.sockets}  # type: ignore[union-attr]
            assert bound == {"127.0.0.1"}
            spec = (await client.get("/openapi.json")).json()
    paths = set(spec["paths"])
    for path in (
        "/v1/agl/queues/rollouts/enqueue", "/v1/agl/queues/rollouts/dequeue", "/v1/agl/rollouts",
        "/v1/agl/rollouts/search", "/v1/agl/rollouts/{rollout_id}", "/v1/agl/rollouts/{rollout_id}/attempts",
        "/v1/agl/rollouts/{rollout_id}/attempts/search", "/v1/agl/rollouts/{rollout_id}/attempts/latest",
        "/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}", "/v1/agl/workers", "/v1/agl/workers/search",
        "/v1/agl/workers/{worker_id}", "/v1/agl/statistics", "/v1/agl/resources", "/v1/agl/resources/latest",
        "/v1/agl/resources/{resources_id}", "/v1/agl/spans", "/v1/agl/spans/search", "/v1/agl/spans/next",
        "/v1/agl/waits/rollouts", "/v1/agl/health", "/v1/traces",
    ):  # fmt: skip
        assert path in paths, path
    enqueue = spec["paths"]["/v1/agl/queues/rollouts/enqueue"]["post"]
    ref = enqueue["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.rsplit("/", 1)[-1] in spec["components"]["schemas"]


# -- bodies held at once, bodies that stall ----------------------------------------------------------


async def _start_body(port: int, path: str, length: int, first: bytes) -> tuple[asyncio.StreamReader, Any]:
    """Open a raw connection and send a POST's head (``Content-Length: length``) and ``first`` bytes of its body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    writer.write(head.encode() + first)
    await writer.drain()
    return reader, writer


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-cased names) and body of the answer on a raw connection (15 s at most)."""
    status_line = await asyncio.wait_for(reader.readline(), 15)
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)).decode()
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head.split("\r\n") if ": " in line)}
    return int(status_line.split()[1]), headers, await reader.readexactly(int(headers["content-length"]))


async def _until(condition: Any, what: str) -> None:
    """Wait for ``condition()`` (the server's side of a raw connection), failing after 15 s."""
    for _ in range(1500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_bodies_held_at_once_are_capped_with_503_and_retry_after() -> None:
    """Nothing capped the request bodies held at once: N clients each sending a body just under the
    limit made the server hold N times the limit. Now a body that would take the bytes held past
    ``max_buffered_bytes`` gets 503 with ``Retry-After`` (the store's error shape, OTLP's ``Status``
    on ``/v1/traces``), and the bytes are given back once a body is answered."""
    limit = 64 * 1024
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(
            store, port=free_port(), max_body_bytes=limit, max_buffered_bytes=limit + 1000
        )
        async with server, httpx.AsyncClient(base_url=server.endpoint) as client:
            reads = server.app.state.body_reads
            sent = b"[" + b" " * (limit - 102)  # all but the last 99 bytes, then it stalls
            reader, writer = await _start_body(server.port, "/v1/agl/queues/rollouts/enqueue", limit - 100, sent)
            await _until(lambda: reads.held_bytes == len(sent), "the stalled body's bytes counted")
            second = b"[" + b" " * 2000 + b"]"
            r = await client.post("/v1/agl/queues/rollouts/enqueue", content=second, headers=JSON)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error_type"] == "ServiceUnavailableError" and r.json()["retryable"] is True
            assert f"limit of {limit + 1000} bytes held at once" in r.json()["detail"], r.text
            r = await client.post("/v1/traces", content=b"\x00" * 2000, headers=PB)
            assert r.status_code == 503 and _status(r, PB["Content-Type"]).code == code_pb2.UNAVAILABLE
            writer.close()  # the client goes away: its bytes are given back
            await _until(lambda: reads.held_bytes == 0, "the bytes given back")
            r = await client.post("/v1/agl/queues/rollouts/enqueue", content=second, headers=JSON)
            assert r.status_code != 503, r.text  # taken (and answered for what it says)
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        agl.LightningStoreServer(store, max_body_bytes=limit, max_buffered_bytes=limit - 1)


async def test_an_otlp_gzip_body_counts_its_inflated_copy_with_the_bodies_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTLP inflated a gzip body into a copy of up to ``max_body_bytes`` that the cap on the body
    bytes held at once did not count: clients each sending a small gzip body that inflates near the
    limit made the server hold that many copies. The inflated bytes now count against
    ``max_buffered_bytes`` until the request is answered: 503 with ``Retry-After`` when they would
    pass it, and given back either way."""
    import eventlight.server.otlp as otlp_route

    limit = 64 * 1024
    inflated = b'{"resourceSpans": []}' + b" " * (limit - 1000)  # OTLP/JSON padded with whitespace
    body = gzip.compress(inflated)
    headers = {**JSON, "Content-Encoding": "gzip"}
    held_in_ingest: list[int] = []
    real_ingest = otlp_route.ingest

    async def ingest(store: Any, spans: Any) -> Any:
        held_in_ingest.append(reads.held_bytes)
        return await real_ingest(store, spans)

    monkeypatch.setattr(otlp_route, "ingest", ingest)
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(
            store, port=free_port(), max_body_bytes=limit, max_buffered_bytes=limit + 1000
        )
        async with server, httpx.AsyncClient(base_url=server.endpoint) as client:
            reads = server.app.state.body_reads
            r = await client.post("/v1/traces", content=body, headers=headers)
            assert r.status_code == 200, r.content
            assert held_in_ingest == [len(body) + len(inflated)]  # the body and its inflated copy
            assert reads.held_bytes == 0
            sent = b"[" + b" " * (limit - 102)
            reader, writer = await _start_body(server.port, "/v1/agl/queues/rollouts/enqueue", limit - 100, sent)
            await _until(lambda: reads.held_bytes == len(sent), "the stalled body's bytes counted")
            r = await client.post("/v1/traces", content=body, headers=headers)  # its body fits, its copy not
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.content
            answer = _status(r, JSON["Content-Type"])
            assert answer.code == code_pb2.UNAVAILABLE and "max_buffered_bytes" in answer.message, answer
            assert reads.held_bytes == len(sent)  # what it inflated before the refusal given back
            writer.close()
            await _until(lambda: reads.held_bytes == 0, "the bytes given back")
    assert len(held_in_ingest) == 1


async def test_a_body_that_stalls_gets_408_and_its_connection_closed() -> None:
    """uvicorn has no body-read timeout: a client that sent its headers and a few bytes of its body,
    then nothing, held its request for ever (here: no answer within 15 s). Now ``body_timeout_s``
    without a byte answers 408 in the store's error shape and closes the connection."""
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(store, port=free_port(), body_timeout_s=0.2)
        async with server:
            reader, writer = await _start_body(server.port, "/v1/agl/queues/rollouts/enqueue", 1000, b"[{")
            try:
                status, headers, body = await _read_answer(reader)
                assert await asyncio.wait_for(reader.read(), 15) == b""  # closed by the server
            finally:
                writer.close()
            assert server.app.state.body_reads.held_bytes == 0
    assert status == 408 and headers["connection"] == "close", (status, headers, body)
    answer = json.loads(body)
    assert answer["error_type"] == "RequestTimeout" and answer["retryable"] is True, answer
    assert "no byte of the request body came for 0.2 s (2 of 1000 bytes read)" in answer["detail"], answer


async def test_stop_answers_a_request_still_sending_its_body_503_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``eventlight serve`` stopped (SIGTERM) while a client was still sending a body: nothing
    answered it until uvicorn's shutdown timeout cancelled it with "Exception in ASGI application"
    and a traceback. Now it answers 503 ``ServiceUnavailableError`` (retryable) before that. (peer_failures C06)"""
    import eventlight.server.serving as serving

    monkeypatch.setattr(serving, "_CUT_READS_AFTER_S", 0.5)
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(store, port=free_port())
        await server.start()
        reader, writer = await _start_body(server.port, "/v1/agl/queues/rollouts/enqueue", 1000, b"[{")
        try:
            await _until(lambda: server.app.state.body_reads.reading == 1, "the body read in progress")
            with caplog.at_level(logging.INFO):
                await server.stop()
                status, _, body = await _read_answer(reader)
        finally:
            writer.close()
            await server.stop()
    answer = json.loads(body)
    assert status == 503 and answer["error_type"] == "ServiceUnavailableError" and answer["retryable"], answer
    assert "stopped while the request body was still arriving (2 of 1000 bytes read)" in answer["detail"], answer
    assert "Exception in ASGI application" not in caplog.text and "Traceback" not in caplog.text


def test_a_408_still_there_after_the_retries_is_a_service_unavailable_error() -> None:
    """``BodyLimit``'s 408 (``RequestTimeout``, no eventlight error class of that name) reaches a
    ``LightningStoreClient`` caller as the retryable ``ServiceUnavailableError``, not a bare
    ``EventlightError``."""
    from eventlight.core.errors import ServiceUnavailableError
    from eventlight.server.transport import _error

    body = b'{"detail": "no body byte for 30 s", "error_type": "RequestTimeout", "retryable": true}'
    error = _error(408, body, "POST /v1/agl/rollouts", "http://127.0.0.1:1")
    assert isinstance(error, ServiceUnavailableError), type(error)
    assert "no body byte for 30 s" in str(error)


async def test_stop_cutting_reads_meets_a_body_timeout_that_just_fired() -> None:
    """``BodyReads.cut`` (``stop`` after 4 s) brought each read's deadline forward with
    ``Timeout.reschedule``; a read whose own body timeout had fired in the same turn of the event
    loop (its deadline expiring, its task not yet resumed) made that raise ``RuntimeError`` out of
    ``stop``, and the server was neither cut nor cancelled. Now an expiring read is left to end."""
    from eventlight.server.limits import BodyReads

    reads = BodyReads()
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []

    async def read() -> str:
        try:
            async with asyncio.timeout_at(loop.time()) as deadline:  # due: it fires at the loop's next turn
                with reads.reading_under(deadline):
                    await asyncio.sleep(60)
        except TimeoutError:
            return "timed out"
        return "read"

    def cut() -> None:
        try:
            reads.cut()
        except RuntimeError as e:
            errors.append(e)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0)  # the read is under way, its timeout queued to fire
    assert reads.reading == 1
    loop.call_soon(cut)  # right after the timeout fires, before the read's task resumes
    assert await reader == "timed out"
    assert errors == [] and reads.cut_off and reads.reading == 0


async def test_a_request_that_sends_no_byte_of_its_body_gets_408() -> None:
    """The body timeout's first deadline was given to ``asyncio.timeout`` (a delay) as a time of the
    event loop's clock, so it fell hours away (the clock's reading, seconds since boot, plus 30 s):
    a client that sent its head (``Content-Length: 1000``) and then no byte at all was never timed
    out, and its 1000 bytes stayed held against ``max_buffered_bytes``."""
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(store, port=free_port(), body_timeout_s=0.2)
        async with server:
            reader, writer = await _start_body(server.port, "/v1/agl/queues/rollouts/enqueue", 1000, b"")
            try:
                status, headers, body = await _read_answer(reader)
            finally:
                writer.close()
            await _until(lambda: server.app.state.body_reads.held_bytes == 0, "the bytes given back")
    assert status == 408 and headers["connection"] == "close", (status, headers, body)
    assert "no byte of the request body came for 0.2 s (0 of 1000 bytes read)" in json.loads(body)["detail"]


async def test_a_body_trickling_in_under_the_idle_timeout_gets_408() -> None:
    """A client sending a byte of its body every ``body_timeout_s`` less a little (slowloris) never
    tripped the idle timeout and held its request, and its bytes against ``max_buffered_bytes``, for
    ever (here: 600 bytes a byte per 20 ms, 12 s, were read whole). Now a body ``body_timeout_s``
    behind ``body_min_bytes_per_s`` answers 408 in the store's error shape and closes the connection."""
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(store, port=free_port(), body_timeout_s=2, body_min_bytes_per_s=1000)
        async with server:
            path = "/v1/agl/queues/rollouts/enqueue"  # 50 bytes/s below, a byte well inside 2 s
            answer = await trickle_post(server.port, path, first=b"", piece=b" ", count=600, every_s=0.02)
            await _until(lambda: server.app.state.body_reads.held_bytes == 0, "the bytes given back")
    assert answer.status == 408 and answer.headers["connection"] == "close" and answer.closed, answer
    error = json.loads(answer.body)
    assert error["error_type"] == "RequestTimeout" and error["retryable"] is True, error
    assert "came slower than 1000 bytes/s" in error["detail"], error
    assert "the server's minimum body rate" in error["detail"], error


async def test_a_body_at_the_minimum_rate_is_taken_past_body_timeout_s() -> None:
    """The minimum rate is an average with ``body_timeout_s`` of slack, not a deadline of
    ``body_timeout_s`` for the whole body: a body coming at twice the rate is read whole though it
    takes three times ``body_timeout_s``."""
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(store, port=free_port(), body_timeout_s=0.5, body_min_bytes_per_s=100)
        async with server:
            answer = await trickle_post(  # 200 bytes/s for 1.5 s
                server.port,
                "/v1/agl/queues/rollouts/enqueue",
                first=b'{"rollouts": [{"input": 1}]',
                piece=b" " * 10,
                count=30,
                every_s=0.05,
                last=b"}",
            )
            queued = await store.query_rollouts()
    assert answer.status == 201, answer
    assert [r.input for r in queued] == [1]


async def test_slow_clients_declaring_large_bodies_do_not_lock_out_the_others() -> None:
    """A body counted its whole declared ``Content-Length`` from its first byte, while the timeout
    asks only one byte per ``body_timeout_s``: ``max_buffered_bytes / max_body_bytes`` clients
    declaring bodies at the limit and sending a byte now and then got every other body request 503.
    Only the bytes that came are held now: a small request goes through beside them."""
    limit = 4096
    async with agl.InMemoryLightningStore() as store:
        server = agl.LightningStoreServer(
            store, port=free_port(), max_body_bytes=limit, max_buffered_bytes=2 * limit, body_timeout_s=30
        )
        async with server, httpx.AsyncClient(base_url=server.endpoint) as client:
            reads = server.app.state.body_reads
            slow = [await _start_body(server.port, "/v1/agl/queues/rollouts/enqueue", limit, b"[") for _ in range(2)]
            try:
                await _until(lambda: reads.reading == 2, "the slow bodies read")
                for _, writer in slow:  # a byte each, well inside the body timeout
                    writer.write(b" ")
                    await writer.drain()
                await _until(lambda: reads.held_bytes == 4, "their bytes counted as they came")
                r = await client.post("/v1/agl/queues/rollouts/enqueue", content=b"[]", headers=JSON)
                assert r.status_code != 503 and "held at once" not in r.text, r.text  # taken, answered for what it says
            finally:
                for _, writer in slow:
                    writer.close()
            await _until(lambda: reads.held_bytes == 0, "the bytes given back")


NULL_WHEN_MISSING = ["/rollouts/{rollout_id}", "/workers/{worker_id}", "/resources/{resources_id}", "/resources/latest"]


async def test_a_get_of_an_unknown_id_answers_null_and_under_an_unknown_rollout_404(
    http: httpx.AsyncClient,
) -> None:
    """``GET /rollouts/<unknown>`` answered ``null`` while ``/attempts`` of the same id answered 404
    (a fresh user). Both as Agent-lightning: its server answers a missing entity's GET with 200
    ``null`` (``get_rollout_by_id`` returns ``Optional``; seed_store_types.md §5.2), and its docs
    have ``query_attempts`` raise for an unknown rollout."""
    ids = {"rollout_id": "ro-nope", "worker_id": "w-nope", "resources_id": "rs-nope"}
    for route in NULL_WHEN_MISSING:
        got = await http.get("/v1/agl" + route.format(**ids))
        assert (got.status_code, got.json()) == (200, None), route
    for path in ["/rollouts/ro-nope/attempts", "/rollouts/ro-nope/attempts/latest", "/spans?rollout_id=ro-nope"]:
        got = await http.get("/v1/agl" + path)
        assert got.status_code == 404 and got.json()["error_type"] == "RolloutNotFoundError", path


def test_the_readme_says_which_gets_answer_null() -> None:
    """README.md said "404 unknown id" only, which ``GET /rollouts/<unknown>`` (200 ``null``) is not."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    said = re.search(r"A GET of one thing by its id that does not exist \((.*?)\) answers 200 `null`", readme, re.S)
    assert said is not None, "README.md does not say which GETs answer null"
    assert all(f"`{route}`" in said.group(1) for route in NULL_WHEN_MISSING), said.group(1)
