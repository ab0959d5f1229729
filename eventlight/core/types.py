"""The data types of the store: rollouts, attempts, spans, resources, workers.

Every type is a ``msgspec.Struct`` whose field names follow Agent-lightning 0.3 (``reference_types.md``),
so code that reads ``rollout.status`` or ``span.attributes`` ports unchanged. Times are wall-clock
seconds since the epoch (``float``). Ids: rollouts ``ro-`` + 12 hex, attempts ``at-`` + 8 hex,
resources ``rs-`` + 12 hex, as in Agent-lightning.

Read models are mutable structs (a caller may edit its copy); events (``eventlight.core.events``) are frozen.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Literal

import msgspec

from eventlight.core.pages import PaginatedResult as PaginatedResult  # re-exported: the import path stays

RolloutStatus = Literal["queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing"]
AttemptStatus = Literal["preparing", "running", "failed", "succeeded", "unresponsive", "timeout"]
WorkerStatus = Literal["idle", "busy", "unknown"]
RolloutMode = Literal["train", "val", "test"]
StatusCode = Literal["UNSET", "OK", "ERROR"]
TaskInput = Any

QUEUING_STATUSES: frozenset[str] = frozenset({"queuing", "requeuing"})
RUNNING_STATUSES: frozenset[str] = frozenset({"preparing", "running"})
TERMINAL_ROLLOUT_STATUSES: frozenset[str] = frozenset({"failed", "succeeded", "cancelled"})
TERMINAL_ATTEMPT_STATUSES: frozenset[str] = frozenset({"failed", "succeeded", "unresponsive", "timeout"})
ROLLOUT_STATUSES: frozenset[str] = frozenset(RolloutStatus.__args__)  # type: ignore[attr-defined]
ATTEMPT_STATUSES: frozenset[str] = frozenset(AttemptStatus.__args__)  # type: ignore[attr-defined]
ROLLOUT_MODES: frozenset[str] = frozenset(RolloutMode.__args__)  # type: ignore[attr-defined]


class ModelDump:
    """``model_dump`` / ``model_dump_json`` as Agent-lightning 0.3.0's pydantic types have them."""

    __slots__ = ()

    def model_dump(self, *, mode: str = "python", **_: Any) -> dict[str, Any]:
        """The fields as a dict of builtins (nested structs as dicts; ``mode`` accepted for pydantic's calls)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    def model_dump_json(self, *, indent: int | None = None, **_: Any) -> str:
        """The fields as JSON text (``indent`` as pydantic's)."""
        return json.dumps(self.model_dump(), indent=indent)


def generate_id(prefix: str, length: int) -> str:
    """Return ``prefix`` followed by ``length`` random hex characters (at most 32).

    From ``os.urandom``, as ``uuid.uuid4`` is, without building a ``UUID`` (a quarter of its CPU;
    every store command makes one or two ids).
    """
    if length <= 0:
        raise ValueError(f"id length must be positive, got {length}")
    return prefix + os.urandom(16).hex()[:length]


def now() -> float:
    """Wall-clock seconds since the epoch; the one clock the store's callers pass to the decider."""
    return time.time()


class RolloutConfig(ModelDump, msgspec.Struct, kw_only=True):
    """Retry and liveness policy of one rollout (Agent-lightning ``RolloutConfig``).

    Attributes:
        timeout_seconds: Longest an attempt may run, from its start, before the watchdog marks it
            ``timeout``. ``None`` disables it.
        unresponsive_seconds: Longest silence (no span, no ``update_attempt(last_heartbeat_time=)``)
            before the watchdog marks the attempt ``unresponsive``; eventlight's runners send that
            heartbeat for their attempt with each worker heartbeat (every ``heartbeat_interval``, 10 s)
            when this is set, so it detects a runner that stopped, not an agent busy without spans
            (``timeout_seconds`` bounds that). ``None`` disables it.
        max_attempts: Attempts allowed in total, the first included (>= 1).
        retry_condition: Attempt statuses that requeue the rollout while attempts remain.
    """

    timeout_seconds: float | None = None
    unresponsive_seconds: float | None = None
    max_attempts: int = 1
    retry_condition: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        bad = [s for s in self.retry_condition if s not in ATTEMPT_STATUSES]
        if bad:
            raise ValueError(f"retry_condition holds unknown attempt statuses: {bad}")


class Attempt(ModelDump, msgspec.Struct, kw_only=True):
    """One execution of a rollout. ``sequence_id`` counts attempts of the rollout from 1."""

    rollout_id: str
    attempt_id: str
    sequence_id: int
    start_time: float
    end_time: float | None = None
    status: AttemptStatus = "preparing"
    worker_id: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None


MAX_SPAN_SEQUENCE_ID = 2**31 - 1
"""The largest span ``sequence_id`` a store takes or gives out: the read model keeps it in a
Postgres ``integer`` (``spans.sequence_id``). Larger ids are refused with ``InvalidInputError``
(on both backends), never accepted and then lost by the projector."""

STATUS_REASON = "eventlight.status_reason"
"""Attempt metadata key: one line saying why the attempt ended ``failed``/``timeout``/``unresponsive``
(the watchdog's overrun, the agent's exception, spans the tracer could not deliver)."""

CANCELLED_REASON = "the rollout was cancelled while the attempt ran"
"""The ``STATUS_REASON`` of an attempt ended ``failed`` by its rollout's cancel
(``update_rollout(status="cancelled")`` records every attempt not yet finished so); a runner that
stopped its agent for it writes this text and what it did (``eventlight.runner.loop.ROLLOUT_CANCELLED``)."""


def ended_by_cancel(attempt: Attempt) -> bool:
    """Whether ``attempt`` was ended by its rollout's cancel: ``failed`` with ``CANCELLED_REASON``
    (or a runner's longer reason that begins with it) as its ``STATUS_REASON``."""
    reason = (attempt.metadata or {}).get(STATUS_REASON)
    return attempt.status == "failed" and isinstance(reason, str) and reason.startswith(CANCELLED_REASON)


class Rollout(ModelDump, msgspec.Struct, kw_only=True):
    """A unit of work (a task) and its aggregated status; see ``deep-dive_store.md``."""

    rollout_id: str
    input: Any
    start_time: float
    end_time: float | None = None
    mode: str | None = None
    resources_id: str | None = None
    status: RolloutStatus = "queuing"
    config: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    metadata: dict[str, Any] | None = None

    @property
    def status_reason(self) -> str | None:
        """Why the latest attempt ended badly; ``None`` for a rollout without attempts."""
        return None


class AttemptedRollout(Rollout, kw_only=True):
    """A rollout together with its latest attempt (what ``dequeue_rollout`` hands a runner)."""

    attempt: Attempt

    @property
    def status_reason(self) -> str | None:  # type: ignore[override]
        """Why the latest attempt failed, timed out or went silent (its ``STATUS_REASON``); a rollout
        that ran out of attempts carries its last failure's reason here. ``None`` when not recorded."""
        reason = (self.attempt.metadata or {}).get(STATUS_REASON)
        return reason if isinstance(reason, str) else None

    def __post_init__(self) -> None:
        if self.attempt.rollout_id != self.rollout_id:
            raise ValueError(
                f"attempt {self.attempt.attempt_id} belongs to {self.attempt.rollout_id}, not {self.rollout_id}"
            )


class EnqueueRolloutRequest(msgspec.Struct, kw_only=True):
    """One item of ``enqueue_many_rollouts``."""

    input: Any
    mode: str | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None


class Worker(ModelDump, msgspec.Struct, kw_only=True):
    """A runner as the store sees it; ``status`` is derived from dequeues and attempt updates."""

    worker_id: str
    status: WorkerStatus = "unknown"
    heartbeat_stats: dict[str, Any] | None = None
    last_heartbeat_time: float | None = None
    last_dequeue_time: float | None = None
    last_busy_time: float | None = None
    last_idle_time: float | None = None
    current_rollout_id: str | None = None
    current_attempt_id: str | None = None


# ---------------------------------------------------------------------------------------------
# Resources


class LLM(msgspec.Struct, kw_only=True, tag="llm", tag_field="resource_type"):
    """An OpenAI-compatible model endpoint.

    Attributes:
        endpoint: Base URL, e.g. ``http://127.0.0.1:8000/v1``.
        model: Model name sent in requests.
        api_key: Key to send, if the endpoint needs one.
        sampling_parameters: Defaults such as ``{"temperature": 0.0}``.
    """

    endpoint: str
    model: str
    api_key: str | None = None
    sampling_parameters: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def resource_type(self) -> str:
        return "llm"

    def get_base_url(self, *args: Any, **kwargs: Any) -> str:
        """Return ``endpoint``; arguments are accepted for symmetry with ``ProxyLLM``."""
        return self.endpoint


class ProxyLLM(LLM, kw_only=True, tag="proxy_llm", tag_field="resource_type"):
    """An LLM served by eventlight's LLM proxy; each rollout gets its own base URL.

    ``get_base_url(rollout_id, attempt_id)`` inserts ``/rollout/<rid>/attempt/<aid>`` before a
    trailing ``/v1`` (Agent-lightning ``ProxyLLM.get_base_url``), so the proxy can attribute every
    call to the attempt that made it.
    """

    @property
    def resource_type(self) -> str:
        return "proxy_llm"

    def get_base_url(self, rollout_id: str | None = None, attempt_id: str | None = None) -> str:  # type: ignore[override]
        """Return the routed base URL.

        Raises:
            ValueError: Exactly one of ``rollout_id`` and ``attempt_id`` was given.
        """
        if rollout_id is None and attempt_id is None:
            return self.endpoint
        if rollout_id is None or attempt_id is None:
            raise ValueError("rollout_id and attempt_id must be given together")
        base = self.endpoint.rstrip("/")
        has_v1 = base.endswith("/v1")
        if has_v1:
            base = base[: -len("/v1")]
        base = f"{base}/rollout/{rollout_id}/attempt/{attempt_id}"
        return base + "/v1" if has_v1 else base

    def with_attempted_rollout(self, rollout: Rollout) -> LLM:
        """Bake the routed URL of ``rollout``'s attempt into a plain ``LLM``.

        Raises:
            ValueError: ``rollout`` carries no attempt.
        """
        if not isinstance(rollout, AttemptedRollout):
            raise ValueError("Rollout is not an AttemptedRollout.")
        return LLM(
            endpoint=self.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id),
            model=self.model,
            api_key=self.api_key,
            sampling_parameters=dict(self.sampling_parameters),
        )


