"""A subscriber killed with SIGKILL mid-stream and restarted with the same durable name.

A producer in this process finishes rollouts (a span with token ids and a reward each) at a steady
pace while ``tests/subscribe_child.py`` follows them with ``subscribe_triplets(durable="algo")``;
the test kills the child at seeded random moments and starts it again. Afterwards every finished
attempt is in the child's output (no gap), and a record appears twice only if it was the one in
hand at a kill, flagged ``redelivered`` (at most one per kill); the child that drops redeliveries
by position (``EL_SUB_DEDUP=1``) has no repeat at all. Prints its figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from tests.faults import KILLS
from tests.test_replay import llm_span, reward_span

pytestmark = pytest.mark.faults

N = 200
CHILD = Path(__file__).with_name("subscribe_child.py")


async def produce(settings: Settings, n: int, done: list[str]) -> None:
    """Finish ``n`` rollouts one after another, each a queue claim, two spans and a success."""
    async with JetStreamLightningStore(settings) as store:
        for i in range(n):
            r = await store.enqueue_rollout({"i": i})
            d = await store.dequeue_rollout(worker_id="w1")
            assert d is not None and d.rollout_id == r.rollout_id
            aid = d.attempt.attempt_id
            await store.add_many_spans([llm_span(r.rollout_id, aid, 1, str(i), 1.0)])
            await store.add_span(reward_span(r.rollout_id, aid, 2, 1.0, 3.0))
            await store.update_attempt(r.rollout_id, aid, status="succeeded")
            done.append(aid)
            await asyncio.sleep(0.02)


async def start_child(settings: Settings, out: Path, dedup: bool) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        "EL_SUB_NATS": settings.nats_url or "",
        "EL_SUB_NS": settings.namespace,
        "EL_SUB_OUT": str(out),
        "EL_SUB_DEDUP": "1" if dedup else "0",
    }
    proc = await asyncio.create_subprocess_exec(sys.executable, str(CHILD), env=env, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.startswith(b"ready"), line
    return proc


def read_lines(out: Path) -> list[dict[str, object]]:
    text = out.read_text() if out.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


@pytest.mark.parametrize("dedup", [False, True], ids=["ack-on-next", "dedup-by-position"])
async def test_subscriber_killed_and_restarted_has_no_gap_and_no_repeat(
    namespace: Settings, tmp_path: Path, dedup: bool
) -> None:
    out = tmp_path / "records.jsonl"
    rng = random.Random(15 + dedup)
    done: list[str] = []
    proc = await start_child(namespace, out, dedup)
    producer = asyncio.create_task(produce(namespace, N, done))
    figures: list[tuple[int, int]] = []
    try:
        for _ in range(KILLS):
            await asyncio.sleep(rng.uniform(0.3, 1.2))  # a moment independent of the child's output
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            before = len(read_lines(out))
            proc = await start_child(namespace, out, dedup)
            figures.append((before, len(done)))
        await asyncio.wait_for(producer, 240)
        deadline = time.monotonic() + 60
        while len({line["attempt_id"] for line in read_lines(out)}) < N and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)  # another process writes the file: nothing to wait on but the file
    finally:
        producer.cancel()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
    lines = read_lines(out)
    counts = Counter(str(line["attempt_id"]) for line in lines)
    gaps = set(done) - set(counts)
    repeats = [a for a, c in counts.items() if c > 1]
    unflagged = [a for a in repeats if not any(x["redelivered"] for x in lines if x["attempt_id"] == a)]
    positions = [int(str(line["position"])) for line in lines]
    print(
        f"\nsubscriber restart ({'dedup by position' if dedup else 'ack on next'}): {KILLS} kills; "
        f"records in the output before each kill {[b for b, _ in figures]}, attempts finished by then "
        f"{[d for _, d in figures]}; after: {len(lines)} records of {len(done)} attempts; "
        f"gaps {len(gaps)}, repeats {len(repeats)} (flagged redelivered: {len(repeats) - len(unflagged)})"
    )
    assert len(done) == N and not gaps
    assert not unflagged and len(repeats) <= KILLS
    assert all(c <= 2 for c in counts.values())
    assert all(int(str(line["triplets"])) == 1 for line in lines)
    if dedup:
        assert not repeats and positions == sorted(positions)
