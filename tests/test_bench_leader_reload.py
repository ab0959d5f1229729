"""bench/leader_reload.py runs on real Postgres: both forms read the generated rows in flight (no
timed assertion: the times are the benchmark's to print)."""

from __future__ import annotations

from bench.leader_reload import one_size
from eventlight.ops import Services
from eventlight.settings import Settings


async def test_both_forms_read_the_rollouts_in_flight(services: tuple[Settings, Services]) -> None:
    base, svc = services
    result = await one_size(svc.pg_dsn, base, 1000, rounds=2)
    assert result["attempts"] == 1000 - 125  # 800 rollouts, one in four retried; the 100 queuing have none
    for form in ("before", "after"):
        # 64 running, 5 finished with a live superseded attempt
        assert result[form]["rows"] == 69 and len(result[form]["exec_ms"]["runs"]) == 2
