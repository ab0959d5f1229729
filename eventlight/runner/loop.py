"""``LitAgentRunner``: a queue consumer that runs an agent on each rollout it claims.

One attempt, in order (Agent-lightning ``LitAgentRunner._step_impl``): resolve the rollout's
resources, call hooks ``on_rollout_start`` (then the agent's own), enter the tracer's
``trace_context`` (spans stream to the store while the agent runs), ``on_trace_start``, run the
agent (``training_rollout*`` when ``mode == "train"``, else ``validation_rollout*``),
``on_trace_end``, record a returned reward or spans, ``on_rollout_end`` (the agent's own, then the
hooks'), then ``update_attempt(status="succeeded" | "failed")``.

Differences from 0.3.0, each deliberate:
    * missing resources fail the attempt with a clear reason instead of leaving it ``preparing``;
    * a cancelled rollout (``CancelledError``, e.g. Ctrl+C) is recorded ``failed`` and the
      cancellation re-raised, not recorded ``succeeded``; its ``eventlight.status_reason`` says why
      (``cancel_reason``, which ``RunnerPool`` sets before it cancels: SIGTERM, a lost NATS
      connection; else "the runner was cancelled (CancelledError) while the attempt ran");
    * a rollout cancelled while its agent runs (``update_rollout(status="cancelled")``, GRPO's and
      APO's late rollouts) stops the agent: each heartbeat asks the store whether the rollout was
      cancelled or the attempt ended by a cancel, which holds after a requeue too
      (``rollout_cancelled``: eventlight's answers from its log; another store is asked
      ``get_rollout_by_id``); so heartbeats off (``heartbeat_interval <= 0``) mean no stop; the agent's
      task is cancelled and given ``_AGENT_CANCEL_GRACE_S`` to end (a synchronous agent in a thread
      cannot be killed: the runner stops waiting and ignores its result), the attempt is recorded
      ``failed`` with ``ROLLOUT_CANCELLED`` as its reason in one INFO line, and the runner takes the
      next rollout; 0.3.0's runner is never told and runs the agent to its end;
    * an empty queue is a long poll in the server (``dequeue_rollout(wait_s=poll_interval)``), not a
      sleep loop, and is never an error (peer failure C19);
    * on eventlight's store the resources are read with the claim (``dequeue_rollout(
      read_resources=True)``, then ``claimed_resources``): both requests leave together, one round
      trip instead of two, and the agent gets the resources as they were at its claim;
    * heartbeats run as an asyncio task (``update_worker`` with a system snapshot every
      ``heartbeat_interval`` seconds); on the JetStream store they also keep the claimed queue
      message in progress; when the attempt's rollout has ``unresponsive_seconds``, each also
      stamps the attempt's ``last_heartbeat_time`` (0.3.0 counts spans only), so an agent that is
      busy without spans (a long LLM call) is not taken for a dead runner: ``unresponsive`` then
      means the runner stopped beating, and ``timeout_seconds`` bounds a slow agent; when ``iter``
      ends (returns, raises or is cancelled) a last heartbeat's stats carry ``STOPPED_AT``
      (``eventlight.store.liveness``), so ``eventlight status`` shows the worker stopped at once
      instead of alive until its heartbeat ages out;
    * a failed dequeue (a NATS error during a claim, a malformed queue message, a timeout) is one
      log line and a retry after a capped backoff (``Backoff``: 0.1 s doubling to 5 s), never the
      end of the loop; failures in a row (an outage) make one warning, the rest DEBUG lines, and
      NATS's ``409 Server Shutdown`` (the server stopping in order) an INFO line
      (``DequeueOutage``); a status the store could not record is retried before the next
      dequeue, so a NATS blip does not leave the attempt ``running``;
    * worker ids are unique across processes and machines: ``Worker-<index>@<host>-<pid>-<tag>``
      (``worker_name``); ``worker_id`` stays the index the Trainer passes, as in Agent-lightning;
    * with ``proxy_token`` set, every ``ProxyLLM`` handed to the agent carries it as ``api_key``
      (the LLM proxy's bearer token; it is never stored with the resources).
    * an agent that overrides ``LitAgent``'s deprecated ``on_rollout_start``/``on_rollout_end``
      has them called around each attempt, as the agent reference says (0.3.0's runner never calls
      them); an exception in one is logged;
    * any real number returned (``numbers.Real``: ``numpy.float32``, ``fractions.Fraction``) is the
      final reward, as a ``float``; 0.3.0 takes ``int``, ``float`` and ``bool`` and fails the attempt
      with ``TypeError`` for the others;
    * returned spans (``list[ReadableSpan]``, ``list[SpanCoreFields]`` or ``list[Span]``) are stored
      in one ``add_many_spans``; a ``Span`` made without ids (``Span.from_attributes``) gets this
      attempt's ids and, as any span with ``sequence_id`` 0, the next sequence id (0.3.0 stores it
      with empty ids); ``ReadableSpan``s the tracer already recorded are dropped as duplicates by
      the store, so 0.3.0's warning about them is not logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from opentelemetry.sdk.trace import ReadableSpan

from eventlight.agent import LitAgent
from eventlight.core.errors import InvalidTransitionError
from eventlight.core.types import CANCELLED_REASON, STATUS_REASON, AttemptedRollout, RolloutConfig, Span
from eventlight.credentials import check_bearer_token
from eventlight.emitter import emit_exception, emit_reward
from eventlight.otel import span_from_readable
from eventlight.recording import SpanCoreFields
from eventlight.runner.claims import ClaimBoard
from eventlight.runner.hooks import Hook
from eventlight.runner.identity import system_snapshot, worker_name
from eventlight.runner.metrics import RunnerMetrics
from eventlight.runner.policy import (
    _claims_before_append,
    _long_polls,
    _reads_resources_with_claims,
    apply_rollout_config,
    rollout_cancelled,
    with_proxy_key,
)
from eventlight.runner.retry import Backoff, DequeueOutage, _describe, _retryable
from eventlight.settings import proxy_token_from_env
from eventlight.store.base import LightningStore
from eventlight.store.futures import mark_seen
from eventlight.store.liveness import STOPPED_AT
from eventlight.tracer import OtelTracer, Tracer

log = logging.getLogger(__name__)

_REASON_CHARS = 500
CANCELLED = "the runner was cancelled (CancelledError) while the attempt ran"
"""The ``eventlight.status_reason`` of an attempt cancelled without a ``cancel_reason``."""
ROLLOUT_CANCELLED = f"{CANCELLED_REASON}; the runner stopped its agent"
"""The ``eventlight.status_reason`` of an attempt whose rollout was cancelled (``update_rollout(
status="cancelled")``) while its agent ran, once its runner stopped the agent."""
_STOP_BEAT_TIMEOUT_S = 5.0
"""Seconds the last heartbeat (the one saying the runner stopped) may take before the runner stops without it."""
_AGENT_CANCEL_GRACE_S = 5.0
"""Seconds an agent cancelled because its rollout was cancelled may take to end before the runner
leaves it behind and takes the next rollout."""


class _AgentRun:
    """The attempt whose agent is in flight; ``stop`` is done once it was seen cancelled."""

    def __init__(self, rollout_id: str, attempt_id: str):
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class _RolloutCancelled(Exception):
    """The attempt's rollout was cancelled while its agent ran; the message says what became of the
    agent where it is more than "cancelled"."""


class LitAgentRunner:
    """Runs an agent on rollouts from the store's queue.

    Args:
        tracer: Records the agent's spans; defaults to ``OtelTracer()``.
        max_rollouts: Stop after this many rollouts (``None``: until stopped).
        poll_interval: Seconds one dequeue waits for work before checking the stop event.
        heartbeat_interval: Seconds between heartbeats; ``<= 0`` disables them, and with them the
            stop of an agent whose rollout was cancelled (each heartbeat asks about it): such an
            agent then runs to its end, as in 0.3.0, and the watchdog's ``unresponsive_seconds``
            counts spans only.
        metrics: Where attempts and dequeue failures are counted (``RunnerMetrics.serve`` exposes
            them to Prometheus); ``None``: not counted.
        rollout_config: eventlight's: the ``RolloutConfig`` given to each claimed rollout that was
            enqueued with the default one (``eventlight runner --max-attempts ...``).
        proxy_token: The LLM proxy's bearer token, put into the ``api_key`` of each ``ProxyLLM``
            resource the agent gets (an agent passing ``llm.api_key`` to its OpenAI client works
            unchanged); ``None`` (default): ``$EVENTLIGHT_PROXY_TOKEN`` or the file
            ``$EVENTLIGHT_PROXY_TOKEN_FILE`` names, else the resources are handed over as stored;
            ``""``: none. ``Trainer(llm_proxy=...)`` sets it from the proxy's ``token``.

    Raises:
        InvalidInputError: ``$EVENTLIGHT_PROXY_TOKEN_FILE`` cannot be read or is empty, or the token
            holds a space or a character outside visible ASCII (no client could send it).
    """

    def __class_getitem__(cls, item: Any) -> type[LitAgentRunner]:
        """``LitAgentRunner[str]`` (0.3.0's runner is generic in the task type) is the class itself."""
        return cls

    def __init__(
        self,
        tracer: Tracer | None = None,
        max_rollouts: int | None = None,
        poll_interval: float = 1.0,
        heartbeat_interval: float = 10.0,
        metrics: RunnerMetrics | None = None,
        rollout_config: RolloutConfig | None = None,
        proxy_token: str | None = None,
    ):
        self.tracer = tracer or OtelTracer()
        self.proxy_token = (proxy_token if proxy_token is not None else proxy_token_from_env()) or None
        if self.proxy_token is not None:
            check_bearer_token(self.proxy_token, "the LLM proxy's token" if proxy_token else "EVENTLIGHT_PROXY_TOKEN")
        self.metrics = metrics
        self.rollout_config = rollout_config
        self.max_rollouts = max_rollouts
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self._in_flight: tuple[str, str] | None = None  # (rollout id, attempt id) the heartbeats stamp
        self._agent_run: _AgentRun | None = None  # the agent running, which a cancel of its rollout stops
        self.worker_id: int | None = None
        self.sync_agent_in_thread = False
        """Run a synchronous agent's rollout in a thread (``asyncio.to_thread``) instead of on the
        event loop; ``RunnerPool`` sets it for runners that share a process."""
        self.claims: ClaimBoard | None = None
        """Where this runner writes the attempts it holds (its row ``worker_id``), so that its pool
        can record them ``failed`` if the process dies; ``RunnerPool`` sets it in each process."""
        self.cancel_reason: str | None = None
        """Why the attempt in flight is cancelled, recorded as its ``eventlight.status_reason``
        (``RunnerPool`` sets it before it cancels the runner); ``None``: ``CANCELLED``."""
        self._agent: LitAgent[Any] | None = None
        self._seen_errors: set[tuple[str, str]] = set()
        self._store: LightningStore | None = None
        self._hooks: Sequence[Hook] = ()
        # (rollout_id, attempt_id) -> (status, metadata) still to record
        self._unrecorded: dict[tuple[str, str], tuple[str, dict[str, Any] | None]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def init(self, agent: LitAgent[Any], *, hooks: Sequence[Hook] | None = None, **_: Any) -> None:
        self._agent = agent
        self._hooks = tuple(hooks or ())
        agent.set_runner(self)

    def init_worker(self, worker_id: int, store: LightningStore, **_: Any) -> None:
        self.worker_id = worker_id
        self._store = store
        self.tracer.init_worker(worker_id, store)

    def teardown_worker(self, worker_id: int, *args: Any, **kwargs: Any) -> None:
        self.tracer.teardown_worker(worker_id)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self._agent = None

    @contextlib.contextmanager
    def run_context(
        self,
        *,
        agent: LitAgent[Any],
        store: LightningStore,
        hooks: Sequence[Hook] | None = None,
        worker_id: int | None = None,
    ) -> Any:
        """``init`` + ``init_worker`` on entry, the teardowns on exit (synchronous context manager)."""
        wid = 0 if worker_id is None else worker_id
        self.init(agent, hooks=hooks)
        try:
            self.init_worker(wid, store)
            try:
                yield self
            finally:
                self.teardown_worker(wid)
        finally:
            self.teardown()

    def get_worker_id(self) -> str:
        """This runner's worker id (``worker_name``): ``Worker-<index>@<host>-<pid>-<tag>``."""
        return worker_name(self.worker_id)

    def get_store(self) -> LightningStore:
        if self._store is None:
            raise ValueError("Store not initialized. Call init_worker() first.")
        return self._store

    def _agent_or_raise(self) -> LitAgent[Any]:
        if self._agent is None:
            raise ValueError("Agent not initialized. Call init() first.")
        return self._agent

    # -- the loop ----------------------------------------------------------------------------

    async def iter(self, *, event: Any = None) -> int:
        """Claim and run rollouts until ``event`` is set or ``max_rollouts`` is reached.

        Returns:
            How many rollouts this runner processed.
        """
        store = self.get_store()
        count = 0
        backoff = Backoff()
        outage = DequeueOutage(self.get_worker_id())
        self.cancel_reason = None
        heartbeat = asyncio.create_task(self._heartbeat_loop()) if self.heartbeat_interval > 0 else None
        try:
            while (event is None or not event.is_set()) and (self.max_rollouts is None or count < self.max_rollouts):
                await self._record_unrecorded()
                try:
                    claimed = await self._dequeue(store)
                except Exception as e:  # a NATS error, a malformed queue message, a timeout: never fatal
                    if self.metrics is not None:
                        self.metrics.dequeue_failures.inc()
                    delay = backoff.next()
                    outage.failed(e, delay)
                    await asyncio.sleep(delay)
                    continue
                backoff.reset()
                outage.over()
                if claimed is None:
                    continue
                await self._step_impl(claimed)
                count += 1
                if count == 1 or count % 10 == 0:
                    log.info("[%s] processed %d rollouts", self.get_worker_id(), count)
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
                await self._say_stopped(store)
        log.info("[%s] finished: %d rollouts", self.get_worker_id(), count)
        return count

    async def _dequeue(self, store: LightningStore) -> AttemptedRollout | None:
        """Claim the next rollout, on the claim board (``claims``) from before the store records it
        where the store says when (``on_claim``), else once it has."""
        if self.claims is not None and _claims_before_append(store):
            return await self._claim_on_board(store)
        claimed = await self._poll(store)
        if claimed is not None:
            self._hold(claimed.rollout_id, claimed.attempt.attempt_id)
        return claimed

    async def _claim_on_board(self, store: LightningStore) -> AttemptedRollout | None:
        """``dequeue_rollout`` writing each claim on the claim board before its append (``on_claim``),
        so a process killed once the store holds the claim, before the runner hears of it, leaves it
        there for its pool (``abandon_attempts``); a claim that was not made is wiped again."""
        written: list[tuple[str, str]] = []  # the last claim written, until the dequeue returns

        def on_claim(rollout_id: str, attempt_id: str) -> None:
            for key in written:  # the store goes on to another claim only when that one was refused
                self._release(*key)
            written[:] = [(rollout_id, attempt_id)]
            self._hold(rollout_id, attempt_id)

        claimed = None
        try:
            claimed = await self._poll(store, on_claim=on_claim)
            return claimed
        finally:
            made = None if claimed is None else (claimed.rollout_id, claimed.attempt.attempt_id)
            for key in written:
                if key != made:  # refused, or the dequeue failed (a cancelled claim the store settles)
                    self._release(*key)

    async def _poll(
        self, store: LightningStore, on_claim: Callable[[str, str], None] | None = None
    ) -> AttemptedRollout | None:
        told: dict[str, Any] = {} if on_claim is None else {"on_claim": on_claim}
        if _reads_resources_with_claims(store):  # eventlight's store: the resources read with the claim
            return await store.dequeue_rollout(  # type: ignore[call-arg]
                worker_id=self.get_worker_id(), wait_s=self.poll_interval, read_resources=True, **told
            )
        if _long_polls(store):
            return await store.dequeue_rollout(worker_id=self.get_worker_id(), wait_s=self.poll_interval, **told)  # type: ignore[call-arg]
        claimed = await store.dequeue_rollout(worker_id=self.get_worker_id(), **told)
        if claimed is None:
            await asyncio.sleep(self.poll_interval)
        return claimed

    async def _heartbeat_loop(self) -> None:
        store = self.get_store()
        while True:
            try:
                await store.update_worker(self.get_worker_id(), system_snapshot())
                if (in_flight := self._in_flight) is not None:
                    await store.update_attempt(*in_flight, last_heartbeat_time=time.time())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("[%s] heartbeat failed: %s", self.get_worker_id(), e)
            await self._stop_agent_if_cancelled(store)
            await asyncio.sleep(self.heartbeat_interval)

    async def _stop_agent_if_cancelled(self, store: LightningStore) -> None:
        """Ask whether the rollout of the agent in flight was cancelled; if so, have it stopped
        (``_agent_until_cancelled``). A store that cannot tell is logged at DEBUG: the heartbeat
        just before has warned of an outage."""
        run = self._agent_run
        if run is None or run.stop.done():
            return
        try:
            cancelled = await rollout_cancelled(store, run.rollout_id, run.attempt_id)
        except Exception as e:
            log.debug(
                "[%s] could not tell whether rollout %s was cancelled: %s", self.get_worker_id(), run.rollout_id, e
            )
            return
        if cancelled and not run.stop.done():
            run.stop.set_result(None)

    async def _say_stopped(self, store: LightningStore) -> None:
        """The last heartbeat: its stats say when this runner stopped (``STOPPED_AT``); a failure is
        logged. A store that is closing or closed (``closing``) has no one to tell: skipped."""
        if getattr(store, "closing", False):  # a store of another make may not say
            log.debug("[%s] its store is closed: not recording that it stopped", self.get_worker_id())
            return
        try:
            async with asyncio.timeout(_STOP_BEAT_TIMEOUT_S):
                await store.update_worker(self.get_worker_id(), {**system_snapshot(), STOPPED_AT: time.time()})
        except Exception as e:
            log.warning("[%s] could not record that it stopped (it ages out instead): %s", self.get_worker_id(), e)

    async def step(self, input: Any, *, resources: dict[str, Any] | None = None, mode: str | None = None) -> Any:
        """Run one rollout of ``input`` right away (``start_rollout``, no queue); exceptions propagate."""
        store = self.get_store()
        resources_id = (await store.add_resources(resources)).resources_id if resources else None
        attempted = await store.start_rollout(
            input=input, mode=mode, resources_id=resources_id, worker_id=self.get_worker_id()
        )
        await self._step_impl(attempted, raise_on_exception=True)
        done = await store.get_rollout_by_id(attempted.rollout_id)
        if done is None:
            raise RuntimeError(f"Failed to fetch completed rollout by id after step: {attempted.rollout_id}")
        return done

    # -- one attempt -------------------------------------------------------------------------

    async def _hook(self, name: str, **kwargs: Any) -> None:
        for hook in self._hooks:
            try:
                await getattr(hook, name)(**kwargs)
            except Exception:
                log.exception("Exception during %s hook %r", name, hook)

    async def _agent_hook(self, agent: LitAgent[Any], name: str, *args: Any) -> None:
        """The agent's own deprecated ``on_rollout_start``/``on_rollout_end``, when it overrides them."""
        if getattr(type(agent), name, None) is getattr(LitAgent, name):
            return
        method = getattr(agent, name)
        try:
            if self.sync_agent_in_thread:
                await asyncio.to_thread(method, *args)
            else:
                method(*args)
        except Exception:
            log.exception("Exception during the agent's %s", name)

    async def _resources(self, rollout: AttemptedRollout) -> dict[str, Any]:
        store = self.get_store()
        if _reads_resources_with_claims(store):
            found = await store.claimed_resources(rollout)  # type: ignore[attr-defined]
        elif rollout.resources_id:
            found = await store.get_resources_by_id(rollout.resources_id)
        else:
            found = await store.get_latest_resources()
        if found is None:
            raise RuntimeError(
                f"resources {rollout.resources_id or '(latest)'} of rollout {rollout.rollout_id} not found"
            )
        resources = dict(found.resources)
        if self.proxy_token is None:
            return resources
        return {name: with_proxy_key(res, self.proxy_token) for name, res in resources.items()}

    async def _call_agent(self, agent: LitAgent[Any], rollout: AttemptedRollout, resources: dict[str, Any]) -> Any:
        train = rollout.mode == "train"
        if agent.is_async():
            method = agent.training_rollout_async if train else agent.validation_rollout_async
            return await method(rollout.input, resources=resources, rollout=rollout)
        method = agent.training_rollout if train else agent.validation_rollout
        if self.sync_agent_in_thread:  # the thread gets a copy of this task's context (tracer, attempt)
            return await asyncio.to_thread(method, rollout.input, resources=resources, rollout=rollout)
        return method(rollout.input, resources=resources, rollout=rollout)

    async def _step_impl(self, rollout: AttemptedRollout, raise_on_exception: bool = False) -> str:
        """Run one claimed attempt and record its status; returns the rollout's id."""
        start, status = time.monotonic(), "failed"
        if self.metrics is not None:
            self.metrics.in_flight.inc()
        try:
            status = await self._run_attempt(rollout, raise_on_exception)
        finally:
            self._in_flight = None
            if self.metrics is not None:
                self.metrics.in_flight.dec()
                self.metrics.finished(status, rollout.mode, time.monotonic() - start)
        return rollout.rollout_id

    async def _run_attempt(self, rollout: AttemptedRollout, raise_on_exception: bool) -> str:
        """The attempt, hooks and all; returns the status it recorded."""
        agent = self._agent_or_raise()
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        prefix = f"[{self.get_worker_id()} | Rollout {rid}]"
        status, spans, reason = "failed", [], None
        start = time.monotonic()
        try:
            rollout = await apply_rollout_config(self.get_store(), rollout, self.rollout_config)
            if rollout.config.unresponsive_seconds is not None:  # the heartbeats keep it alive too
                self._in_flight = (rid, aid)
            resources = await self._resources(rollout)
            await self._hook("on_rollout_start", agent=agent, runner=self, rollout=rollout)
            await self._agent_hook(agent, "on_rollout_start", rollout.input, self, self.tracer)
            async with self.tracer.trace_context(name=rid, rollout_id=rid, attempt_id=aid):
                await self._hook("on_trace_start", agent=agent, runner=self, tracer=self.tracer, rollout=rollout)
                try:
                    result = await self._agent_until_cancelled(agent, rollout, resources)
                except _RolloutCancelled:
                    raise
                except Exception as exc:  # visible on the attempt: its type, message and stack
                    with contextlib.suppress(Exception):
                        emit_exception(exc)
                    raise
                await self._hook("on_trace_end", agent=agent, runner=self, tracer=self.tracer, rollout=rollout)
                if isinstance(result, numbers.Real):  # numpy.float32 too (0.3.0: int, float, bool only)
                    emit_reward(float(result))
                    result = None
            lost = self.tracer.undelivered_spans()
            if lost:  # the trace is incomplete: the attempt must not read as a clean success
                reason = f"{lost} span(s) could not be delivered to the store before the attempt finished"
                refusal = getattr(self.tracer, "last_refusal", lambda: "")()
                reason += f" (the store refused: {refusal})" if refusal else ""
                reason = reason[:_REASON_CHARS]
                log.error("%s %s", prefix, reason)
                await self._agent_hook(agent, "on_rollout_end", rollout.input, rollout, self, self.tracer)
                await self._hook("on_rollout_end", agent=agent, runner=self, rollout=rollout, spans=[])
                await self._finish(rid, aid, "failed", prefix, reason=reason, rollout=rollout)
                return "failed"
            spans = await self._post_process(rollout, result)
            status = "succeeded"
            log.debug("%s completed in %.2fs with %d spans", prefix, time.monotonic() - start, len(spans))
        except _RolloutCancelled as stopped:  # not the runner's own cancel: it takes the next rollout
            reason = ROLLOUT_CANCELLED
            note = f" ({stopped})" if str(stopped) else ""
            log.info("%s its rollout was cancelled: stopped its agent%s; recording the attempt as failed", prefix, note)
            await self._agent_hook(agent, "on_rollout_end", rollout.input, rollout, self, self.tracer)
            await self._hook("on_rollout_end", agent=agent, runner=self, rollout=rollout, spans=[])
            await self._finish(rid, aid, "failed", prefix, reason=reason, rollout=rollout, quiet_refusal=True)
            return "failed"
        except asyncio.CancelledError:
            reason = self.cancel_reason or CANCELLED
            log.info("%s cancelled; recording the attempt as failed: %s", prefix, reason)
            await asyncio.shield(self._finish(rid, aid, "failed", prefix, reason=reason, rollout=rollout))
            raise
        except Exception as exc:
            self._log_agent_error(prefix, exc)
            reason = f"{type(exc).__name__}: {exc}"[:_REASON_CHARS]
            if raise_on_exception:
                await self._finish(rid, aid, "failed", prefix, reason=reason, rollout=rollout)
                raise
        await self._agent_hook(agent, "on_rollout_end", rollout.input, rollout, self, self.tracer)
        await self._hook("on_rollout_end", agent=agent, runner=self, rollout=rollout, spans=spans)
        await self._finish(rid, aid, status, prefix, reason=reason, rollout=rollout)
        return status

    async def _agent_until_cancelled(
        self, agent: LitAgent[Any], rollout: AttemptedRollout, resources: dict[str, Any]
    ) -> Any:
        """The agent's result, from a task of its own that is stopped when its rollout is cancelled.

        The heartbeats ask whether the rollout was cancelled (``_stop_agent_if_cancelled``); then
        the task is cancelled (an async agent gets ``CancelledError`` where it awaits) and given
        ``_AGENT_CANCEL_GRACE_S`` to end. One that does not end is left behind: a synchronous agent
        in a thread (``sync_agent_in_thread``) cannot be stopped, it runs on and its result is
        ignored. A runner cancelled itself cancels its agent and waits for it, as before.

        Raises:
            _RolloutCancelled: The rollout was cancelled before the agent ended.
        """
        task = asyncio.ensure_future(self._call_agent(agent, rollout, resources))
        run = self._agent_run = _AgentRun(rollout.rollout_id, rollout.attempt.attempt_id)
        try:
            await asyncio.wait({task, run.stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the runner's own cancel: its agent's too
            task.cancel()
            task.add_done_callback(mark_seen)
            await asyncio.wait({task})
            raise
        finally:
            self._agent_run = None
        if task.done():  # it ended before its rollout's cancel was seen: recorded as it ended
            if not task.cancelled() and task.exception() is not None and await self._was_cancelled(rollout):
                # its rollout was cancelled under it (the end of a run stops the policy server right
                # after cancelling what it gave up on: the agent gets a 503): no error of the agent
                raise _RolloutCancelled(f"it had ended already, raising {type(task.exception()).__name__}")
            return task.result()
        task.cancel()
        task.add_done_callback(mark_seen)
        await asyncio.wait({task}, timeout=_AGENT_CANCEL_GRACE_S)
        if self.sync_agent_in_thread and not agent.is_async():  # the wait for its thread ended at once
            raise _RolloutCancelled("its thread cannot be stopped: it runs on, its result ignored")
        if not task.done():
            raise _RolloutCancelled(f"it did not end within {_AGENT_CANCEL_GRACE_S:g} s of its cancel: left running")
        raise _RolloutCancelled()

    async def _was_cancelled(self, rollout: AttemptedRollout) -> bool:
        """Whether the store has ``rollout`` cancelled, or its attempt ended by a cancel
        (``False`` when it cannot tell)."""
        try:
            return await rollout_cancelled(self.get_store(), rollout.rollout_id, rollout.attempt.attempt_id)
        except Exception as e:
            log.debug(
                "[%s] could not tell whether rollout %s was cancelled: %s", self.get_worker_id(), rollout.rollout_id, e
            )
            return False

    def _log_agent_error(self, prefix: str, exc: Exception) -> None:
        """The first failure of each kind with its traceback, later ones of that kind in one line.

        A dead backend makes every rollout fail the same way; one traceback tells the story, a
        hundred bury the line that says what happened.
        """
        kind = (type(exc).__qualname__, str(exc)[:80])
        if kind in self._seen_errors:
            log.error("%s agent raised %s: %s (traceback above, first time)", prefix, type(exc).__name__, exc)
            return
        if len(self._seen_errors) < 64:
            self._seen_errors.add(kind)
        log.exception("%s agent raised", prefix)

    async def _post_process(self, rollout: AttemptedRollout, result: Any) -> list[Span]:
        """Store spans the agent returned; return the attempt's spans for ``on_rollout_end``.

        Raises:
            ValueError: A list holding something other than spans of one kind.
            TypeError: A result that is neither ``None``, a number nor a list.
        """
        if result is None:
            return self.tracer.get_last_trace()
        if isinstance(result, list):
            if not result:
                log.warning("The rollout returns an empty list")
                return []
            return await self._store_returned(_returned_spans(result, rollout))
        raise TypeError(
            "Invalid raw result type. It's expected to be none, float, or a list of ReadableSpan or Span, "
            f"but got: {type(result).__name__}"
        )

    async def _store_returned(self, spans: list[Span]) -> list[Span]:
        """Give the spans without a sequence id (``0``) the next ones of their attempt, and store them all."""
        store = self.get_store()
        unnumbered = [i for i, span in enumerate(spans) if span.sequence_id <= 0]
        if unnumbered:
            ids = await store.get_many_span_sequence_ids(
                [(spans[i].rollout_id, spans[i].attempt_id) for i in unnumbered]
            )
            for i, sequence_id in zip(unnumbered, ids, strict=True):
                spans[i] = msgspec.structs.replace(spans[i], sequence_id=sequence_id)
        return await store.add_many_spans(spans)

    async def _finish(
        self,
        rid: str,
        aid: str,
        status: str,
        prefix: str,
        *,
        reason: str | None = None,
        rollout: AttemptedRollout | None = None,
        quiet_refusal: bool = False,
    ) -> None:
        """Record the attempt's final status, and ``reason`` (why it failed) in its metadata; with
        ``quiet_refusal``, or when the attempt was ended by its rollout's cancel (an agent that
        ended before a heartbeat saw the cancel), a store that refuses it for good (the attempt
        already ended) is a DEBUG line, not a warning."""
        metadata = None
        if reason is not None:
            metadata = {**((rollout.attempt.metadata if rollout else None) or {}), STATUS_REASON: reason}
        try:
            await self._update(rid, aid, status, metadata)
        except Exception as e:
            if not quiet_refusal and isinstance(e, InvalidTransitionError) and rollout is not None:
                quiet_refusal = await self._was_cancelled(rollout)
            level = logging.DEBUG if quiet_refusal and not _retryable(e) else logging.WARNING
            log.log(level, "%s could not record status %s: %s", prefix, status, _describe(e))
            if _retryable(e):  # tried again before the next dequeue, on this store or the next one
                self._unrecorded[(rid, aid)] = (status, metadata)
                return
        self._release(rid, aid)

    def _hold(self, rid: str, aid: str) -> None:
        """Write the attempt on the claim board: the pool records it ``failed`` if this process dies."""
        if self.claims is not None and self.worker_id is not None:
            self.claims.hold(self.worker_id, rid, aid)

    def _release(self, rid: str, aid: str) -> None:
        """Wipe the attempt from the claim board: its status is recorded (or refused for good)."""
        if self.claims is not None and self.worker_id is not None:
            self.claims.release(self.worker_id, rid, aid)

    async def _update(self, rid: str, aid: str, status: str, metadata: dict[str, Any] | None) -> None:
        if metadata is None:
            await self.get_store().update_attempt(rid, aid, status=status)
        else:
            await self.get_store().update_attempt(rid, aid, status=status, metadata=metadata)

    async def _record_unrecorded(self) -> None:
        """Record the statuses ``_finish`` could not (a NATS error); drop those the store refuses."""
        for (rid, aid), (status, metadata) in list(self._unrecorded.items()):
            try:
                await self._update(rid, aid, status, metadata)
            except Exception as e:
                if _retryable(e):
                    return  # the store is still failing: the dequeue that follows backs off
                log.warning("[%s | Rollout %s] status %s not recorded: %s", self.get_worker_id(), rid, status, e)
            else:
                log.info("[%s | Rollout %s] recorded status %s late", self.get_worker_id(), rid, status)
            del self._unrecorded[(rid, aid)]
            self._release(rid, aid)


def _returned_spans(result: list[Any], rollout: AttemptedRollout) -> list[Span]:
    """The spans an agent returned, as ``Span``s of its attempt (``RolloutRawResult``, 0.3.0).

    OpenTelemetry ``ReadableSpan``s and emitters' ``SpanCoreFields`` become spans of this attempt; a
    ``Span`` keeps the ids it carries (0.3.0), and one made without them (``Span.from_attributes``)
    gets this attempt's. A span without a sequence id gets one when stored.

    Raises:
        ValueError: The items are not all of one of these kinds.
    """
    rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
    if all(isinstance(s, Span) for s in result):
        return [_with_ids(s, rid, aid) for s in result]
    if all(isinstance(s, ReadableSpan) for s in result):
        return [span_from_readable(s, rid, aid, 0) for s in result]
    if all(isinstance(s, SpanCoreFields) for s in result):
        return [Span.from_core_fields(s, rollout_id=rid, attempt_id=aid) for s in result]
    kinds = ", ".join(type(s).__name__ for s in result[:10])
    raise ValueError(
        f"Invalid raw result type. It's expected to be a list of ReadableSpan, Span or SpanCoreFields, but got: {kinds}"
    )


def _with_ids(span: Span, rollout_id: str, attempt_id: str) -> Span:
    """``span`` with this attempt's ids where it has none (a span of this rollout without an attempt gets this one)."""
    if not span.rollout_id:
        return msgspec.structs.replace(span, rollout_id=rollout_id, attempt_id=span.attempt_id or attempt_id)
    if span.rollout_id == rollout_id and not span.attempt_id:
        return msgspec.structs.replace(span, attempt_id=attempt_id)
    return span
