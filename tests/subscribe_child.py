"""A subscriber alone in its process, for the kill -9 restart test (``tests/test_subscribe_restart.py``).

Subscribes with the durable name ``algo`` (triplets) and appends one JSON line per record to
``EL_SUB_OUT`` (flushed and fsynced) before asking for the next one. With ``EL_SUB_DEDUP=1`` it
keeps its effect exactly-once the documented way: it reads the last position it wrote and drops a
record at or before it (a record redelivered after a kill that came between its write and its ack).
Prints ``ready`` once the subscription stands. Reads ``EL_SUB_NATS``, ``EL_SUB_NS``, ``EL_SUB_OUT``.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore


def last_position(out: Path) -> int:
    """The position of the last complete line (a line cut by the kill is dropped)."""
    if not out.exists():
        return 0
    text = out.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        out.write_text(text)
    lines = text.splitlines()
    return int(json.loads(lines[-1])["position"]) if lines else 0


async def main() -> None:
    settings = Settings(nats_url=os.environ["EL_SUB_NATS"], namespace=os.environ["EL_SUB_NS"])
    out = Path(os.environ["EL_SUB_OUT"])
    dedup = os.environ.get("EL_SUB_DEDUP") == "1"
    last = last_position(out)
    async with JetStreamLightningStore(settings) as store, store.subscribe_triplets(durable="algo") as sub:
        print("ready", sub.start_seq, flush=True)
        with out.open("a") as f:  # noqa: ASYNC230 - the test's output, one small line at a time
            async for record in sub:
                if dedup and record.position <= last:
                    continue
                line = {
                    "rollout_id": record.rollout_id,
                    "attempt_id": record.attempt_id,
                    "position": record.position,
                    "redelivered": record.redelivered,
                    "triplets": len(record.data),
                }
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())
                last = record.position


if __name__ == "__main__":
    asyncio.run(main())
