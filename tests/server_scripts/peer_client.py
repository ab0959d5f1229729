"""Run by the peer venv's python: Agent-lightning 0.3.0's own LightningStoreClient against ``argv[1]``.

Drives enqueue, dequeue, spans, attempts, resources and wait_for_rollouts, and prints one JSON
line of what it saw (the test compares it with the server's store).
"""

import asyncio
import json
import sys

import agentlightning as agl
from agentlightning.store.client_server import LightningStoreClient


async def main(url: str) -> dict:
    client = LightningStoreClient(url, retry_delays=(), health_retry_delays=())
    seen: dict = {}
    try:
        res = await client.add_resources({"prompt": agl.PromptTemplate(template="Hi {name}", engine="f-string")})
        res2 = await client.update_resources(
            res.resources_id, {"prompt": agl.PromptTemplate(template="Yo {name}", engine="f-string")}
        )
        latest = await client.get_latest_resources()
        seen["resources"] = [res.resources_id, res2.version, latest.resources_id, latest.resources["prompt"].template]

        queued = await client.enqueue_rollout(input={"task": 1}, mode="train")
        many = await client.enqueue_many_rollouts(
            [agl.EnqueueRolloutRequest(input={"task": 2}), agl.EnqueueRolloutRequest(input={"task": 3})]
        )
        seen["enqueued"] = [queued.rollout_id] + [r.rollout_id for r in many]
        seen["enqueued_resources_id"] = queued.resources_id

        claimed = await client.dequeue_rollout(worker_id="peer-worker")
        seen["dequeued"] = [claimed.rollout_id, claimed.attempt.attempt_id, claimed.status]
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id

        seq = await client.get_next_span_sequence_id(rid, aid)
        span = agl.Span.from_attributes(
            rollout_id=rid,
            attempt_id=aid,
            sequence_id=seq,
            name="peer.span",
            attributes={"agentlightning.reward": 0.5, "k": "v"},
        )
        added = await client.add_span(span)
        duplicate = await client.add_span(span)
        spans = await client.query_spans(rid, "latest")
        seen["spans"] = [added.span_id if added else None, duplicate, [s.name for s in spans], seq]

        await client.update_attempt(rid, aid, status="failed")
        second = await client.start_attempt(rid, worker_id="peer-worker")
        attempts = await client.query_attempts(rid)
        latest_attempt = await client.get_latest_attempt(rid)
        seen["attempts"] = [
            len(attempts),
            second.attempt.sequence_id,
            latest_attempt.attempt_id == second.attempt.attempt_id,
        ]
        await client.update_attempt(rid, "latest", status="succeeded")

        done = []
        for _ in range(200):
            done = await client.wait_for_rollouts(rollout_ids=[rid], timeout=0.1)
            if done:
                break
        seen["waited"] = [r.status for r in done]
        rollout = await client.get_rollout_by_id(rid)
        seen["rollout"] = [rollout.status, type(rollout).__name__]
        seen["missing"] = [
            await client.get_rollout_by_id("ro-000000000000"),
            await client.get_resources_by_id("rs-000000000000"),
        ]
        page = await client.query_rollouts(status_in=["queuing"])
        seen["queuing"] = sorted(r.rollout_id for r in page)
        workers = await client.query_workers()
        seen["workers"] = [w.worker_id for w in workers]
        worker = await client.update_worker("peer-worker", heartbeat_stats={"cpu": 0.5})
        seen["worker_stats"] = worker.heartbeat_stats
        try:
            await client.update_attempt(rid, "at-unknown", status="succeeded")
            seen["unknown_attempt"] = "no error"
        except Exception as e:  # aiohttp.ClientResponseError
            seen["unknown_attempt"] = getattr(e, "status", repr(e))
        try:
            await client.wait_for_rollouts(rollout_ids=[rid], timeout=5)
        except ValueError as e:
            seen["long_wait"] = str(e)[:40]
    finally:
        await client.close()
    return seen


print(json.dumps(asyncio.run(main(sys.argv[1]))))
