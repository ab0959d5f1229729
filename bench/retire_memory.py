"""nats-server memory as finished rollouts accumulate, without and with retirement (issue 14).

    python -m bench.retire_memory [--rounds 5] [--per-round 10000] [--out FILE.json]

Two runs on fresh embedded servers (as ``bench.growth``): ``hot only`` (the default settings) and
``retire`` (``retention_s=0``: the archive stream exists, and after each round ``retire`` moves the
round's rollouts out of the hot stream). Each round publishes ``--per-round`` finished rollouts
(the four events of ``bench.growth``'s preload, pipelined) and waits for the projector; then the
nats-server's RSS and the hot and archive streams' subject counts are read. The slope of RSS over
stored rollouts is the per-rollout cost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from bench import require_positive
from bench.growth import WINDOW, _finished_rollout
from bench.report import print_and_save
from bench.stack_eventlight import Stack, stream_subjects
from eventlight.core.events import encode_event
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.archive import archive_lag
from eventlight.store.jetstream.layout import subject_for
from eventlight.store.jetstream.retire import retire

MB = 1024 * 1024


async def _publish(alg: JetStreamLightningStore, start: int, n: int) -> None:
    log_ = alg._log()
    js = log_.nc.jetstream(timeout=60.0, publish_async_max_pending=WINDOW)
    now = time.time()
    for i in range(start, start + n):
        for event in _finished_rollout(i, now):
            await js.publish_async(subject_for(log_.prefix, event), encode_event(event))
    await js.publish_async_completed()
    await alg.sync_all(timeout_s=600.0)


async def _caught_up(alg: JetStreamLightningStore) -> None:
    log_ = alg._log()
    for _ in range(6000):  # the archive sources asynchronously: poll its position, at most 10 minutes
        if await archive_lag(log_) == 0:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the archive stayed {await archive_lag(log_):,} positions behind")


async def one_run(rounds: int, per_round: int, retiring: bool) -> list[dict[str, Any]]:
    stack = Stack()
    stack.settings_overrides = {"retention_s": 0.0} if retiring else {}
    await stack.start()
    rows: list[dict[str, Any]] = []
    try:
        assert stack.services is not None and stack.settings is not None
        nats = psutil.Process(stack.services.nats_pid)
        alg = await stack.open_store()
        try:
            rows.append({"stored_rollouts": 0, "nats_rss_mb": round(nats.memory_info().rss / MB, 1)})
            for r in range(rounds):
                t0 = time.perf_counter()
                await _publish(alg, r * per_round, per_round)
                row: dict[str, Any] = {
                    "stored_rollouts": (r + 1) * per_round,
                    "publish_s": round(time.perf_counter() - t0, 1),
                }
                if retiring:
                    await _caught_up(alg)
                    report = await retire(alg.log, alg.pool, stack.settings, now=time.time() + 1)
                    row |= {"retired": report.retired, "retire_s": round(report.seconds, 1)}
                gc.collect()
                await asyncio.sleep(2.0)  # let the server settle
                row["nats_rss_mb"] = round(nats.memory_info().rss / MB, 1)
                row["hot_subjects"] = await stream_subjects(alg, stack.settings.stream_name)
                row["archive_subjects"] = await stream_subjects(alg, stack.settings.archive_stream_name)
                rows.append(row)
                print(f"  {'retire' if retiring else 'hot only'}: {row}")
        finally:
            await alg.close()
    finally:
        await stack.stop()
    return rows


def _per_rollout_kb(rows: list[dict[str, Any]]) -> float:
    first, last = rows[1], rows[-1]  # from the first round on: the empty server's start-up is not a rollout's
    n = last["stored_rollouts"] - first["stored_rollouts"]
    return round((last["nats_rss_mb"] - first["nats_rss_mb"]) * 1024 / n, 2) if n else float("nan")


def report(result: dict[str, Any]) -> str:
    lines = [
        "| run | stored rollouts | nats-server RSS MB | hot subjects | archive subjects |",
        "|---|---|---|---|---|",
    ]
    for name, rows in result["runs"].items():
        for row in rows:
            lines.append(
                f"| {name} | {row['stored_rollouts']:,} | {row['nats_rss_mb']} | {row.get('hot_subjects', '')} | "
                f"{row.get('archive_subjects', '') or ''} |"
            )
    lines.append("")
    for name, kb in result["per_rollout_kb"].items():
        lines.append(f"{name}: {kb} KB of nats-server RSS per stored rollout (slope from round 1 to the last)")
    return "\n".join(lines)


async def run(rounds: int, per_round: int) -> dict[str, Any]:
    runs = {"hot only": await one_run(rounds, per_round, False), "retire": await one_run(rounds, per_round, True)}
    return {"runs": runs, "per_rollout_kb": {k: _per_rollout_kb(v) for k, v in runs.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.retire_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "rounds", "per_round")
    result = asyncio.run(run(args.rounds, args.per_round))
    print_and_save(report(result), msgspec.to_builtins(result), args.out)


if __name__ == "__main__":
    main()
