"""The benchmark's workload helpers (bench/workload.py) and report arithmetic that bounds come from."""

from __future__ import annotations

import math

import pytest

from bench.report import MICRO_OPS, micro_ceiling, micro_table
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


def test_micro_raw_rates_chain_the_round_trips_of_each_operation() -> None:
    rt = {"concurrency": 4, "publish": {"ops_per_s": 1000.0}, "pull": {"ops_per_s": 4000.0}}
    el = {"ok": True, "concurrency": 4, "ops": {op: {"ops_per_s": 400.0} for op in MICRO_OPS}, "round_trips": rt}
    results = {"micro": {"eventlight": el}}
    assert micro_ceiling(results, "enqueue") == pytest.approx(1000.0)
    assert micro_ceiling(results, "dequeue_empty") == pytest.approx(4000.0)
    assert micro_ceiling(results, "dequeue") == pytest.approx(1 / (1 / 4000 + 1 / 1000))  # 800
    assert micro_ceiling(results, "dequeue_update") == pytest.approx(1 / (1 / 4000 + 2 / 1000))  # 444.4
    assert micro_ceiling(results, "add_span") is None  # group commit: no one-publish-per-span bound
    assert micro_ceiling(results, "query_spans") is None  # pg_select was not measured
    assert micro_ceiling({"micro": {"eventlight": {**el, "round_trips": None}}}, "enqueue") is None
    table = micro_table(results)
    # an older result (no blocks, no raw twin): the own-stream columns stay empty
    assert "| dequeue | 400.0 | – | – | – | – | 800.0 | 0.50× |" in table and "| pull | 4,000.0 |" in table
