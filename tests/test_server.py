"""``eventlight serve``: the store over HTTP, driven by eventlight's client and by Agent-lightning 0.3.0's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import eventlight as agl
from eventlight.core.errors import (
    AttemptNotFoundError,
    InvalidInputError,
    InvalidTransitionError,
    NotFoundError,
    RolloutNotFoundError,
    ServiceUnavailableError,
)
from eventlight.net import free_port
from eventlight.server.app import create_app
from eventlight.server.routes.workers import HEALTH_TIMEOUT_S
from eventlight.server.serving import PortInUseError, bind
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
from tests.faults import Relay

SCRIPTS = Path(__file__).parent / "server_scripts"


@pytest.fixture
async def served(namespace: Settings) -> AsyncIterator[tuple[JetStreamLightningStore, agl.LightningStoreServer]]:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        server = agl.LightningStoreServer(store, port=free_port(), identity={"instance": "srv-test", "ns": "x"})
        async with server:
            yield store, server


async def _stream_subjects(settings: Settings) -> list[str]:
    """Subjects of every message on the namespace's stream (the log itself)."""
    assert settings.nats_url is not None
    nc = await connect_nats(settings.nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(settings.stream_name)
        subjects = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(settings.stream_name, seq)
            subjects.append(str(msg.subject))
        return subjects
    finally:
        await nc.close()


async def test_client_drives_the_store_and_writes_are_events(served: tuple[JetStreamLightningStore, object]) -> None:
    store, server = served
    client = agl.LightningStoreClient(server.endpoint)  # type: ignore[attr-defined]
    try:
        assert (await client.health())["instance"] == "srv-test"
        res = await client.add_resources({"p": agl.PromptTemplate(template="x {a}")})
        rollout = await client.enqueue_rollout({"q": 1}, mode="train")
        assert rollout.resources_id == res.resources_id
        claimed = await client.dequeue_rollout(worker_id="w-1")
        assert claimed is not None and claimed.rollout_id == rollout.rollout_id
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        span = agl.Span.from_attributes(attributes={"k": 1}, rollout_id=rid, attempt_id=aid, name="s")
        [numbered] = await client.add_spans_numbered(rid, aid, [span])
        assert numbered.sequence_id == 1
        await client.update_attempt(rid, aid, status="succeeded")
        [done] = await client.wait_for_rollouts(rollout_ids=[rid], timeout=10)
        assert done.status == "succeeded"
        # the same facts, read by the store in-process, and on the stream as events of the rollout
        assert (await store.get_rollout_by_id(rid)).status == "succeeded"  # type: ignore[union-attr]
        assert [s.name for s in await store.query_spans(rid)] == ["s"]
        subjects = await _stream_subjects(store.settings)
        assert sum(rid in s for s in subjects) >= 3, subjects
        # errors come back as the tree
        with pytest.raises(AttemptNotFoundError):
            await client.update_attempt(rid, "at-00000000", status="failed")
        with pytest.raises(InvalidTransitionError):
            await client.update_attempt(rid, aid, status="running")
        with pytest.raises(RolloutNotFoundError) as info:
            await client.query_attempts("ro-000000000000")
        assert isinstance(info.value, NotFoundError) and isinstance(info.value, ValueError)
        assert await client.get_rollout_by_id("ro-000000000000") is None
        assert await client.dequeue_rollout() is None
        page = await client.query_rollouts(status_in=["succeeded"], limit=5)
        assert [r.rollout_id for r in page] == [rid] and page.total == 1 and page.limit == 5
        assert client.capabilities["otlp_traces"] and server.capabilities["otlp_traces"]  # type: ignore[attr-defined]
    finally:
        await client.close()


async def test_client_waits_longer_than_one_request(served: tuple[JetStreamLightningStore, object]) -> None:
    store, server = served
    client = agl.LightningStoreClient(server.endpoint)  # type: ignore[attr-defined]
    try:
        claimed = await store.start_rollout({"q": 2})

        async def finish_later() -> None:
            await asyncio.sleep(0.5)
            await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="failed")

        task = asyncio.create_task(finish_later())
        [done] = await client.wait_for_rollouts(rollout_ids=[claimed.rollout_id], timeout=30)
        await task
        assert done.status == "failed"
    finally:
        await client.close()


