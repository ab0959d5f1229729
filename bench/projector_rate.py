"""Projection rate: how fast a fresh projector catches up on a pre-filled stream.

    python -m bench.projector_rate [--rollouts 400] [--spans 20]

A write-only store (what a runner opens) fills a fresh namespace with ``--rollouts`` started
rollouts, ``--spans`` spans each (one batch per rollout) and a finish each, with no projector
running. Then a store with the projector starts, and the time until its checkpoint reaches the
stream's last sequence gives events/s (stream messages) and spans/s. Uses ``EVENTLIGHT_NATS_URL`` and
``EVENTLIGHT_PG_DSN`` when set, else the embedded services of a temporary state dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

from eventlight.core.types import Span
from eventlight.ops import apply_migrations, apply_streams, drop_namespace, ensure_services, stop_services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats


async def fill(settings: Settings, rollouts: int, spans: int) -> int:
    async with JetStreamLightningStore(settings) as writer:

        async def one(i: int) -> None:
            r = await writer.start_rollout({"i": i}, worker_id=f"w{i % 8}")
            aid = r.attempt.attempt_id
            batch = [
                Span.from_attributes(
                    attributes={"i": i, "k": k, "text": "x" * 200}, rollout_id=r.rollout_id, attempt_id=aid, name="s"
                )
                for k in range(spans)
            ]
            await writer.add_spans_numbered(r.rollout_id, aid, batch)
            await writer.update_attempt(r.rollout_id, aid, status="succeeded")

        for start in range(0, rollouts, 32):
            await asyncio.gather(*(one(i) for i in range(start, min(rollouts, start + 32))))
        info = await writer.log.js.stream_info(writer.log.stream)
        return int(info.state.last_seq)


async def catch_up(settings: Settings, last_seq: int) -> float:
    t0 = time.perf_counter()
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn, watchdog_interval_s=3600) as store:
        await store.sync(last_seq, timeout_s=600)
        return time.perf_counter() - t0


async def main_async(rollouts: int, spans: int) -> dict[str, float]:
    state = Path(tempfile.mkdtemp(prefix="eventlight-projrate-"))
    base = Settings.from_env(state_dir=state, namespace="projrate")
    svc = await ensure_services(base)
    settings = Settings(nats_url=svc.nats_url, pg_dsn=svc.pg_dsn, state_dir=state, namespace=f"p{uuid.uuid4().hex[:8]}")
    nc = await connect_nats(svc.nats_url)
    await apply_streams(nc, settings)
    await nc.close()
    await apply_migrations(svc.pg_dsn, settings.pg_schema)
    try:
        last = await fill(settings, rollouts, spans)
        secs = await catch_up(settings, last)
        return {
            "messages": last,
            "spans": rollouts * spans,
            "catchup_s": round(secs, 2),
            "messages_per_s": round(last / secs),
            "spans_per_s": round(rollouts * spans / secs),
        }
    finally:
        await drop_namespace(svc.nats_url, svc.pg_dsn, settings)
        await stop_services(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=400)
    ap.add_argument("--spans", type=int, default=20)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main_async(args.rollouts, args.spans))))


if __name__ == "__main__":
    main()
