"""``overview(store)``: what ``/metrics``, the dashboard and ``eventlight status`` show of a store.

The log's head and the projector's checkpoint, rollouts and attempts by status, LLM calls and
tokens by model, reward per resources version, and the watchdog's actions in this process. On a
JetStream store with Postgres the counts come from the read models and the documented SQL views
(``llm_calls``, ``reward_by_resources``: one query each); on any other store (the in-memory one)
from its query API, rollout by rollout: right for the small stores that backend holds.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from eventlight.rewards import find_final_reward
from eventlight.store.base import LightningStore
from eventlight.store.liveness import QUEUED_STATUSES
from eventlight.store.watchdog import Watchdog

__all__ = [
    "QUEUED_STATUSES",
    "LlmUsage",
    "RewardRow",
    "StoreOverview",
    "llm_usage_of",
    "overview",
    "reward_by_resources",
]


SQL_ROLLOUTS_BY_STATUS = "SELECT status, count(*) FROM rollouts GROUP BY status"
SQL_ATTEMPTS_BY_STATUS = "SELECT status, count(*) FROM attempts GROUP BY status"
SQL_CHECKPOINT = "SELECT min(last_seq) FROM projector_checkpoint"  # every partition's has passed it
SQL_LLM_BY_MODEL = (
    "SELECT coalesce(model, ''), count(*), coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0) "
    "FROM llm_calls GROUP BY model"
)
SQL_REWARD_BY_RESOURCES = (
    "SELECT resources_id, resources_version, mode, rollouts, rewarded, mean_reward FROM reward_by_resources "
    "ORDER BY resources_version NULLS FIRST, resources_id, mode"
)


class LlmUsage(msgspec.Struct, kw_only=True):
    """LLM calls of one model and their tokens (``llm_calls``: the OpenTelemetry GenAI attributes)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class RewardRow(msgspec.Struct, kw_only=True):
    """One row of ``reward_by_resources``: finished rollouts of a resources snapshot and mode."""

    resources_id: str | None
    resources_version: int | None
    mode: str | None
    rollouts: int
    rewarded: int
    mean_reward: float | None


class StoreOverview(msgspec.Struct, kw_only=True):
    """A store's state at one moment.

    Attributes:
        head_seq: The log's last position (every event any writer published).
        projected_seq: The projector's checkpoint (equal to ``head_seq`` on the in-memory store).
        rollouts_by_status / attempts_by_status: Counts, every status present.
        llm_by_model: LLM call spans by model (``""``: a span naming none).
        watchdog_actions: Events the watchdog of this process appended, by action
            (``attempt_timeout``, ``attempt_unresponsive``, ``rollout_requeuing``, ...).
    """

    head_seq: int
    projected_seq: int
    rollouts_by_status: dict[str, int]
    attempts_by_status: dict[str, int]
    llm_by_model: dict[str, LlmUsage]
    watchdog_actions: dict[str, int]

    @property
    def projector_lag(self) -> int:
        """Events on the log that the read models do not show yet."""
        return max(0, self.head_seq - self.projected_seq)

    @property
    def queue_depth(self) -> int:
        """Rollouts waiting for a runner (``queuing`` or ``requeuing``)."""
        return sum(self.rollouts_by_status.get(s, 0) for s in QUEUED_STATUSES)


def _pool(store: LightningStore) -> Any:
    """The Postgres pool of a JetStream store that has one, else ``None``."""
    return getattr(store, "pool", None) if getattr(store, "read_model", None) is not None else None


def _watchdog(store: LightningStore) -> Watchdog | None:
    projector = getattr(store, "projector", None)
    found = getattr(projector, "watchdog", None) if projector is not None else getattr(store, "watchdog", None)
    return found if isinstance(found, Watchdog) else None


def llm_usage_of(attributes: dict[str, Any]) -> tuple[str, int, int] | None:
    """``(model, prompt_tokens, completion_tokens)`` of an LLM call span's attributes, as ``llm_calls``
    reads them (``gen_ai.request.model`` / ``gen_ai.response.model``; ``*_tokens`` or the GenAI
    conventions' ``input_tokens`` / ``output_tokens``); ``None`` for any other span."""
    model = attributes.get("gen_ai.request.model", attributes.get("gen_ai.response.model"))
    if model is None:
        return None

    def tokens(*keys: str) -> int:
        for key in keys:
            value = attributes.get(key)
            if value is not None:
                try:
                    return int(value)
                except (TypeError, ValueError):
                    return 0
        return 0

    prompt = tokens("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens")
    completion = tokens("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens")
    return str(model), prompt, completion


