"""The benchmark's workload helpers (bench/workload.py) that the report's bounds come from."""

from __future__ import annotations

import math

from bench.workload import SCENARIOS, agent_bound, agent_cpu_bound, agent_cpu_s_per_rollout


async def test_agent_cpu_probe_runs_inside_the_drivers_event_loop() -> None:
    """The driver calls it from a coroutine: it must not need an event loop of its own."""
    cpu = agent_cpu_s_per_rollout(1, SCENARIOS["batch_nosleep"], n=8)
    assert 0 < cpu < 1.0
    assert agent_cpu_bound(cpu, 2) == 2 / cpu


def test_bounds_without_sleeps() -> None:
    assert agent_bound(SCENARIOS["batch_nosleep"]) == math.inf
    assert agent_cpu_bound(0.0, 2) == math.inf
    assert agent_bound(SCENARIOS["batch"]) < math.inf
    # 8 in flight for 16 runners: only 8 can be busy
    assert agent_bound(SCENARIOS["half_load"]) == agent_bound(SCENARIOS["single"]) / 2
