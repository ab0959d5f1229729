"""A 3-node nats-server cluster of a test's own, on loopback, for the replicated fault suite.

Each node is a ``faults.NatsServer`` with a cluster block naming the three route ports; data folders
live under the test's temporary folder, so a node killed with SIGKILL restarts on the same port
with what it had synced (``sync_interval: always``). Every wait here is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from faults import NatsServer
from nats.js.errors import NotFoundError

from eventlight.net import free_port
from eventlight.store.jetstream.connect import connect_nats


class Cluster:
    """Three nats-servers routed to each other; ``url`` names all three, comma-separated."""

    def __init__(self, home: Path, size: int = 3):
        routes = [free_port() for _ in range(size)]
        self.nodes = [NatsServer(home / f"n{i}", cluster=("elfaults", routes[i], routes)) for i in range(size)]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def node_named(self, server_name: str) -> NatsServer:
        """The node whose ``server_name`` (``n<port>``) is ``server_name``."""
        [node] = [n for n in self.nodes if f"n{n.port}" == server_name]
        return node

    async def start(self, timeout_s: float = 30) -> None:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            await node.ready()
        await self.jetstream_ready(timeout_s)

    async def jetstream_ready(self, timeout_s: float = 30) -> None:
        """Until JetStream answers account requests (its meta group has a leader)."""
        deadline = time.monotonic() + timeout_s
        nc = await connect_nats(self.url, reconnect=False, quiet=True)
        try:
            while True:
                try:
                    await nc.jetstream().account_info()
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.25)
        finally:
            await nc.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


async def stream_cluster(js: Any, stream: str) -> tuple[str | None, list[tuple[str, bool]]]:
    """The stream's leader (a server name) and its other replicas with whether each is current."""
    info = await js.stream_info(stream)
    cluster = info.cluster
    if cluster is None:
        return None, []
    return cluster.leader, [(r.name, bool(r.current)) for r in cluster.replicas or []]


async def wait_answered(js: Any, stream: str, timeout_s: float = 30) -> float:
    """Seconds until ``STREAM.INFO`` of ``stream`` is answered: with a leader, or "not found" (a
    namespace without that stream); while the cluster elects, the request goes unanswered."""
    t0 = time.monotonic()
    while True:
        try:
            leader, _ = await stream_cluster(js, stream)
            if leader:
                return time.monotonic() - t0
        except NotFoundError:
            return time.monotonic() - t0
        except Exception:  # a timeout or "no leader": not yet
            pass
        assert time.monotonic() - t0 < timeout_s, f"{stream}: STREAM.INFO not answered after {timeout_s} s"
        await asyncio.sleep(0.2)


async def wait_replicas_current(js: Any, stream: str, size: int, timeout_s: float = 30) -> float:
    """Seconds until the stream has a leader and ``size - 1`` current followers."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            leader, replicas = await stream_cluster(js, stream)
            if leader and len(replicas) == size - 1 and all(current for _, current in replicas):
                return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout_s, f"{stream}: replicas not current after {timeout_s} s"
        await asyncio.sleep(0.2)