async def _from_sql(pool: Any) -> tuple[int, dict[str, int], dict[str, int], dict[str, LlmUsage]]:
    async with pool.acquire() as conn:
        projected = int(await conn.fetchval(SQL_CHECKPOINT) or 0)
        rollouts = {r[0]: int(r[1]) for r in await conn.fetch(SQL_ROLLOUTS_BY_STATUS)}
        attempts = {r[0]: int(r[1]) for r in await conn.fetch(SQL_ATTEMPTS_BY_STATUS)}
        llm = {
            r[0]: LlmUsage(calls=int(r[1]), prompt_tokens=int(r[2]), completion_tokens=int(r[3]))
            for r in await conn.fetch(SQL_LLM_BY_MODEL)
        }
    return projected, rollouts, attempts, llm


async def _from_api(store: LightningStore) -> tuple[dict[str, int], dict[str, int], dict[str, LlmUsage]]:
    rollouts: Counter[str] = Counter()
    attempts: Counter[str] = Counter()
    llm: dict[str, LlmUsage] = {}
    for rollout in await store.query_rollouts():
        rollouts[rollout.status] += 1
        for attempt in await store.query_attempts(rollout.rollout_id):
            attempts[attempt.status] += 1
        for span in await store.query_spans(rollout.rollout_id):
            usage = llm_usage_of(span.attributes)
            if usage is not None:
                row = llm.setdefault(usage[0], LlmUsage())
                row.calls += 1
                row.prompt_tokens += usage[1]
                row.completion_tokens += usage[2]
    return dict(rollouts), dict(attempts), llm


async def overview(store: LightningStore) -> StoreOverview:
    """The state of ``store`` now (an open ``EventStore``: the JetStream or the in-memory one).

    Raises:
        ServiceUnavailableError: NATS or Postgres did not answer.
    """
    head = await store._log().head_seq()  # type: ignore[attr-defined]
    pool = _pool(store)
    if pool is not None:
        projected, rollouts, attempts, llm = await _from_sql(pool)
    else:
        projected = head
        rollouts, attempts, llm = await _from_api(store)
    watchdog = _watchdog(store)
    return StoreOverview(
        head_seq=int(head),
        projected_seq=projected,
        rollouts_by_status=rollouts,
        attempts_by_status=attempts,
        llm_by_model=llm,
        watchdog_actions=dict(watchdog.actions) if watchdog is not None else {},
    )


async def reward_by_resources(store: LightningStore) -> list[RewardRow]:
    """Finished rollouts' mean final reward per resources snapshot (its version) and mode, as the
    ``reward_by_resources`` view computes it (a rollout without a reward counts as 0)."""
    pool = _pool(store)
    if pool is not None:
        async with pool.acquire() as conn:
            rows = await conn.fetch(SQL_REWARD_BY_RESOURCES)
        return [
            RewardRow(
                resources_id=r[0],
                resources_version=r[1],
                mode=r[2],
                rollouts=int(r[3]),
                rewarded=int(r[4]),
                mean_reward=None if r[5] is None else float(r[5]),
            )
            for r in rows
        ]
    groups: dict[tuple[str | None, str | None], list[float | None]] = {}
    for rollout in await store.query_rollouts(status_in=["succeeded", "failed"]):
        spans = await store.query_spans(rollout.rollout_id, "latest")
        groups.setdefault((rollout.resources_id, rollout.mode), []).append(find_final_reward(list(spans)))
    out = []
    for (rid, mode), rewards in groups.items():
        res = await store.get_resources_by_id(rid) if rid is not None else None
        out.append(
            RewardRow(
                resources_id=rid,
                resources_version=res.version if res is not None else None,
                mode=mode,
                rollouts=len(rewards),
                rewarded=sum(r is not None for r in rewards),
                mean_reward=sum(r or 0.0 for r in rewards) / len(rewards),
            )
        )
    return sorted(out, key=lambda r: (r.resources_version or 0, r.resources_id or "", r.mode or ""))
