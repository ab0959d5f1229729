"""The workload both stacks run: scenarios, the per-task plan, and the algorithm's checks.

Standard library only: this module is imported by the drivers of both stacks (eventlight's venv and
Agent-lightning 0.3.0's venv), so it must not import either.

The workload follows Agent-lightning's own store benchmark (``tests/benchmark/benchmark_store.py``):
an agent runs ``rounds = randint(1, max_rounds)`` rounds; each round opens a span ``agent{i}`` with
two nested spans ``round{i}_1`` and ``round{i}_2`` (each sleeping ``uniform(0, sleep_s)`` and
carrying flattened random attributes), emits an intermediate reward half of the time, and the
rollout ends with a span ``final`` and a final reward in ``[1, 2]``. One of the round spans carries
``task = <task name>``.

Unlike that benchmark, every random choice of a task comes from ``random.Random(f"{seed}:{task}")``,
so both stacks run exactly the same rollouts (same rounds, sleeps, attributes and rewards) whichever
runner picks a task, and the algorithm can check each rollout's spans and final reward exactly.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

Mode = Literal["batch", "batch_partial", "single"]

#: Seconds between two polls of the algorithm (``wait_for_rollouts(timeout=POLL_S)``), both stacks.
POLL_S = 0.05
#: Seconds a runner waits for work before asking again (eventlight: long poll; peer: sleep), both stacks.
RUNNER_POLL_S = 0.1

_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Scenario:
    """One workload.

    Attributes:
        name: Key in ``SCENARIOS``.
        mode: ``batch`` (submit ``batch_size``, wait for all), ``batch_partial`` (submit
            ``batch_size`` whenever fewer than ``remaining`` are in flight) or ``single`` (keep
            ``concurrency`` rollouts in flight, enqueued one at a time).
        total_tasks: Rollouts in the scenario (before ``scale``).
        n_runners: Runner processes.
        max_rounds: Upper bound of an agent's rounds.
        sleep_s: Upper bound of each of the agent's sleeps (``2 * rounds + 1`` sleeps per rollout).
        batch_size / remaining / concurrency: Mode parameters.
        scale: Factor applied to ``total_tasks`` (recorded in the results).
    """

    name: str
    mode: Mode
    total_tasks: int
    n_runners: int = 16
    max_rounds: int = 6
    sleep_s: float = 0.1
    batch_size: int = 64
    remaining: int = 32
    concurrency: int = 64
    scale: float = 1.0

    def scaled(self, scale: float) -> Scenario:
        """The scenario with ``total_tasks`` multiplied by ``scale`` (at least one task)."""
        return replace(self, total_tasks=max(1, round(self.total_tasks * scale)), scale=scale)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_BASE = {
    "batch": Scenario("batch", "batch", 512, batch_size=64),
    "single": Scenario("single", "single", 512, concurrency=64),
    "heavy": Scenario("heavy", "batch_partial", 256, max_rounds=20, batch_size=64, remaining=32),
}
#: The scenarios, sized for a 2-core machine: the three above, the same three with no sleeps, and
#: ``half_load``: 8 rollouts in flight for 16 runners, where the claim (dequeue) latency is measured
#: with half the runners idle.
SCENARIOS: dict[str, Scenario] = {
    **_BASE,
    **{f"{k}_nosleep": replace(v, name=f"{k}_nosleep", sleep_s=0.0) for k, v in _BASE.items()},
    "half_load": replace(_BASE["single"], name="half_load", total_tasks=256, concurrency=8),
}


# -- the plan of one task --------------------------------------------------------------------


@dataclass(frozen=True)
class SpanPlan:
    name: str
    sleep_s: float
    attributes: dict[str, str]


@dataclass(frozen=True)
class Step:
    """One thing the agent does: open ``agent{i}`` with its two children, or emit a reward."""

    round_index: int
    children: tuple[SpanPlan, SpanPlan] | None = None
    reward: float | None = None


@dataclass(frozen=True)
class TaskPlan:
    """Everything random about one rollout, derived from ``(seed, task)``."""

    task: str
    rounds: int
    steps: tuple[Step, ...]
    final: SpanPlan
    final_reward: float

    @property
    def n_rewards(self) -> int:
        return sum(1 for s in self.steps if s.reward is not None) + 1

    @property
    def n_named_spans(self) -> int:
        """Spans the agent opens itself: ``agent{i}``, ``round{i}_1``, ``round{i}_2`` and ``final``."""
        return 3 * self.rounds + 1

    @property
    def n_spans(self) -> int:
        """Spans the store should hold: the named ones plus one per reward."""
        return self.n_named_spans + self.n_rewards

    @property
    def sleep_s(self) -> float:
        return self.final.sleep_s + sum(c.sleep_s for s in self.steps if s.children for c in s.children)

    def check(self) -> PlanCheck:
        """What ``check_rollout`` and the bounds read of this plan, without its attributes."""
        return PlanCheck(self.task, self.rounds, self.n_rewards, self.n_spans, self.final_reward, self.sleep_s)


@dataclass(frozen=True, slots=True)
class PlanCheck:
    """A task's plan as the driver checks it: its spans' attributes (about 70 kB a task, 35 MB at
    scale 1) stay with the runners, which rebuild the plan from ``(seed, task)``, and out of the
    memory measured as the algorithm's."""

    task: str
    rounds: int
    n_rewards: int
    n_spans: int
    final_reward: float
    sleep_s: float