async def test_agent_lightning_client_works_unchanged(served: tuple[JetStreamLightningStore, object]) -> None:
    from bench.peer import ensure_peer, peer_env

    peer = ensure_peer(log=lambda _line: None)
    if peer.python is None:
        pytest.skip(f"no Agent-lightning 0.3.0 peer venv: {peer.error}")
    store, server = served
    proc = await asyncio.create_subprocess_exec(
        str(peer.python),
        str(SCRIPTS / "peer_client.py"),
        server.endpoint,  # type: ignore[attr-defined]
        env=peer_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-3000:]
    seen = json.loads(out.decode().strip().splitlines()[-1])
    res_id, version, latest_id, template = seen["resources"]
    assert (version, latest_id, template) == (2, res_id, "Yo {name}")
    first, second, third = seen["enqueued"]
    assert seen["enqueued_resources_id"] == res_id
    assert seen["dequeued"][0] == first and seen["dequeued"][2] == "preparing"
    span_id, duplicate, names, seq = seen["spans"]
    assert span_id and duplicate is None and names == ["peer.span"] and seq == 1
    assert seen["attempts"] == [2, 2, True]
    assert seen["waited"] == ["succeeded"] and seen["rollout"] == ["succeeded", "AttemptedRollout"]
    assert seen["missing"] == [None, None]
    assert seen["queuing"] == sorted([second, third])
    assert seen["workers"] == ["peer-worker"] and seen["worker_stats"] == {"cpu": 0.5}
    assert seen["unknown_attempt"] == 404
    assert seen["long_wait"].startswith("Timeout must be less than 0.1")
    # what the peer wrote is in the store (and so on the stream)
    rollout = await store.get_rollout_by_id(first)
    assert rollout is not None and rollout.status == "succeeded"
    assert [s.name for s in await store.query_spans(first)] == ["peer.span"]


async def test_second_server_on_a_taken_port_fails_at_once(served: tuple[object, object]) -> None:
    """peer_failures C05: a second server on a taken port fails at once and never reports healthy;
    the first one's health names its instance."""
    _, server = served
    async with agl.InMemoryLightningStore() as other:
        second = agl.LightningStoreServer(other, port=server.port)  # type: ignore[attr-defined]
        with pytest.raises(PortInUseError, match=f"port {server.port} .* already in use"):  # type: ignore[attr-defined]
            await asyncio.wait_for(second.start(), 5)
    async with httpx.AsyncClient() as http:  # the first one still serves
        health = (await http.get(f"{server.endpoint}/v1/agl/health")).json()  # type: ignore[attr-defined]
    assert health == {"status": "ok", "instance": "srv-test", "ns": "x"}


async def _health(http: httpx.AsyncClient, url: str, status: int, timeout_s: float = 15) -> dict:
    """The health answer, once it has ``status`` (NATS reconnects every second, Postgres on the next use)."""
    deadline = time.monotonic() + timeout_s
    while True:
        started = time.monotonic()
        r = await http.get(url)
        assert time.monotonic() - started < 4, "a health check must stay cheap (2 s per server at most)"
        if r.status_code == status or time.monotonic() > deadline:
            assert r.status_code == status, r.text
            return dict(r.json())
        await asyncio.sleep(0.2)


async def test_health_names_the_server_that_is_down(namespace: Settings) -> None:
    """``/v1/agl/health`` answered "ok" while the store's Postgres (or NATS) was down: now 503 naming
    it, as an ``ErrorBody`` the client raises as ``ServiceUnavailableError``; "ok" again once it is back."""
    assert namespace.nats_url is not None and namespace.pg_dsn is not None
    nats, pg = Relay(namespace.nats_url), Relay(namespace.pg_dsn)
    await nats.mend()
    await pg.mend()
    try:
        async with (
            JetStreamLightningStore(namespace, nats_url=nats.url, pg_dsn=pg.url) as store,
            agl.LightningStoreServer(store, port=free_port(), identity={"instance": "h"}) as server,
            httpx.AsyncClient() as http,
        ):
            url, client = f"{server.endpoint}/v1/agl/health", agl.LightningStoreClient(server.endpoint, retry_delays=())
            try:
                assert await _health(http, url, 200) == {"status": "ok", "instance": "h"}
                pg.cut()
                down = await _health(http, url, 503)
                assert (down["status"], down["instance"], list(down["down"])) == ("unavailable", "h", ["postgres"])
                assert down["error_type"] == "ServiceUnavailableError" and down["retryable"] is True
                assert down["detail"].startswith(f"postgres is down: postgresql://postgres@127.0.0.1:{pg.port}/")
                with pytest.raises(ServiceUnavailableError, match="postgres is down"):
                    await client.health()
                nats.cut()
                assert list((await _health(http, url, 503))["down"]) == ["nats", "postgres"]
                await pg.mend()
                assert list((await _health(http, url, 503))["down"]) == ["nats"]
                await nats.mend()
                assert await _health(http, url, 200) == {"status": "ok", "instance": "h"}
                assert (await client.health())["status"] == "ok"
            finally:
                await client.close()
    finally:
        nats.cut()
        pg.cut()


