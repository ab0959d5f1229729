"""A new rollout names the resources that are the latest when it is stored, on both backends.

``enqueue_rollout`` / ``enqueue_many_rollouts`` / ``start_rollout`` without ``resources_id`` take
the latest snapshot. On JetStream the id comes from the process's cache and the append is fenced
on the resources subjects (``EventLog.append(resources_seq=)``), so one publish usually does it and
a stale cache is caught by the server. What is checked: another process's update is seen by the
next rollout (the cache alone would miss it); in the log every ``RolloutCreated`` names the last
``ResourcesPut`` before it, also while snapshots and rollouts of one process race and share atomic
batches (reading the latest and then appending, as before, breaks this); and a warm enqueue on
JetStream sends its create messages and nothing else.
"""

from __future__ import annotations

import asyncio
from typing import Any

from eventlight.core import decider
from eventlight.core.commands import CreateRollout
from eventlight.core.events import ResourcesPut, RolloutCreated
from eventlight.core.types import EnqueueRolloutRequest, PromptTemplate
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

RESOURCES = {"prompt": PromptTemplate(template="{x}")}


async def test_a_rollout_after_another_process_updates_names_the_new_resources(store: Any, runner_store: Any) -> None:
    first = await store.add_resources(RESOURCES)
    assert (await store.enqueue_rollout({"i": 0})).resources_id == first.resources_id
    second = await runner_store.add_resources(RESOURCES)  # another process on JetStream
    assert (await store.enqueue_rollout({"i": 1})).resources_id == second.resources_id
    third = await runner_store.add_resources(RESOURCES)
    many = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": k}) for k in range(3)])
    assert [r.resources_id for r in many] == [third.resources_id] * 3
    fourth = await runner_store.add_resources(RESOURCES)
    started = await store.start_rollout({"i": 9})
    assert started.resources_id == fourth.resources_id
    explicit = await store.enqueue_rollout({"i": 10}, resources_id=first.resources_id)
    assert explicit.resources_id == first.resources_id


def _log_of(store: Any) -> Any:
    log = store._log()
    appender = getattr(log, "appender", None)
    if appender is not None:  # JetStream: one plain publish in flight, batches from two messages on
        appender.plain_window = 1
        appender.min_batch_messages = 2
    return log


async def test_every_created_rollout_names_the_last_snapshot_before_it_in_the_log(store: Any) -> None:
    log = _log_of(store)
    await store.add_resources(RESOURCES)
    made = 0
    for round_ in range(6):
        calls: list[Any] = [store.enqueue_rollout({"r": round_, "k": k}) for k in range(12)]
        calls.insert(5, store.add_resources(RESOURCES))
        calls.insert(9, store.update_resources((await store.get_latest_resources()).resources_id, RESOURCES))
        calls.append(store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"m": k}) for k in range(8)]))
        await asyncio.gather(*calls)
        made += 20
    latest: str | None = None
    checked = 0
    async for _, event in log.read(0):
        if isinstance(event, ResourcesPut):
            latest = event.resources.resources_id
        elif isinstance(event, RolloutCreated):
            assert event.rollout.resources_id == latest, (event.rollout.rollout_id, event.rollout.resources_id)
            checked += 1
    assert checked == made
    batches = getattr(getattr(log, "appender", None), "stats", None)
    if batches is not None:
        assert batches.batches > 0  # the race went through atomic batches too


async def test_a_warm_enqueue_on_jetstream_sends_only_its_create(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as store:  # a runner's store: no projector on its connection
        await store.add_resources(RESOURCES)
        await store.enqueue_rollout({"warm": True})
        per_create = len(decider.decide(None, CreateRollout(rollout_id="ro-x", input={}), 0.0))
        nc = store._log().nc
        before = nc.stats["out_msgs"]
        for k in range(10):
            await store.enqueue_rollout({"k": k})
        assert nc.stats["out_msgs"] - before == 10 * per_create