def task_name(index: int) -> str:
    return f"task-{index}"


# Random text to cut words from: drawing each character costs more CPU in the runners than the
# store calls being measured; a slice at a random offset is as random for a store and much cheaper.
_POOL = "".join(random.Random(0).choices(_ALPHABET, k=1 << 16))


def _word(rng: random.Random, lo: int, hi: int) -> str:
    k = rng.randint(lo, hi)
    start = rng.randrange(len(_POOL) - k)
    return _POOL[start : start + k]


def _random_dict(rng: random.Random, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(rng.randint(2, 6)):
        key = _word(rng, 3, 20)
        out[key] = _random_dict(rng, depth - 1) if depth > 1 else _word(rng, 5, 300)
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


#: At most this many attributes per span: OpenTelemetry's SDK keeps 128 per span by default and
#: drops (with a warning each) the oldest beyond that, on both stacks alike.
MAX_ATTRIBUTES = 120


def random_attributes(rng: random.Random) -> dict[str, str]:
    """Flattened random attributes as Agent-lightning's benchmark makes them: depth 1-3, breadth 2-6,
    keys of 3-20 characters, values of 5-300 characters; the first ``MAX_ATTRIBUTES`` of them."""
    flat = _flatten(_random_dict(rng, rng.randint(1, 3)))
    return dict(kv for kv, _ in zip(flat, range(MAX_ATTRIBUTES), strict=False))


def plan_task(seed: int, task: str, max_rounds: int, sleep_s: float) -> TaskPlan:
    """The deterministic plan of ``task`` under ``seed``."""
    rng = random.Random(f"{seed}:{task}")
    rounds = rng.randint(1, max_rounds)
    selected = rng.randint(0, rounds - 1)
    steps: list[Step] = []
    for i in range(rounds):
        first = random_attributes(rng)
        if i == selected:
            first["task"] = task
        children = (
            SpanPlan(f"round{i}_1", rng.uniform(0.0, sleep_s), first),
            SpanPlan(f"round{i}_2", rng.uniform(0.0, sleep_s), random_attributes(rng)),
        )
        steps.append(Step(i, children=children))
        if rng.uniform(0, 1) < 0.5:
            steps.append(Step(i, reward=rng.uniform(0.0, 1.0)))
    final = SpanPlan("final", rng.uniform(0.0, sleep_s), random_attributes(rng))
    return TaskPlan(task, rounds, tuple(steps), final, rng.uniform(1.0, 2.0))


async def run_plan(plan: TaskPlan, tracer: Any, emit_reward: Any, sleep: Any) -> None:
    """What the agent does with its plan: nested OpenTelemetry spans, sleeps and rewards.

    Args:
        plan: The task's plan.
        tracer: An ``opentelemetry.trace.Tracer`` (the stack's tracer provider).
        emit_reward: The stack's ``emit_reward``.
        sleep: ``asyncio.sleep``.
    """
    for step in plan.steps:
        if step.reward is not None:
            emit_reward(step.reward)
            continue
        assert step.children is not None
        with tracer.start_as_current_span(f"agent{step.round_index}"):
            for child in step.children:
                with tracer.start_as_current_span(child.name) as span:
                    await sleep(child.sleep_s)
                    span.set_attributes(child.attributes)
    with tracer.start_as_current_span(plan.final.name) as span:
        await sleep(plan.final.sleep_s)
        span.set_attributes(plan.final.attributes)
    emit_reward(plan.final_reward)


# -- what the algorithm checks ------------------------------------------------------------------


def check_rollout(
    spans: list[Any], plan: PlanCheck | TaskPlan, get_reward_value: Any, find_final_reward: Any
) -> str | None:
    """Check the stored spans of a rollout against its plan; ``None`` when they match, else why not.

    Checks: every span the agent opened is there (by name), one span carries ``task``, the number of
    reward spans is the planned one, and the final reward is the planned one.
    """
    names = [s.name for s in spans]
    expected = {f"agent{i}" for i in range(plan.rounds)}
    expected |= {f"round{i}_{k}" for i in range(plan.rounds) for k in (1, 2)} | {"final"}
    missing = expected.difference(names)
    if missing:
        return f"{plan.task}: {len(missing)} of {len(expected)} agent spans missing (e.g. {sorted(missing)[0]})"
    if not any((s.attributes or {}).get("task") == plan.task for s in spans):
        return f"{plan.task}: no span carries task={plan.task}"
    rewards = [v for s in spans if (v := get_reward_value(s)) is not None]
    if len(rewards) != plan.n_rewards:
        return f"{plan.task}: {len(rewards)} reward spans, expected {plan.n_rewards}"
    final = find_final_reward(spans)
    if final is None or abs(final - plan.final_reward) > 1e-6:
        return f"{plan.task}: final reward {final}, expected {plan.final_reward:.6f}"
    return None


# -- bounds ----------------------------------------------------------------------------------------


def expected_spans_per_rollout(max_rounds: int) -> float:
    """Mean spans per rollout: ``3 R + 1`` named spans plus ``R / 2 + 1`` rewards, ``E[R] = (max+1)/2``."""
    mean_rounds = (max_rounds + 1) / 2
    return 3.5 * mean_rounds + 2


def expected_sleep_per_rollout(max_rounds: int, sleep_s: float) -> float:
    """Mean seconds an agent sleeps per rollout: ``(2 E[R] + 1)`` sleeps of mean ``sleep_s / 2``."""
    return (2 * (max_rounds + 1) / 2 + 1) * sleep_s / 2


def agent_bound(scn: Scenario, plans: Sequence[PlanCheck | TaskPlan] | None = None) -> float:
    """Rollouts/s a store taking zero time would give: ``runners / (mean sleep per rollout)``, with
    ``single`` mode's in-flight count instead of the runners when it is smaller (``half_load``).

    With ``plans`` the mean comes from the planned sleeps of this run, else from the expectation.
    Ignores the batch barrier (a batch ends with its slowest rollout) and all runner CPU, so it is
    an upper bound. ``inf`` when the agent does not sleep.
    """
    mean = (
        sum(p.sleep_s for p in plans) / len(plans) if plans else expected_sleep_per_rollout(scn.max_rounds, scn.sleep_s)
    )
    busy = min(scn.n_runners, scn.concurrency) if scn.mode == "single" else scn.n_runners  # at most this many run
    return math.inf if mean <= 0 else busy / mean


def agent_cpu_s_per_rollout(seed: int, scn: Scenario, n: int = 64) -> float:
    """CPU seconds the agent itself spends per rollout, with no store at all: making the task's plan
    and running it (``run_plan``) on an OpenTelemetry ``TracerProvider`` with no span processor,
    rewards as plain spans, no sleeps. Measured in the calling process (it imports the
    OpenTelemetry SDK, which both stacks' venvs have, so the rest of this module stays stdlib-only).
    """
    import time

    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("bench.agent_cpu")

    def reward(value: float) -> None:
        with tracer.start_as_current_span("agentlightning.annotation") as span:
            span.set_attributes({"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value})

    async def nap(_: float) -> None:
        return None

    t0 = time.thread_time()
    for i in range(n):
        plan = plan_task(seed, f"cpu-probe-{i}", scn.max_rounds, 0.0)
        # nothing in run_plan suspends (``nap`` returns at once), so the coroutine runs to its end
        # on the first send: no event loop needed, and this works inside the driver's running loop
        coro = run_plan(plan, tracer, reward, nap)
        try:
            coro.send(None)
        except StopIteration:
            pass
        else:
            coro.close()
            raise RuntimeError("run_plan suspended although it has nothing to wait for")
    return (time.thread_time() - t0) / n


def agent_cpu_bound(cpu_s_per_rollout: float, cores: int) -> float:
    """Rollouts/s the machine's cores could give if the agent's own CPU were the only work
    (the bound for scenarios without sleeps, where ``agent_bound`` is infinite)."""
    return math.inf if cpu_s_per_rollout <= 0 else cores / cpu_s_per_rollout


def batch_barrier_bound(scn: Scenario, plans: Sequence[PlanCheck | TaskPlan]) -> float | None:
    """For ``batch`` mode: rollouts/s with a zero-time store *and* the wait for each batch's slowest
    rollout (each batch's planned sleeps list-scheduled on the runners in queue order); ``None``
    for the other modes or without sleeps."""
    import heapq

    if scn.mode != "batch" or not plans or scn.sleep_s <= 0:
        return None
    total = 0.0
    for start in range(0, len(plans), scn.batch_size):
        free = [0.0] * scn.n_runners
        for p in plans[start : start + scn.batch_size]:
            heapq.heapreplace(free, free[0] + p.sleep_s)
        total += max(free)
    return len(plans) / total if total > 0 else None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]
