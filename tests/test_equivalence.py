"""Equivalence of the backends, proven by a stateful property test (issue 11, item 3).

Hypothesis drives random sequences of store calls against the in-memory backend and the JetStream
+ Postgres backend at once, with the same arguments and the same fake clock. Each call must return
the same value on both or raise the same error type, and after every step every read must agree:
rollouts, attempts, spans, workers, resources; the queue order is checked by the ``dequeue`` rule,
since reading the queue takes from it.

Only this module's *adapter* (``open_backends``, ``close_backends``, ``settle``, ``watchdog_tick``)
knows how each backend is built, how the clock reaches it and how its watchdog is ticked; the state
machine sees two ``LightningStore`` objects.

Normalisations (what may legitimately differ, and nothing else):

* generated ids (``ro-…``, ``at-…``, ``rs-…``) are random: each backend's ids are renamed by order of
  first appearance in the results (``R0``, ``A0``, ``S0``…), so the n-th rollout created on one is
  compared with the n-th created on the other;
* times are not normalised: both backends read the same fake clock, which only the
  ``advance_clock`` rule moves, so every time they record is the same float;
* errors are compared by type: messages may quote the (different) generated ids;
* dict key order is ignored (Postgres ``jsonb`` stores keys sorted; Python compares dicts by content).

Examples and steps are bounded (``MAX_EXAMPLES`` × ``STEPS``) and derandomized, so a run is
reproducible and takes a minute or two; each example gets its own JetStream namespace. Shrinking is
off by default (each shrink step replays a sequence against real servers); set
``EVENTLIGHT_EQUIV_SHRINK=1`` to get a minimal failing sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from conftest import FakeClock, fresh_namespace
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from eventlight.core.types import EnqueueRolloutRequest, PaginatedResult, PromptTemplate, RolloutConfig, Span
from eventlight.ops import Services
from eventlight.settings import Settings
from eventlight.store.base import UNSET
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.memory import InMemoryLightningStore

MAX_EXAMPLES = 60
STEPS = 30
NO_BACKGROUND_WATCHDOG_S = 3600.0  # longer than an example: the watchdog runs only when ticked

# -- adapter: the only part that knows the backends' construction and clock (issue 11 refactor) --


@dataclass
class Backends:
    """The two stores under test and what closing them must undo."""

    memory: Any
    jetstream: Any
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


async def open_backends(services: tuple[Settings, Services], clock: FakeClock) -> Backends:
    """Both backends on one fake clock (``clock=``); JetStream in a fresh namespace of the session's
    servers. Neither background watchdog runs by itself: ``watchdog_tick`` runs it."""
    stack = contextlib.AsyncExitStack()
    try:
        ns = await stack.enter_async_context(fresh_namespace(services))
        memory = await stack.enter_async_context(
            InMemoryLightningStore(clock=clock, watchdog_interval_s=NO_BACKGROUND_WATCHDOG_S)
        )
        js = await stack.enter_async_context(
            JetStreamLightningStore(ns, pg_dsn=ns.pg_dsn, watchdog_interval_s=NO_BACKGROUND_WATCHDOG_S, clock=clock)
        )
    except BaseException:
        await stack.aclose()
        raise
    return Backends(memory, js, stack)


async def close_backends(b: Backends) -> None:
    await b._stack.aclose()


async def settle(b: Backends) -> None:
    """Wait until JetStream's projection holds everything on the stream (the watchdog's appends
    included, which the store's own read-your-writes does not track)."""
    await b.jetstream.sync_all(timeout_s=10)


async def watchdog_tick(b: Backends, store: Any, now: float) -> int:
    """One watchdog pass of ``store`` at ``now``; returns how many rollouts it acted on."""
    if store is b.jetstream:
        await b.jetstream.sync_all(timeout_s=10)  # the projector decides on the states it has projected
    return len({e.rollout_id for e in await store.run_watchdog(now)})


# -- normalisation -----------------------------------------------------------------------------

_GENERATED = re.compile(r"^(ro|at|rs)-[0-9a-f]+$")
_LETTER = {"ro": "R", "at": "A", "rs": "S"}


