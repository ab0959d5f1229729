"""How long after a deadline the watchdog acts: configured vs observed detection delay.

    python -m bench.watchdog_delay [--rollouts 8] [--deadline-s 2.0] [--interval-s 1.0]

Starts eventlight's servers in a temporary state dir (or uses ``EVENTLIGHT_PG_DSN`` /
``EVENTLIGHT_NATS_URL``), opens the algorithm's store (projector + watchdog in this process, looking
every ``--interval-s``) and a runner's write-only store, then for each case claims ``--rollouts``
rollouts at staggered moments and never touches them again:

* ``timeout``: ``RolloutConfig(timeout_seconds=deadline)``; delay counted from the attempt's start;
* ``unresponsive``: ``RolloutConfig(unresponsive_seconds=deadline)``, one span right after the claim;
  delay counted from that span's heartbeat.

The watchdog's verdict time is the rollout's ``end_time`` (``max_attempts=1``, so the verdict fails
the rollout). Nobody calls the store while waiting except ``wait_for_rollouts``, which only listens.
Expect ``deadline <= observed < deadline + interval`` (plus the projector's commit).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench import require_positive
from eventlight.core.types import RolloutConfig, Span
from eventlight.ops import prepare_services, stop_services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore


async def measure(settings: Settings, case: str, rollouts: int, deadline_s: float, interval_s: float) -> list[float]:
    config = (
        RolloutConfig(timeout_seconds=deadline_s)
        if case == "timeout"
        else RolloutConfig(unresponsive_seconds=deadline_s)
    )
    async with (
        JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn, watchdog_interval_s=interval_s) as algo,
        JetStreamLightningStore(settings) as runner,
    ):
        made = [await algo.enqueue_rollout(i, config=config) for i in range(rollouts)]
        since: dict[str, float] = {}
        rng = random.Random(case)
        for _ in made:
            await asyncio.sleep(rng.uniform(0, interval_s))  # sample every phase of the watchdog's period
            claimed = await runner.dequeue_rollout(worker_id="probe")
            assert claimed is not None
            since[claimed.rollout_id] = claimed.attempt.start_time
            if case == "unresponsive":
                span = Span.from_attributes(
                    attributes={}, rollout_id=claimed.rollout_id, attempt_id=claimed.attempt.attempt_id, sequence_id=1
                )
                since[claimed.rollout_id] = time.time()
                await runner.add_span(span)
        done = await algo.wait_for_rollouts(rollout_ids=list(since), timeout=deadline_s + 10 * interval_s + 10)
        missing = set(since) - {r.rollout_id for r in done}
        if missing:
            raise SystemExit(f"{case}: {len(missing)} rollouts were never judged by the watchdog")
        delays = []
        for r in done:
            attempt = await algo.get_latest_attempt(r.rollout_id)
            assert attempt is not None and attempt.status == case, (r.status, attempt)
            assert r.end_time is not None
            delays.append(r.end_time - since[r.rollout_id])
        return delays


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--deadline-s", type=float, default=2.0)
    ap.add_argument("--interval-s", type=float, default=1.0)
    args = ap.parse_args()
    require_positive(ap, args, "rollouts", "deadline_s", "interval_s")
    state = Path(tempfile.mkdtemp(prefix="elwatchdog-", dir=tempfile.gettempdir()))
    try:
        await run(args, state)
    finally:
        shutil.rmtree(state, ignore_errors=True)  # also when the servers did not start


async def run(args: argparse.Namespace, state: Path) -> None:
    """Both cases on embedded (or configured) servers with state dir ``state``, stopped at the end."""
    os.chmod(state, 0o755)  # Postgres runs as `postgres` when we are root
    settings = Settings.from_env(state_dir=state, namespace=f"w{uuid.uuid4().hex[:10]}", log_level="WARNING")
    services = await prepare_services(settings)
    settings = Settings(
        nats_url=services.nats_url, pg_dsn=services.pg_dsn, state_dir=state, namespace=settings.namespace
    )
    try:
        print(f"watchdog every {args.interval_s} s, deadline {args.deadline_s} s, {args.rollouts} rollouts per case")
        for case in ("timeout", "unresponsive"):
            delays = await measure(settings, case, args.rollouts, args.deadline_s, args.interval_s)
            print(
                f"{case:>12}: configured {args.deadline_s:.2f} s, observed min {min(delays):.2f} / "
                f"median {statistics.median(delays):.2f} / max {max(delays):.2f} s"
            )
    finally:
        await stop_services(settings)


if __name__ == "__main__":
    asyncio.run(main())