class PromptTemplate(msgspec.Struct, kw_only=True, tag="prompt_template", tag_field="resource_type"):
    """A tunable prompt. Only the ``f-string`` engine formats (``str.format``), as in Agent-lightning."""

    template: str
    engine: Literal["f-string", "jinja", "poml"] = "f-string"

    @property
    def resource_type(self) -> str:
        return "prompt_template"

    def format(self, **kwargs: Any) -> str:
        """Fill the placeholders.

        Raises:
            NotImplementedError: The engine is not ``f-string``.
            KeyError: A placeholder has no value.
        """
        if self.engine != "f-string":
            raise NotImplementedError(f"engine {self.engine!r} is not supported; use 'f-string'")
        return self.template.format(**kwargs)


Resource = LLM | ProxyLLM | PromptTemplate
NamedResources = dict[str, Resource]


class ResourcesUpdate(ModelDump, msgspec.Struct, kw_only=True):
    """A versioned snapshot of named resources."""

    resources_id: str
    create_time: float
    update_time: float
    version: int
    resources: dict[str, LLM | ProxyLLM | PromptTemplate]


# ---------------------------------------------------------------------------------------------
# Traces (OpenTelemetry shapes; ids are lowercase hex)


class TraceStatus(msgspec.Struct, kw_only=True):
    status_code: str = "UNSET"
    description: str | None = None