class IdNames:
    """One backend's generated ids, renamed by order of first appearance."""

    def __init__(self) -> None:
        self.name_of: dict[str, str] = {}
        self.id_of: dict[str, str] = {}
        self.count: dict[str, int] = {}

    def name(self, real: str) -> str:
        if real not in self.name_of:
            kind = real[:2]
            n = self.count.get(kind, 0)
            self.count[kind] = n + 1
            self.name_of[real] = f"{_LETTER[kind]}{n}"
            self.id_of[self.name_of[real]] = real
        return self.name_of[real]

    def real(self, name: str) -> str:
        return self.id_of.get(name, name)  # names never created here (a missing id) pass unchanged

    def normalise(self, value: Any) -> Any:
        if isinstance(value, PaginatedResult):
            return {"items": self.normalise(list(value.items)), "total": value.total}
        if isinstance(value, msgspec.Struct):
            value = {"__type__": type(value).__name__, **msgspec.to_builtins(value)}
        if isinstance(value, dict):
            return {k: self.normalise(value[k]) for k in sorted(value, key=str)}
        if isinstance(value, list | tuple):
            return [self.normalise(v) for v in value]
        if isinstance(value, str) and _GENERATED.match(value):
            return self.name(value)
        return value


def _translate(names: IdNames, value: Any) -> Any:
    """Replace id names (``R0``…) by this backend's real ids, inside arguments."""
    if isinstance(value, str):
        return names.real(value)
    if isinstance(value, list):
        return [_translate(names, v) for v in value]
    if isinstance(value, dict):
        return {k: _translate(names, v) for k, v in value.items()}
    if isinstance(value, Span | EnqueueRolloutRequest):
        fields = {f: _translate(names, getattr(value, f)) for f in value.__struct_fields__}
        return type(value)(**fields)
    return value


# -- the state machine -------------------------------------------------------------------------

WORKERS = st.sampled_from([None, "w1", "w2", "w3"])
ANY_WORKER = st.sampled_from([None, "w1", "w2", "bad id.with dots"])
ATTEMPT_STATUS = st.sampled_from([UNSET, "preparing", "running", "succeeded", "failed", "timeout", "unresponsive"])
ROLLOUT_STATUS = st.sampled_from([UNSET, "queuing", "running", "succeeded", "failed", "cancelled", "requeuing"])
METADATA = st.one_of(st.just(UNSET), st.dictionaries(st.sampled_from(["k", "b", "a"]), st.integers(0, 3), max_size=2))
CONFIG = st.one_of(
    st.none(),
    st.builds(
        RolloutConfig,
        timeout_seconds=st.sampled_from([None, 10.0, 60.0]),
        unresponsive_seconds=st.sampled_from([None, 5.0, 30.0]),
        max_attempts=st.integers(1, 3),
        retry_condition=st.lists(st.sampled_from(["failed", "timeout", "unresponsive"]), unique=True, max_size=3),
    ),
)
RESOURCES = st.builds(lambda t: {"prompt": PromptTemplate(template=f"say {t} {{x}}")}, st.sampled_from("abc"))
SPAN_IDS = st.sampled_from([f"{i:016x}" for i in range(1, 5)])  # few, so duplicates happen


