"""Replay and rebuild speed over a log of >= 100,000 spans, against nats-py reading the same log.

    python -m bench.replay [--rollouts 1000] [--batches 10] [--spans-per-batch 10] [--no-rebuild]

Raw and the read-only replay are the best of ``--repeat`` runs (shared cores are noisy). Uses
``EVENTLIGHT_NATS_URL`` / ``EVENTLIGHT_PG_DSN`` (or the servers ``eventlight up`` left) and a
fresh namespace, dropped at the end. The log: per rollout, enqueue → claim → span batches (LLM
call spans with token ids and a reward span) → succeeded. Then, in the same run:

* **raw**: nats-py alone, an ordered consumer over the stream, counting messages (the ceiling a
  reader of this log in Python has);
* **replay**: ``eventlight.replay`` (read, fold, decode the selected attempts' spans, adapt, build
  records; records are not written) with a trivial adapter (``read``: one record per attempt, the
  replay's own cost) and with the ``triplets`` and ``messages`` adapters, in this process and with
  ``--workers`` adapter processes (``eventlight replay``'s default: the CPUs, at most 8);
* **rebuild**: ``eventlight replay --rebuild``'s work (the whole log into a fresh schema + compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from eventlight.core.events import SpansAdded, encode_event
from eventlight.core.types import Span
from eventlight.logreplay.parallel import default_workers


def _spans(rid: str, aid: str, batch: int, per_batch: int) -> list[Span]:
    out = []
    for j in range(per_batch):
        seq = batch * per_batch + j + 1
        if j == per_batch - 1:
            attrs: dict[str, Any] = {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 0.5}
            name = "agentlightning.annotation"
        else:
            attrs = {
                "gen_ai.request.model": "bench",
                "gen_ai.prompt.0.role": "user",
                "gen_ai.prompt.0.content": f"question {seq}",
                "gen_ai.completion.0.role": "assistant",
                "gen_ai.completion.0.content": f"answer {seq}",
                "gen_ai.response.id": f"{aid}-{seq}",
                "gen_ai.usage.prompt_tokens": 12,
                "gen_ai.usage.completion_tokens": 5,
                "prompt_token_ids": list(range(12)),
                "response_token_ids": list(range(5)),
            }
            name = "openai.chat.completion"
        out.append(
            Span.from_attributes(
                attributes=attrs,
                rollout_id=rid,
                attempt_id=aid,
                sequence_id=seq,
                name=name,
                start_time=1000.0 + seq,
                end_time=1000.5 + seq,
            )
        )
    return out


async def build_log(store: Any, rollouts: int, batches: int, per_batch: int) -> None:
    """Rollout events through the store API; span batches published straight to the stream (the
    shape the span writer gives them), many in flight."""
    log_ = store.log
    sem = asyncio.Semaphore(64)

    async def one() -> None:
        async with sem:
            r = await store.enqueue_rollout({"q": 1}, mode="train")
            d = await store.start_attempt(r.rollout_id, worker_id="bench")
            aid = d.attempt.attempt_id
            for b in range(batches):
                ev = SpansAdded(
                    time=time.time(),
                    rollout_id=r.rollout_id,
                    attempt_id=aid,
                    spans=_spans(r.rollout_id, aid, b, per_batch),
                    seq_high=(b + 1) * per_batch,
                )
                await log_.js.publish(f"{log_.prefix}.s.{r.rollout_id}.{aid}", encode_event(ev))
            await store.update_attempt(r.rollout_id, aid, status="succeeded")

    await asyncio.gather(*(one() for _ in range(rollouts)))


def _count_spans(spans: list[Span]) -> list[dict[str, int]]:
    """The replay's own work without an adapter's: read, fold, decode and order each attempt's spans."""
    return [{"spans": len(spans)}]


