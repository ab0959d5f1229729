"""The store over HTTP, side by side: ``eventlight serve`` against Agent-lightning 0.3.0's ``agl store``.

``python -m bench.http [--rollouts 300] [--concurrency 8] [--otlp-requests 100] [--spans-per-request 50]``

Starts, one after the other and each in its own process on a free port: ``eventlight serve``
(JetStream + Postgres: every write an fsynced event, read back from Postgres), ``eventlight serve
--backend memory``, and the peer's ``agl store --backend memory``. Against each, with the same
httpx client in this process:

* REST dequeue+update: ``rollouts`` are enqueued (not timed), then ``concurrency`` workers loop
  ``POST /queues/rollouts/dequeue`` then ``POST /rollouts/{id}/attempts/{id}`` (``succeeded``);
  requests/s counts both requests;
* OTLP ingestion: ``otlp-requests`` protobuf ``ExportTraceServiceRequest`` of ``spans-per-request``
  spans each (one attempt, ids in the resource), ``concurrency`` at a time; spans/s.

Prints one JSON line per server and a table. The machine's other load counts: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.peer import ensure_peer, peer_env
from eventlight.net import free_port

READY_S = 120.0


def _otlp_body(rollout_id: str, attempt_id: str, n_spans: int, batch: int) -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, value in (("agentlightning.rollout_id", rollout_id), ("agentlightning.attempt_id", attempt_id)):
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = key, value
    spans = rs.scope_spans.add().spans
    now = time.time_ns()
    for i in range(n_spans):
        span = spans.add()
        span.trace_id = (batch + 1).to_bytes(16, "big")
        span.span_id = (batch * n_spans + i + 1).to_bytes(8, "big")
        span.name = "bench.span"
        span.start_time_unix_nano, span.end_time_unix_nano = now, now + 1000
        kv = span.attributes.add()
        kv.key, kv.value.int_value = "i", i
    return request.SerializeToString()


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_S
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if (await http.get(f"{url}/v1/agl/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {READY_S} s")


async def _rest(http: httpx.AsyncClient, n: int, concurrency: int) -> float:
    for start in range(0, n, 50):
        items = [{"input": {"i": i}} for i in range(start, min(n, start + 50))]
        (await http.post("/v1/agl/queues/rollouts/enqueue", json={"rollouts": items})).raise_for_status()
    done = 0

    async def worker(k: int) -> None:
        nonlocal done
        while True:
            r = await http.post("/v1/agl/queues/rollouts/dequeue", json={"limit": 1, "worker_id": f"w{k}"})
            r.raise_for_status()
            claimed = r.json()
            if not claimed:
                return
            rid, aid = claimed[0]["rollout_id"], claimed[0]["attempt"]["attempt_id"]
            (await http.post(f"/v1/agl/rollouts/{rid}/attempts/{aid}", json={"status": "succeeded"})).raise_for_status()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    assert done == n, f"{done} of {n} rollouts went through"
    return 2 * n / elapsed


async def _otlp(http: httpx.AsyncClient, n_requests: int, n_spans: int, concurrency: int) -> float:
    r = await http.post("/v1/agl/rollouts", json={"input": {"otlp": True}})
    r.raise_for_status()
    rid, aid = r.json()["rollout_id"], r.json()["attempt"]["attempt_id"]
    bodies = [_otlp_body(rid, aid, n_spans, b) for b in range(n_requests)]
    queue = list(reversed(bodies))

    async def sender() -> None:
        while queue:
            body = queue.pop()
            resp = await http.post("/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"})
            resp.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    page = (await http.post("/v1/agl/spans/search", json={"rollout_id": rid, "limit": 1})).json()
    assert page["total"] == n_requests * n_spans, f"{page['total']} of {n_requests * n_spans} spans stored"
    return n_requests * n_spans / elapsed


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def measure(
    name: str, argv: list[str], env: dict[str, str], port: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Start one server, run both workloads against it, stop it."""
    url = f"http://127.0.0.1:{port}"
    proc = _start(argv, env)
    try:
        await _wait_ready(url, proc)
        limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            rest = await _rest(http, args.rollouts, args.concurrency)
            otlp = await _otlp(http, args.otlp_requests, args.spans_per_request, args.concurrency)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"server": name, "rest_requests_per_s": round(rest, 1), "otlp_spans_per_s": round(otlp, 1)}


def _servers(namespace: str) -> list[tuple[str, list[str], dict[str, str], int]]:
    eventlight = [sys.executable, "-m", "eventlight.cli", "serve", "-N", namespace]
    env = dict(os.environ, EVENTLIGHT_LOG_LEVEL="WARNING")
    out = []
    p1, p2 = free_port(), free_port()
    out.append(("eventlight serve (jetstream)", [*eventlight, "--port", str(p1)], env, p1))
    out.append(("eventlight serve (memory)", [*eventlight, "--backend", "memory", "--port", str(p2)], env, p2))
    peer = ensure_peer(log=lambda line: print(line, file=sys.stderr))
    if peer.python is None:
        print(f"no Agent-lightning 0.3.0 peer venv: {peer.error}", file=sys.stderr)
        return out
    p3 = free_port()
    agl = str(Path(peer.python).parent / "agl")
    argv = [agl, "store", "--host", "127.0.0.1", "--port", str(p3), "--backend", "memory", "--log-level", "WARNING"]
    out.append(("agentlightning 0.3.0 agl store (memory)", argv, peer_env(), p3))
    return out


async def main(args: argparse.Namespace) -> None:
    from eventlight.ops import drop_namespace, prepare_services, stop_services
    from eventlight.settings import Settings

    settings = Settings.from_env(namespace=args.namespace)
    services = await prepare_services(settings)
    os.environ["EVENTLIGHT_NATS_URL"], os.environ["EVENTLIGHT_PG_DSN"] = services.nats_url, services.pg_dsn
    rows = []
    try:
        for name, argv, env, port in _servers(args.namespace):
            env = dict(env, EVENTLIGHT_NATS_URL=services.nats_url, EVENTLIGHT_PG_DSN=services.pg_dsn)
            row = await measure(name, argv, env, port, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        await drop_namespace(services.nats_url, services.pg_dsn, settings)
        if services.started:
            await stop_services(settings)
    print(f"\n{'server':44} {'REST dequeue+update req/s':>26} {'OTLP spans/s':>14}")
    for row in rows:
        print(f"{row['server']:44} {row['rest_requests_per_s']:>26} {row['otlp_spans_per_s']:>14}")
    print(f"({args.rollouts} rollouts, {args.otlp_requests} OTLP requests of {args.spans_per_request} spans, "
          f"{args.concurrency} concurrent; load average {os.getloadavg()[0]:.1f})")  # fmt: skip


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.http", description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--otlp-requests", type=int, default=100)
    p.add_argument("--spans-per-request", type=int, default=50)
    p.add_argument("--namespace", default=f"bench_http_{int(time.time())}", help="a fresh one, dropped at the end")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(_args()))
