"""Nothing lost without a mark (issue 15 item 4): the agent's exception, the watchdog's overrun and
spans the tracer could not deliver leave a reason on the attempt; a rollout out of attempts shows
its last failure's reason in ``query_rollouts`` and the SQL views; ``Trainer(rollout_config=)``."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

import eventlight as agl
from eventlight.core.commands import CheckHealth, RolloutState
from eventlight.core.decider import decide
from eventlight.core.types import STATUS_REASON, Attempt, Rollout, RolloutConfig, Span
from eventlight.settings import Settings
from eventlight.store.memory import InMemoryLightningStore

RESOURCES = {"prompt": agl.PromptTemplate(template="{q}")}


@agl.rollout
def flaky_agent(task: dict[str, Any], prompt_template: agl.PromptTemplate, rollout: agl.Rollout) -> float:
    raise ConnectionError(f"backend down on attempt {rollout.attempt.sequence_id}")  # type: ignore[attr-defined]


async def run_queue(agent: Any, store: Any, n: int) -> None:
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=n, poll_interval=0.05, heartbeat_interval=0)
    with runner.run_context(agent=agent, store=store):
        assert await asyncio.wait_for(runner.iter(), 60) == n


async def test_a_rollout_out_of_retries_carries_its_last_failure(
    store: Any, runner_store: Any, backend_namespace: Settings | None
) -> None:
    """peer_failures C16: a rollout out of attempts is failed with its last failure's reason."""
    await store.add_resources(RESOURCES)
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    queued = await store.enqueue_rollout({"q": "x"}, config=config)
    await run_queue(flaky_agent, runner_store, 2)
    await asyncio.sleep(0)
    for _ in range(100):  # the JetStream read model follows the runner's writes
        (rollout,) = await store.query_rollouts(rollout_id_in=[queued.rollout_id])
        if rollout.status == "failed":
            break
        await asyncio.sleep(0.1)
    assert rollout.status == "failed" and rollout.attempt.sequence_id == 2
    assert rollout.status_reason == "ConnectionError: backend down on attempt 2"
    first, second = await store.query_attempts(queued.rollout_id)
    assert first.metadata[STATUS_REASON] == "ConnectionError: backend down on attempt 1"
    assert second.metadata[STATUS_REASON] == rollout.status_reason
    (exc_span,) = [
        s
        for s in await store.query_spans(queued.rollout_id, attempt_id=second.attempt_id)
        if s.name == "agentlightning.exception"
    ]
    assert exc_span.attributes["exception.type"] == "ConnectionError"
    if backend_namespace is not None:  # the documented SQL views show it too
        conn = await asyncpg.connect(backend_namespace.pg_dsn)
        try:
            schema = backend_namespace.pg_schema
            row = await conn.fetchrow(
                f"SELECT status, status_reason FROM {schema}.v_rollouts WHERE rollout_id = $1", queued.rollout_id
            )
            reasons = await conn.fetch(
                f"SELECT status_reason FROM {schema}.v_attempts WHERE rollout_id = $1 ORDER BY sequence_id",
                queued.rollout_id,
            )
        finally:
            await conn.close()
        assert dict(row) == {"status": "failed", "status_reason": rollout.status_reason}
        assert [r["status_reason"] for r in reasons] == [first.metadata[STATUS_REASON], rollout.status_reason]


def test_the_watchdog_writes_why_it_ended_an_attempt() -> None:
    def state(config: RolloutConfig, heartbeat: float | None = None) -> RolloutState:
        rollout = Rollout(rollout_id="ro-1", input={}, start_time=0.0, status="running", config=config)
        attempt = Attempt(
            rollout_id="ro-1",
            attempt_id="at-1",
            sequence_id=1,
            start_time=0.0,
            status="running",
            last_heartbeat_time=heartbeat,
            metadata={"mine": 1},
        )
        return RolloutState(rollout=rollout, attempts=(attempt,))

    (timed_out,) = decide(state(RolloutConfig(timeout_seconds=10)), CheckHealth(), 12.5)
    assert timed_out.status == "timeout"  # type: ignore[union-attr]
    assert timed_out.metadata == {"mine": 1, STATUS_REASON: "timeout: ran 12.5 s, over timeout_seconds=10"}  # type: ignore[union-attr]
    (silent,) = decide(state(RolloutConfig(unresponsive_seconds=5), heartbeat=3.0), CheckHealth(), 9.0)
    assert silent.metadata[STATUS_REASON] == (  # type: ignore[union-attr]
        "unresponsive: no span or heartbeat for 6.0 s, over unresponsive_seconds=5"
    )
    assert decide(state(RolloutConfig(timeout_seconds=10)), CheckHealth(), 9.0) == []


class SpanlessStore(InMemoryLightningStore):
    """A store that takes every command but never the tracer's span batches."""

    async def add_spans_numbered(self, rollout_id: str, attempt_id: str, spans: list[Span]) -> Any:
        raise ConnectionError("span batch refused")


@agl.rollout
def emitting_agent(task: dict[str, Any], prompt_template: agl.PromptTemplate) -> float:
    agl.emit_message("a step the trainer needs")
    return 1.0


async def test_spans_the_tracer_could_not_deliver_fail_the_attempt_with_the_reason() -> None:
    store = SpanlessStore()
    await store.add_resources(RESOURCES)
    queued = await store.enqueue_rollout({"q": "x"})
    await run_queue(emitting_agent, store, 1)
    (rollout,) = await store.query_rollouts(rollout_id_in=[queued.rollout_id])
    assert rollout.status == "failed" and rollout.attempt.status == "failed"
    assert rollout.status_reason == "2 span(s) could not be delivered to the store before the attempt finished"


