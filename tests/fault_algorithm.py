"""An algorithm alone in its process, for the algorithm kill loop (``tests/test_algorithm_faults.py``).

It owns a plan of ``EL_FAULT_N`` rollouts (input ``{"i": i, ...}``, a ``RolloutConfig`` chosen by
``i``: ``plan``). On every start it finds the rollouts it already made by reading them back through
the store (after ``sync_all``, so everything in the log is seen), enqueues only the missing ones,
then waits for all of them. Prints one line per step (``found``, ``enqueued <i> <rollout_id>`` once
the enqueue is acknowledged, ``waiting``, ``done <json>``) for the test to follow and kill it.
Reads ``EL_FAULT_NATS``, ``EL_FAULT_PG``, ``EL_FAULT_NS`` and ``EL_FAULT_N``.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import eventlight as agl
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

RETRY = agl.RolloutConfig(max_attempts=2, retry_condition=["failed"])


def plan(i: int) -> tuple[dict[str, Any], agl.RolloutConfig | None]:
    """Rollout ``i``'s input and config: one in three fails once and is retried (``RETRY``), one in
    three fails once under the default config (it ends ``failed``), the rest succeed at once."""
    kind = i % 3
    return {"i": i, "spans": 2, "fail_first": kind != 2, "sleep_s": 0.2}, (RETRY if kind == 0 else None)


def say(*words: object) -> None:
    print(*words, flush=True)


async def main() -> None:
    settings = Settings(
        nats_url=os.environ["EL_FAULT_NATS"], pg_dsn=os.environ["EL_FAULT_PG"], namespace=os.environ["EL_FAULT_NS"]
    )
    n = int(os.environ["EL_FAULT_N"])
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await store.sync_all(timeout_s=30)
        if not await store.query_resources():  # its resources too are found again, not re-published
            await store.add_resources({"prompt_template": agl.PromptTemplate(template="{i}")})
        mine = {int(r.input["i"]): r.rollout_id for r in await store.query_rollouts() if isinstance(r.input, dict)}
        say("found", len(mine))
        for i in range(n):
            if i not in mine:
                task, config = plan(i)
                mine[i] = (await store.enqueue_rollout(task, config=config)).rollout_id
                say("enqueued", i, mine[i])
        say("waiting")
        done = await store.wait_for_rollouts(rollout_ids=list(mine.values()), timeout=90)
        say("done", json.dumps({r.rollout_id: r.status for r in done}))


if __name__ == "__main__":
    asyncio.run(main())