async def raw_consume(nats_url: str, stream: str, prefix: str) -> tuple[int, float]:
    """nats-py alone: an ordered consumer over the whole stream; (messages, seconds)."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        t0 = time.perf_counter()
        sub = await js.subscribe(f"{prefix}.>", ordered_consumer=True, stream=stream)
        n = 0
        async for msg in sub.messages:  # the fastest nats-py loop (next_msg adds a task per message)
            n += 1
            if msg.metadata.num_pending == 0:
                break
        seconds = time.perf_counter() - t0
        await sub.unsubscribe()
        return n, seconds
    finally:
        await nc.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import eventlight
    from eventlight.cli import _need_nats, _need_pg
    from eventlight.logreplay.rebuild import rebuild
    from eventlight.ops import apply_migrations, apply_streams, drop_namespace
    from eventlight.settings import Settings
    from eventlight.store.jetstream import JetStreamLightningStore
    from eventlight.store.jetstream.connect import connect_nats

    base = Settings.from_env(namespace=f"bench{uuid.uuid4().hex[:8]}")
    nats_url = str((await _need_nats(base)).url)
    pg_dsn = str((await _need_pg(base)).url)
    settings = Settings(nats_url=nats_url, pg_dsn=pg_dsn, namespace=base.namespace, state_dir=base.state_dir)
    nc = await connect_nats(nats_url)
    await apply_streams(nc, settings)
    await nc.close()
    await apply_migrations(pg_dsn, settings.pg_schema)
    out: dict[str, Any] = {"rollouts": args.rollouts, "spans_per_batch": args.spans_per_batch}
    try:
        t0 = time.perf_counter()
        async with JetStreamLightningStore(settings) as store:
            await build_log(store, args.rollouts, args.batches, args.spans_per_batch)
            info = await store.log.js.stream_info(store.log.stream)
        out["build_s"] = round(time.perf_counter() - t0, 2)
        out["messages"] = int(info.state.messages)
        out["spans"] = args.rollouts * args.batches * args.spans_per_batch
        best = [await raw_consume(nats_url, settings.stream_name, settings.subject_prefix) for _ in range(args.repeat)]
        n, seconds = min(best, key=lambda b: b[1])
        out["raw"] = {"messages": n, "s": round(seconds, 3), "events_per_s": round(n / seconds)}
        adapters: dict[str, tuple[Any, int]] = {
            "read": (_count_spans, 1),
            "triplets": ("triplets", 1),
            "messages": ("messages", 1),
            f"triplets_{args.workers}_workers": ("triplets", args.workers),
            f"messages_{args.workers}_workers": ("messages", args.workers),
        }
        for name, (adapter, workers) in adapters.items():
            if workers == 1 and name.endswith("_workers"):
                continue
            s = float("inf")
            for _ in range(args.repeat if name == "read" else 1):
                t0 = time.perf_counter()
                r = eventlight.replay(settings, adapter=adapter, workers=workers)
                records = 0
                async for _ in r:
                    records += 1
                s = min(s, time.perf_counter() - t0)
            out[f"replay_{name}"] = {
                "s": round(s, 3),
                "events_per_s": round(r.stats.events / s),
                "spans_per_s": round(r.stats.spans / s),
                "records_per_s": round(records / s),
                "records": records,
                "vs_raw": round((r.stats.events / s) / out["raw"]["events_per_s"], 3),
                "errors": len(r.errors),
            }
        if not args.no_rebuild:
            report = await rebuild(settings, pg_dsn)
            out["rebuild"] = {"s": round(report.seconds, 2), "to_seq": report.rebuilt_checkpoint}
    finally:
        import asyncpg

        conn = await asyncpg.connect(pg_dsn)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.pg_schema}_rebuild" CASCADE')
        await conn.close()
        await drop_namespace(nats_url, pg_dsn, settings)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--spans-per-batch", type=int, default=10)
    parser.add_argument("--no-rebuild", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="Best of N for raw and the read-only replay.")
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="Adapter processes of the parallel runs (the CLI's default).",
    )
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