async def test_a_delivered_trace_succeeds_without_a_reason() -> None:
    store = InMemoryLightningStore()
    await store.add_resources(RESOURCES)
    queued = await store.enqueue_rollout({"q": "x"})
    await run_queue(emitting_agent, store, 1)
    (rollout,) = await store.query_rollouts(rollout_id_in=[queued.rollout_id])
    assert rollout.status == "succeeded" and rollout.status_reason is None


# -- RolloutConfig from the Trainer ----------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "error", "says"),
    [
        ({"max_attempts": 0}, ValueError, "max_attempts must be >= 1"),
        ({"retry_condition": ["crashed"]}, ValueError, "unknown attempt statuses"),
        ({"timeout_s": 5}, ValueError, "unknown fields ['timeout_s']"),
        ({"max_attempts": "three"}, ValueError, "Expected `int`"),
        ("max_attempts=3", TypeError, "must be a RolloutConfig or a dict"),
        ({"timeout_seconds": -1}, ValueError, "timeout_seconds must be a finite number of seconds > 0"),
        ({"unresponsive_seconds": 0}, ValueError, "unresponsive_seconds must be a finite number of seconds > 0"),
        (agl.RolloutConfig(timeout_seconds=float("nan")), ValueError, "got nan"),
    ],
)
def test_trainer_rollout_config_is_validated(given: Any, error: type[Exception], says: str) -> None:
    with pytest.raises(error) as info:
        agl.Trainer(rollout_config=given)
    assert says in str(info.value)


async def test_trainer_rollout_config_applies_to_what_the_algorithm_enqueues() -> None:
    """peer_failures C16: ``RolloutConfig`` is settable from the trainer."""
    store = InMemoryLightningStore()
    seen: list[RolloutConfig] = []

    @agl.algo
    async def enqueue_two(store: agl.LightningStore) -> None:
        own = await store.enqueue_rollout({"q": 1}, config=RolloutConfig(max_attempts=5))
        default = await store.enqueue_rollout({"q": 2})
        seen.extend([own.config, default.config])

    trainer = agl.Trainer(
        algorithm=enqueue_two,
        store=store,
        rollout_config={"timeout_seconds": 30, "max_attempts": 3, "retry_condition": ["failed", "timeout"]},
    )
    await trainer._run_algorithm(store, None, None, trainer.algorithm)
    assert seen[0] == RolloutConfig(max_attempts=5)
    assert seen[1] == RolloutConfig(timeout_seconds=30, max_attempts=3, retry_condition=["failed", "timeout"])


# -- RolloutConfig from the runner and `eventlight runner` -----------------------------------


async def test_a_runner_config_applies_to_rollouts_enqueued_without_one() -> None:
    store = InMemoryLightningStore()
    await store.add_resources(RESOURCES)
    plain = await store.enqueue_rollout({"q": "x"})
    own = await store.enqueue_rollout({"q": "y"}, config=RolloutConfig(max_attempts=1, timeout_seconds=99))
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"], timeout_seconds=60)
    runner = agl.LitAgentRunner(
        agl.OtelTracer(), max_rollouts=3, poll_interval=0.05, heartbeat_interval=0, rollout_config=config
    )
    with runner.run_context(agent=flaky_agent, store=store):
        assert await asyncio.wait_for(runner.iter(), 60) == 3  # plain twice, own once
    got_plain, got_own = await store.query_rollouts(rollout_id_in=[plain.rollout_id, own.rollout_id])
    assert got_plain.config == config and got_plain.attempt.sequence_id == 2 and got_plain.status == "failed"
    assert got_own.config == RolloutConfig(max_attempts=1, timeout_seconds=99) and got_own.attempt.sequence_id == 1


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--max-attempts", "0"], "max_attempts must be >= 1"),
        (["--retry-on", "failed,exploded"], "--retry-on takes failed, timeout, unresponsive"),
        (["--retry-on", "succeeded"], "got 'succeeded'"),  # the rest: found by a fresh user
        (["--retry-on", ""], "got ''"),
        (["--retry-on", "failed,,timeout"], "got 'failed,,timeout'"),
        (["--timeout-s", "-1"], "--timeout-s must be a finite number of seconds > 0"),
        (["--timeout-s", "nan"], "got nan"),
        (["--timeout-s", "inf"], "got inf"),
        (["--unresponsive-s", "0"], "--unresponsive-s must be a finite number of seconds > 0"),
    ],
)
def test_eventlight_runner_refuses_a_bad_rollout_config_in_one_line(args: list[str], says: str) -> None:
    from typer.testing import CliRunner

    from eventlight.cli import app

    result = CliRunner().invoke(app, ["runner", "examples.room_booking.agent:room_booker", *args])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert says in result.output and "Traceback" not in result.output


def test_eventlight_runner_builds_the_config_it_is_given() -> None:
    """peer_failures C16: ``RolloutConfig`` is settable from ``eventlight runner``."""
    from eventlight.cli.runner import _rollout_config

    assert _rollout_config(None, None, None, None) is None
    assert _rollout_config(600, 30, 3, "failed, timeout") == RolloutConfig(
        timeout_seconds=600, unresponsive_seconds=30, max_attempts=3, retry_condition=["failed", "timeout"]
    )
