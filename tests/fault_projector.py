"""A projector alone in its process, for the fault suites (``tests/faults.py``) to kill with SIGKILL.

Reads ``EL_FAULT_NATS``, ``EL_FAULT_PG``, ``EL_FAULT_NS`` and ``EL_FAULT_PARTITIONS`` (default 1);
projects until killed (or 120 s).
"""

from __future__ import annotations

import asyncio
import os

from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore


async def main() -> None:
    settings = Settings(
        nats_url=os.environ["EL_FAULT_NATS"],
        pg_dsn=os.environ["EL_FAULT_PG"],
        namespace=os.environ["EL_FAULT_NS"],
        projector_partitions=int(os.environ.get("EL_FAULT_PARTITIONS", "1")),
    )
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn, watchdog_interval_s=3600):
        await asyncio.sleep(120)


if __name__ == "__main__":
    asyncio.run(main())