class SpanContext(msgspec.Struct, kw_only=True):
    trace_id: str
    span_id: str
    is_remote: bool = False
    trace_state: dict[str, str] = msgspec.field(default_factory=dict)


class Event(msgspec.Struct, kw_only=True):
    name: str
    attributes: dict[str, Any] = msgspec.field(default_factory=dict)
    timestamp: float | None = None


class Link(msgspec.Struct, kw_only=True):
    context: SpanContext
    attributes: dict[str, Any] | None = None


class OtelResource(msgspec.Struct, kw_only=True):
    attributes: dict[str, Any] = msgspec.field(default_factory=dict)
    schema_url: str = ""


class Span(ModelDump, msgspec.Struct, kw_only=True):
    """One OpenTelemetry span of an attempt, with the store's ordering key ``sequence_id``.

    ``trace_id`` is 32 hex characters and ``span_id`` 16, as OTLP/JSON and Agent-lightning write them.
    """

    rollout_id: str
    attempt_id: str
    sequence_id: int
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    status: TraceStatus = msgspec.field(default_factory=TraceStatus)
    attributes: dict[str, Any] = msgspec.field(default_factory=dict)
    events: list[Event] = msgspec.field(default_factory=list)
    links: list[Link] = msgspec.field(default_factory=list)
    start_time: float | None = None
    end_time: float | None = None
    context: SpanContext | None = None
    parent: SpanContext | None = None
    resource: OtelResource = msgspec.field(default_factory=OtelResource)

    @classmethod
    def from_attributes(
        cls,
        *,
        attributes: dict[str, Any],
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        sequence_id: int | None = None,
        name: str | None = None,
        trace_id: str | None = None,
        span_id: str | None = None,
        parent_id: str | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
        resource: OtelResource | None = None,
        status: TraceStatus | None = None,
    ) -> Span:
        """Build a span from attributes, generating ids as Agent-lightning's ``Span.from_attributes`` does."""
        trace_id = trace_id or uuid.uuid4().hex
        span_id = span_id or uuid.uuid4().hex[:16]
        return cls(
            rollout_id=rollout_id or "",
            attempt_id=attempt_id or "",
            sequence_id=sequence_id or 0,
            trace_id=trace_id,
            span_id=span_id,
            parent_id=parent_id,
            name=name or "agentlightning.virtual",
            status=status or TraceStatus(status_code="OK"),
            attributes=dict(attributes),
            start_time=start_time,
            end_time=end_time,
            context=SpanContext(trace_id=trace_id, span_id=span_id),
            parent=SpanContext(trace_id=trace_id, span_id=parent_id) if parent_id else None,
            resource=resource or OtelResource(),
        )

    @classmethod
    def from_core_fields(
        cls,
        core: Any,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        sequence_id: int | None = None,
    ) -> Span:
        """Build a span from what an emitter recorded (``SpanCoreFields``), as Agent-lightning's
        ``Span.from_core_fields``: its name, status, attributes and times (a missing start time is
        now); the other fields as ``from_attributes`` makes them."""
        return cls.from_attributes(
            attributes=core.attributes,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            name=core.name,
            start_time=core.start_time or time.time(),
            end_time=core.end_time,
            status=core.status,
        )


class Triplet(ModelDump, msgspec.Struct, kw_only=True):
    """A (prompt, response, reward) transition extracted from spans by an adapter."""

    prompt: Any
    response: Any
    reward: float | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


def to_builtins(obj: Any) -> Any:
    """Convert a struct (or a container of them) to JSON-ready builtins."""
    return msgspec.to_builtins(obj)