async def test_health_does_not_call_a_busy_postgres_down(namespace: Settings) -> None:
    """With every pooled connection busy longer than the probe's 2 s (``pg_sleep`` in each: a pool
    saturated under load), the probe waited for one, timed out and reported Postgres down
    ("TimeoutError()"). It now asks on a connection of its own; one that fails is still down."""
    store = await JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn).start()
    assert store.pool is not None and store.read_model is not None
    held = []
    try:
        with contextlib.suppress(TimeoutError):  # all the pool has left (the projector keeps its own)
            while True:
                held.append(await store.pool.acquire(timeout=0.5))
        assert held
        sleeping = [asyncio.create_task(conn.execute("SELECT pg_sleep(4)")) for conn in held]
        await asyncio.sleep(0.2)
        started = time.monotonic()
        assert await store.dependencies_down(HEALTH_TIMEOUT_S) == {}
        assert time.monotonic() - started < HEALTH_TIMEOUT_S
        dsn, store.read_model.server = store.read_model.server, f"postgresql://postgres@127.0.0.1:{free_port()}/x"
        try:  # its own connection refused: down, and says why
            down = await store.dependencies_down(HEALTH_TIMEOUT_S)
        finally:
            store.read_model.server = dsn
        assert "no pooled connection free within 0.25 s, and a new connection failed" in down["postgres"], down
        assert "ConnectionRefusedError" in down["postgres"], down
        await asyncio.gather(*sleeping)
    finally:
        for conn in held:
            await store.pool.release(conn)
        await store.close()


async def test_concurrent_health_probes_of_a_busy_postgres_open_one_connection(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the pool saturated, every probe opened a connection of its own: 30 health checks at
    once (a load balancer's, several monitors', the waiters of a timed-out ``sync``) were 30 new
    connections to a Postgres already under load, up to "too many clients" for everyone. Probes
    running together now share one."""
    from eventlight.store.jetstream.readmodel import waits

    real_connect = waits.pg_errors.connect
    open_now, peak, opened = 0, 0, 0

    class Counted:
        """The probe's connection, counted while open."""

        def __init__(self, conn: Any):
            self.conn = conn

        async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
            return await self.conn.fetchval(*args, **kwargs)

        async def close(self, **kwargs: Any) -> None:
            nonlocal open_now
            open_now -= 1
            await self.conn.close(**kwargs)

    async def counting_connect(*args: Any, **kwargs: Any) -> Any:
        nonlocal open_now, peak, opened
        conn = await real_connect(*args, **kwargs)
        opened += 1
        open_now += 1
        peak = max(peak, open_now)
        return Counted(conn)

    store = await JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn).start()
    assert store.pool is not None
    held = []
    try:
        with contextlib.suppress(TimeoutError):
            while True:
                held.append(await store.pool.acquire(timeout=0.5))
        sleeping = [asyncio.create_task(conn.execute("SELECT pg_sleep(3)")) for conn in held]
        await asyncio.sleep(0.2)
        monkeypatch.setattr(waits.pg_errors, "connect", counting_connect)
        answers = await asyncio.gather(*(store.dependencies_down(HEALTH_TIMEOUT_S) for _ in range(30)))
        assert answers == [{}] * 30
        assert (peak, open_now) == (1, 0), f"{opened} connections opened, {peak} at once"
        await asyncio.gather(*sleeping)
    finally:
        for conn in held:
            await store.pool.release(conn)
        await store.close()


async def test_health_of_the_in_memory_store_is_ok() -> None:
    async with agl.InMemoryLightningStore() as store:
        app = create_app(store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
            r = await http.get("/v1/agl/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "store": "InMemoryLightningStore"}


def test_cli_serve_on_a_taken_port_is_one_line_exit_1() -> None:
    """peer_failures C05: ``eventlight serve`` on a taken port exits 1 in one line saying so."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "eventlight.cli", "serve", "--backend", "memory", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().count("\n") == 0
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr and "--port" in done.stderr


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--token", ""], {}, "the token is empty"),
        (["--token", " "], {}, "the token is empty"),
        ([], {"EVENTLIGHT_SERVER_TOKEN": ""}, "the token is empty"),
        ([], {"EVENTLIGHT_SERVER_TOKEN_FILE": ""}, "the token is empty"),
        (["--token", "tok "], {}, "visible ASCII characters without spaces"),
        (["--token", "t\u00f6k"], {}, "visible ASCII characters without spaces"),
    ],
)
def test_cli_serve_with_an_empty_token_refuses_to_start(args: list[str], env: dict[str, str], says: str) -> None:
    """``--token "$UNSET"`` (or the variable set to nothing) is a mistake, not "no token": serving
    would open the store to anyone who can connect (a reviewer)."""
    done = subprocess.run(
        [sys.executable, "-m", "eventlight.cli", "serve", "--backend", "memory", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


def test_an_app_with_an_empty_token_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="token is empty"):
        create_app(agl.InMemoryLightningStore(), token="")
    with pytest.raises(InvalidInputError, match="without spaces"):
        create_app(agl.InMemoryLightningStore(), token="a\nb")


async def test_accepted_connections_have_nagle_off() -> None:
    """With Nagle's algorithm on, a response split in two writes on a kept-alive connection waits
    for the client's delayed ACK (~40 ms a request, measured); asyncio turns it off only on sockets
    created as TCP, so the listening socket must say it is one."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import socket

        seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = bind("127.0.0.1", free_port())
    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
    assert seen and seen[0] != 0, seen
