"""A 3-node nats-server cluster with R3 streams: stopping any one node mid-run loses nothing (issue 12).

Three nats-servers of the test's own on loopback (``tests/cluster.py``), the namespace's stream with
three replicas (``Settings.stream_replicas``); every client is given all three URLs, comma-separated.
Two runners (in this process, each with its own store) work the queue while the algorithm's store
enqueues and waits. In each round one node is killed with SIGKILL mid-run (the stream's leader in the
first round, a seeded choice after) and stays down until the round's rollouts are finished; then it
is restarted and the next round waits for its replica to be current. Afterwards: every acknowledged
rollout is in the log once, every attempt has all its spans, none twice, none stuck, and the read
model equals a rebuild of the log. Prints its figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from pathlib import Path
from typing import Any

import fault_agents
import pytest
from cluster import Cluster, stream_cluster, wait_answered, wait_replicas_current
from faults import KILLS, Ledger, check_log_and_read_model, namespace_on, seeded, stream_last_seq, wait_projected

import eventlight as agl
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.ops import Services
from eventlight.ops.nats_server import _nats_binary
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats, server_urls

pytestmark = pytest.mark.faults

RESOURCES = {"prompt_template": agl.PromptTemplate(template="{q}")}
CONFIG = agl.RolloutConfig(max_attempts=3, retry_condition=["failed", "unresponsive", "timeout"])
PER_ROUND = 12  # rollouts enqueued before the stop, and as many while the node is down
SPANS = 3


def test_server_urls_take_commas_and_lists() -> None:
    assert server_urls("nats://a:1, b:2") == ["nats://a:1", "nats://b:2"]
    assert server_urls(["nats://a:1,nats://b:2", "c:3"]) == ["nats://a:1", "nats://b:2", "nats://c:3"]
    with pytest.raises(InvalidInputError, match="no NATS server"):
        server_urls(" , ")


async def test_connect_uses_whichever_listed_server_answers(services: tuple[Settings, Services]) -> None:
    from eventlight.net import free_port

    _, svc = services
    dead = f"nats://127.0.0.1:{free_port()}"
    for url in (f"{dead},{svc.nats_url}", [dead, svc.nats_url]):
        nc = await connect_nats(url, reconnect=False)
        try:
            assert nc.is_connected
        finally:
            await nc.close()
    with pytest.raises(ServiceUnavailableError, match="nothing answers at 127.0.0.1") as none:
        await connect_nats(f"{dead},{dead}", reconnect=False)
    assert str(none.value).count("nothing answers") == 2  # each server named with its cause


def test_stream_replicas_are_checked_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().stream_replicas is None  # the single node's default: as the definitions say (1)
    monkeypatch.setenv("EVENTLIGHT_STREAM_REPLICAS", "3")
    assert Settings.from_env().stream_replicas == 3
    with pytest.raises(InvalidInputError, match="1 to 5"):
        Settings(stream_replicas=7)
    monkeypatch.setenv("EVENTLIGHT_STREAM_REPLICAS", "three")
    with pytest.raises(InvalidInputError, match="EVENTLIGHT_STREAM_REPLICAS must be a whole number"):
        Settings.from_env()


def test_a_jetstream_503_is_named_as_an_election() -> None:
    import nats.js.errors

    from eventlight.store.jetstream.nats_errors import nats_errors

    with pytest.raises(ServiceUnavailableError, match="no leader for it now") as info:
        with nats_errors("nats://127.0.0.1:1", "pull from the runners queue"):
            raise nats.js.errors.ServiceUnavailableError()
    assert info.value.retryable and "code=None" not in str(info.value)


def test_a_publish_nobody_answers_is_retryable() -> None:
    # js.publish turns no responders (the stream's leader was just killed) into NoStreamResponseError;
    # it escaped unmapped, so a caller retrying ServiceUnavailableError stopped (a CI failure).
    import nats.js.errors

    from eventlight.store.jetstream.nats_errors import nats_errors

    with pytest.raises(ServiceUnavailableError, match="publish to el.x.r.ro-1.q failed") as info:
        with nats_errors("nats://127.0.0.1:1", "publish to el.x.r.ro-1.q"):
            raise nats.js.errors.NoStreamResponseError()
    assert info.value.retryable


async def _retry(call: Any, deadline: float, failures: Counter[str]) -> Any:
    """``call()`` until it stops raising a retryable error: a leader election takes a few seconds."""
    while True:
        try:
            return await call()
        except (ServiceUnavailableError, TimeoutError) as e:
            failures[type(e).__name__] += 1
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _runner(ns: Settings, index: int, stop: asyncio.Event) -> int:
    async with JetStreamLightningStore(ns) as store:  # a runner's store: NATS only
        runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=0.2, heartbeat_interval=1)
        with runner.run_context(agent=fault_agents.traced, store=store, worker_id=index):
            return await runner.iter(event=stop)


async def _spans_per_attempt(store: JetStreamLightningStore) -> Counter[int]:
    """How many attempts hold how many spans in the read model (succeeded attempts only)."""
    async with store.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT a.attempt_id, count(s.span_id) AS n FROM attempts a LEFT JOIN spans s USING (attempt_id)"
            " WHERE a.status = 'succeeded' GROUP BY a.attempt_id"
        )
    return Counter(int(r["n"]) for r in rows)


async def test_stopping_any_one_node_of_a_3_node_cluster_loses_nothing(
    services: tuple[Settings, Services], tmp_path: Path
) -> None:
    try:
        _nats_binary()
    except ServiceUnavailableError as e:
        pytest.skip(f"no nats-server binary for the cluster: {e}")
    _, svc = services
    rng = seeded(33)
    cluster = Cluster(tmp_path / "cluster")
    ledger = Ledger()
    failures: Counter[str] = Counter()
    stops: list[dict[str, Any]] = []
    t_start = time.monotonic()
    deadline = t_start + 110  # every wait below is bounded by this
    try:
        await cluster.start()
        async with namespace_on(cluster.url, svc.pg_dsn, replicas=3) as ns:
            assert ns.nats_url is not None and ns.nats_url.count(",") == 2
            async with JetStreamLightningStore(ns, pg_dsn=svc.pg_dsn) as algo:
                js = algo.log.js
                assert (await js.stream_info(ns.stream_name)).config.num_replicas == 3
                assert not algo.log.direct_gets  # followers may lag: single reads go to the leader
                await algo.add_resources(RESOURCES)
                stop = asyncio.Event()
                runners = [asyncio.create_task(_runner(ns, i, stop)) for i in range(2)]
                try:
                    warm = await algo.enqueue_rollout({"i": -1, "spans": SPANS}, config=CONFIG)
                    [first] = await algo.wait_for_rollouts(rollout_ids=[warm.rollout_id], timeout=30)
                    assert first.status == "succeeded"
                    ledger.rollouts[warm.rollout_id] = 0
                    expected_spans = (await _spans_per_attempt(algo)).most_common(1)[0][0]
                    assert expected_spans >= SPANS + 1  # the objects and the reward

                    async def enqueue(i: int) -> str:
                        call = lambda: algo.enqueue_rollout({"i": i, "spans": SPANS}, config=CONFIG)  # noqa: E731
                        rid: str = (await _retry(call, deadline, failures)).rollout_id
                        ledger.rollouts[rid] = 0
                        return rid

                    for rnd in range(max(2, KILLS)):
                        base = rnd * 2 * PER_ROUND
                        batch = [await enqueue(base + k) for k in range(PER_ROUND)]
                        await asyncio.sleep(rng.uniform(0.2, 1.0))  # runners are mid-attempt
                        leader, _ = await stream_cluster(js, ns.stream_name)
                        victim = cluster.node_named(leader) if rnd == 0 else rng.choice(cluster.nodes)
                        was_leader = f"n{victim.port}" == leader
                        victim.kill9()
                        t_kill = time.monotonic()
                        batch += [await enqueue(base + PER_ROUND + k) for k in range(PER_ROUND)]
                        done = await algo.wait_for_rollouts(
                            rollout_ids=batch, timeout=max(1, deadline - time.monotonic())
                        )
                        finished_s = time.monotonic() - t_kill
                        assert len(done) == len(batch), f"round {rnd}: {len(batch) - len(done)} rollouts unfinished"
                        ledger.finished.update(batch)  # each must end succeeded (CONFIG retries)
                        new_leader, _ = await stream_cluster(js, ns.stream_name)
                        victim.start()
                        await victim.ready()
                        rejoin_s = await wait_replicas_current(js, ns.stream_name, 3, timeout_s=30)
                        # the rebuild below asks for the archive stream (absent here): wait until the cluster answers
                        await wait_answered(js, ns.archive_stream_name, timeout_s=30)
                        stops.append(
                            dict(leader=was_leader, new_leader=new_leader, finished_s=finished_s, rejoin_s=rejoin_s)
                        )
                finally:
                    stop.set()
                    processed = await asyncio.wait_for(asyncio.gather(*runners, return_exceptions=True), 30)
                await wait_projected(svc.pg_dsn, ns.pg_schema, await stream_last_seq(algo))
                rollouts = await algo.query_rollouts()
                attempts = 0
                for r in rollouts:
                    attempts += len(await algo.query_attempts(r.rollout_id))
                per_attempt = await _spans_per_attempt(algo)
                verdict = await check_log_and_read_model(algo, ns, ledger)
    finally:
        with contextlib.suppress(Exception):
            cluster.stop()
    statuses = Counter(r.status for r in rollouts)
    unacknowledged = len(rollouts) - len(ledger.rollouts)  # a retried enqueue whose first ack was lost
    spans_lost = sum(n for k, n in per_attempt.items() if k < expected_spans)
    spans_doubled = sum(n for k, n in per_attempt.items() if k > expected_spans)
    print(
        f"\n[fault] 3-node cluster, one node stopped per round: runs=1, stops={len(stops)}, "
        f"leader_stops={sum(s['leader'] for s in stops)}, events={verdict.events}, rollouts={len(rollouts)} "
        f"({dict(statuses)}), attempts={attempts}, unacknowledged_extra={unacknowledged}, spans={verdict.spans}, "
        f"lost={verdict.lost}, doubled={verdict.doubled}, stuck={verdict.stuck}, attempts_missing_spans={spans_lost}, "
        f"attempts_extra_spans={spans_doubled}, failed_calls_retried={sum(failures.values())}, "
        f"round_finish_max_s={max(s['finished_s'] for s in stops):.1f}, "
        f"rejoin_max_s={max(s['rejoin_s'] for s in stops):.1f}, processed={processed}, "
        f"wall_s={time.monotonic() - t_start:.0f}"
    )
    assert any(s["leader"] for s in stops) and all(s["new_leader"] for s in stops)
    assert (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)
    assert statuses == {"succeeded": len(rollouts)}, statuses
    assert (spans_lost, spans_doubled) == (0, 0), per_attempt