class Equivalence(RuleBasedStateMachine):
    """Each rule calls one store method on both backends and compares the outcomes."""

    services: tuple[Settings, Services] | None = None

    def __init__(self) -> None:
        super().__init__()
        assert self.services is not None
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.backends = self.loop.run_until_complete(open_backends(self.services, self.clock))
        self.names = (IdNames(), IdNames())
        self.rollouts: list[str] = []  # names, in creation order
        self.attempts: dict[str, list[str]] = {}
        self.resources: list[str] = []

    def teardown(self) -> None:
        try:
            self.loop.run_until_complete(close_backends(self.backends))
        finally:
            self.loop.close()

    # -- running one call on both -----------------------------------------------------------

    def both(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on both stores; assert equal outcomes; return the (normalised) result."""
        outcomes = []
        stores = (self.backends.memory, self.backends.jetstream)
        for store, names in zip(stores, self.names, strict=True):
            a = [_translate(names, x) for x in args]
            kw = {k: _translate(names, v) for k, v in kwargs.items()}
            outcomes.append(self.loop.run_until_complete(_outcome(names, getattr(store, method)(*a, **kw))))
        memory, js = outcomes
        assert memory == js, f"{method}{_show(args, kwargs)}:\n  memory:    {memory}\n  jetstream: {js}"
        return memory[1] if memory[0] == "ok" else None

    def learn(self, result: Any) -> None:
        """Remember the rollouts, attempts and resources a result shows (by name)."""
        if isinstance(result, list):
            for r in result:
                self.learn(r)
            return
        if not isinstance(result, dict):
            return
        rid = result.get("rollout_id")
        if isinstance(rid, str) and rid.startswith("R") and rid not in self.attempts:
            self.rollouts.append(rid)
            self.attempts[rid] = []
        attempt = result.get("attempt") if result.get("__type__") == "AttemptedRollout" else None
        if isinstance(attempt, dict) and attempt["attempt_id"] not in self.attempts[attempt["rollout_id"]]:
            self.attempts[attempt["rollout_id"]].append(attempt["attempt_id"])
        res = result.get("resources_id")
        if result.get("__type__") == "ResourcesUpdate" and res not in self.resources:
            self.resources.append(res)

    def pick_rollout(self, i: int) -> str:
        return self.rollouts[i % len(self.rollouts)] if self.rollouts and i >= 0 else "ro-missing"

    def pick_resources(self, i: int | None) -> str | None:
        if i is None:
            return None
        return self.resources[i % len(self.resources)] if self.resources and i >= 0 else "rs-missing"

    # -- rules -------------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0, 15.0, 40.0, 90.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule(
        value=st.integers(0, 9),
        mode=st.sampled_from([None, "train", "val"]),
        res=st.one_of(st.none(), st.integers(-1, 5)),
        config=CONFIG,
        metadata=st.one_of(st.none(), st.dictionaries(st.just("k"), st.integers(0, 3), max_size=1)),
    )
    def enqueue_rollout(self, value: int, mode: str | None, res: int | None, config: Any, metadata: Any) -> None:
        self.learn(
            self.both(
                "enqueue_rollout",
                {"x": value},
                mode=mode,
                resources_id=self.pick_resources(res),
                config=config,
                metadata=metadata,
            )
        )

    @rule(items=st.lists(st.tuples(st.integers(0, 9), st.one_of(st.none(), st.integers(-1, 5)), CONFIG), max_size=3))
    def enqueue_many_rollouts(self, items: list[tuple[int, int | None, Any]]) -> None:
        requests = [
            EnqueueRolloutRequest(input={"x": v}, resources_id=self.pick_resources(res), config=config)
            for v, res, config in items
        ]
        self.learn(self.both("enqueue_many_rollouts", requests))

    @rule(worker=WORKERS)
    def dequeue_rollout(self, worker: str | None) -> None:
        self.learn(self.both("dequeue_rollout", worker_id=worker))

    @rule(i=st.integers(-1, 20), worker=ANY_WORKER)
    def start_attempt(self, i: int, worker: str | None) -> None:
        self.learn(self.both("start_attempt", self.pick_rollout(i), worker_id=worker))

    def pick_pair(self, k: int) -> tuple[str, str]:
        """A known (rollout, attempt) pair; ``k < 0`` names an attempt that does not exist."""
        pairs = [(rid, aid) for rid, aids in self.attempts.items() for aid in aids]
        if k < 0 or not pairs:
            return (self.rollouts[0] if self.rollouts else "ro-missing"), "at-missing"
        return pairs[k % len(pairs)]

    def _span(self, k: int, span_id: str, seq: int) -> Span:
        rid, aid = self.pick_pair(k)
        return Span(
            rollout_id=rid,
            attempt_id=aid,
            sequence_id=seq,
            trace_id="ab" * 16,
            span_id=span_id,
            parent_id=None,
            name="step",
            attributes={"n": seq},
            start_time=self.clock.t,
            end_time=self.clock.t,
        )

    @precondition(lambda self: any(self.attempts.values()))
    @rule(k=st.integers(-1, 20), span_id=SPAN_IDS, seq=st.integers(1, 4))
    def add_span(self, k: int, span_id: str, seq: int) -> None:
        self.both("add_span", self._span(k, span_id, seq))

    @precondition(lambda self: any(self.attempts.values()))
    @rule(spans=st.lists(st.tuples(st.integers(-1, 20), SPAN_IDS, st.integers(1, 4)), max_size=3))
    def add_many_spans(self, spans: list[tuple[int, str, int]]) -> None:
        self.both("add_many_spans", [self._span(*s) for s in spans])

    @precondition(lambda self: bool(self.rollouts))
    @rule(k=st.integers(-1, 20), latest=st.booleans(), status=ATTEMPT_STATUS, metadata=METADATA)
    def update_attempt(self, k: int, latest: bool, status: Any, metadata: Any) -> None:
        rid, aid = self.pick_pair(k)
        self.both("update_attempt", rid, "latest" if latest else aid, status=status, metadata=metadata)

    @precondition(lambda self: bool(self.rollouts))
    @rule(i=st.integers(-1, 20), status=ROLLOUT_STATUS, metadata=METADATA, config=st.one_of(st.just(UNSET), CONFIG))
    def update_rollout(self, i: int, status: Any, metadata: Any, config: Any) -> None:
        self.both("update_rollout", self.pick_rollout(i), status=status, metadata=metadata, config=config)

    @rule(resources=RESOURCES)
    def add_resources(self, resources: Any) -> None:
        self.learn(self.both("add_resources", resources))

    @rule(i=st.integers(-1, 5), resources=RESOURCES)
    def update_resources(self, i: int, resources: Any) -> None:
        self.learn(self.both("update_resources", self.pick_resources(i) or "rs-missing", resources))

    @rule(name=st.sampled_from(["prod", "staging"]), resources=RESOURCES)
    def update_named_resources(self, name: str, resources: Any) -> None:
        self.learn(self.both("update_resources", name, resources))

    @rule(worker=ANY_WORKER.filter(lambda w: w is not None), stats=st.one_of(st.just(UNSET), st.just({"gpu": 1})))
    def update_worker(self, worker: str, stats: Any) -> None:
        self.both("update_worker", worker, heartbeat_stats=stats)

    @rule()
    def watchdog_tick(self) -> None:
        acted = [
            self.loop.run_until_complete(watchdog_tick(self.backends, store, self.clock.t))
            for store in (self.backends.memory, self.backends.jetstream)
        ]
        assert acted[0] == acted[1], f"watchdog at {self.clock.t}: memory acted on {acted[0]}, jetstream {acted[1]}"

    # -- every read, after every step --------------------------------------------------------

    @invariant()
    def reads_agree(self) -> None:
        self.loop.run_until_complete(settle(self.backends))
        self.both("query_rollouts")
        self.both("query_workers")
        self.both("query_resources")
        self.both("get_latest_resources")
        for name in self.resources + ["prod", "staging"]:
            self.both("get_resources_by_id", name)
        for rid in self.rollouts:
            self.both("get_rollout_by_id", rid)
            self.both("query_attempts", rid)
            self.both("get_latest_attempt", rid)
            self.both("query_spans", rid)
            self.both("query_spans", rid, "latest")
        for wid in ("w1", "w2", "w3"):
            self.both("get_worker_by_id", wid)


async def _outcome(names: IdNames, call: Any) -> tuple[str, Any]:
    try:
        return "ok", names.normalise(await call)
    except Exception as e:  # the error type is the outcome; messages may quote generated ids
        return "raises", type(e).__name__


def _show(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items() if v is not UNSET]
    return f"({', '.join(parts)})"


# 60 examples against real NATS and Postgres: ~2 min on a quiet 2-core machine, 325 s seen at load 12,
# past pytest's 300 s default (a hang guard, not a speed check).
@pytest.mark.timeout(900)
def test_backends_are_equivalent(services: tuple[Settings, Services]) -> None:
    shrink = os.environ.get("EVENTLIGHT_EQUIV_SHRINK") == "1"
    Equivalence.services = services
    run_state_machine_as_test(
        Equivalence,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            database=None,
            phases=list(Phase) if shrink else [Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        ),
    )
