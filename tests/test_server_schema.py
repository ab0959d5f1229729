"""Schemathesis against ``eventlight serve``'s OpenAPI description (issue 16, bad input).

A real server (``LightningStoreServer`` over an in-memory store, on a thread with its own event
loop) takes requests generated from ``/openapi.json``: bodies and parameters of every shape and
type. Each answer must be no 5xx, a status code and a content type the description documents, a
body that matches the documented schema; and the server must still answer ``/v1/agl/health``
after each. Then, with a token configured, one request per operation without it: a documented
401 each. Examples are bounded (``MAX_EXAMPLES`` per operation and generation mode, positive and
negative) to keep the run well under 90 s on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from eventlight.net import free_port
from eventlight.server.app import create_app
from eventlight.server.otlp_wire import PROTOBUF
from eventlight.server.serving import LightningStoreServer
from eventlight.store.memory import InMemoryLightningStore

MAX_EXAMPLES = 15
TOKEN = "schema-test-token"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class ServerThread:
    """A ``LightningStoreServer`` on a loop of its own thread (the test's requests are blocking)."""

    def __init__(self, token: str | None):
        self.token = token
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with InMemoryLightningStore() as store:
            server = LightningStoreServer(store, "127.0.0.1", self.port, token=self.token)
            await server.start()
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await server.stop()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(30), "the server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(None) as running:
        yield running


@pytest.fixture(scope="module")
def sessions(server: ServerThread) -> Iterator[tuple[requests.Session, httpx.Client]]:
    """One connection pool for the generated requests, one for the health checks (a new client per
    request spent most of the run loading CA certificates)."""
    with requests.Session() as generated, httpx.Client(base_url=server.url, timeout=30) as health:
        yield generated, health


def _description() -> dict[str, Any]:
    """The served ``/openapi.json`` (the same with or without a token: it only adds a middleware)."""
    return dict(create_app(InMemoryLightningStore()).openapi())


# loaded eagerly: schemathesis' lazy ``from_fixture`` fails on pytest 9 (it reads ``node._nodeid``)
schema = schemathesis.openapi.from_dict(_description())
schema.config.generation.update(database="none")  # no .hypothesis folder written


@schemathesis.serializer(PROTOBUF)
def _protobuf(ctx: Any, value: Any) -> dict[str, Any]:
    """OTLP/protobuf bodies as generated: bytes (malformed protobuf, mostly) sent as they are."""
    return {"data": value if isinstance(value, bytes) else str(value).encode()}


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    phases=[Phase.explicit, Phase.generate],
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_generated_requests_get_documented_answers(
    case: Any, server: ServerThread, sessions: tuple[requests.Session, httpx.Client]
) -> None:
    generated, health = sessions
    response = case.call(base_url=server.url, session=generated, timeout=30)
    case.validate_response(response, checks=CHECKS)
    assert health.get("/v1/agl/health").status_code == 200, "the server stopped serving"


def test_without_the_token_every_operation_answers_the_documented_401() -> None:
    """With a token configured, one request per operation without it: a documented 401 each (the
    bodies do not matter, the middleware answers before any route), and the token opens them."""
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 25
    with ServerThread(TOKEN) as server:
        for operation in operations:
            case = operation.Case(path_parameters={k: "x" for k in _path_names(operation.path)})
            response = case.call(base_url=server.url, timeout=30)
            assert response.status_code == 401, (operation.label, response.status_code)
            case.validate_response(response, checks=CHECKS)
        opened = httpx.get(f"{server.url}/v1/agl/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert opened.status_code == 200


def _path_names(path: str) -> list[str]:
    return re.findall(r"{(\w+)}", path)
