"""Emitters: record rewards, annotations, messages, objects and exceptions as spans.

Names, span names and attribute keys follow Agent-lightning 0.3 (``tutorials_emitter.md``,
``seed_runtime.md`` §4): ``emit_reward(0.95)`` records a span named ``agentlightning.annotation``
with ``agentlightning.reward.0.name = "primary"`` and ``agentlightning.reward.0.value = 0.95``.
With ``propagate=True`` (the default) the active tracer records the span and it streams to the
store; without one, ``RuntimeError``. ``propagate=False`` builds the fields without recording.
"""

from __future__ import annotations

import base64
import functools
import inspect
import json
import numbers
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from eventlight.attributes import flatten_attributes
from eventlight.core.types import TraceStatus
from eventlight.rewards import (  # 0.3.0's agentlightning.emitter re-exports the readers too
    find_final_reward,
    find_reward_spans,
    get_message_value,
    get_object_value,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
)
from eventlight.tracer import DummyTracer, SpanCoreFields, Tracer, get_active_tracer, open_trace_contexts

__all__ = [
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "get_message_value",
    "get_object_value",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "operation",
    "reward",
]

AGL_ANNOTATION = "agentlightning.annotation"
AGL_MESSAGE = "agentlightning.message"
AGL_OBJECT = "agentlightning.object"
AGL_EXCEPTION = "agentlightning.exception"
AGL_OPERATION = "agentlightning.operation"
AGL_REWARD = "agentlightning.reward"

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _tracer(propagate: bool, what: str) -> Tracer:
    if not propagate:
        return DummyTracer()
    tracer = get_active_tracer()
    if tracer is None:
        hint = ""
        if open_trace_contexts() > 1:
            hint = (
                f" (this thread is outside the rollout's context while {open_trace_contexts()} rollouts run in this"
                " process: start it with contextvars.copy_context().run or use asyncio.to_thread)"
            )
        raise RuntimeError(f"No active tracer found. Cannot emit {what} span.{hint}")
    return tracer


def _sanitize(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, bool, int, float)) for v in value):
        kinds = {type(v) for v in value}
        if len(kinds) == 1:
            return list(value)
        if kinds <= {int, float}:
            return [float(v) for v in value]
    return json.dumps(value, default=str)


def _native(value: Any) -> Any:
    """``value`` with each numpy scalar and 1-d array in it, at any depth, as the Python number, bool,
    string or list (``.tolist()``); a deeper array is left as it is. numpy is not imported: its
    values are known by their type's module."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) in (0, 1):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _native(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_native(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_native(v) for v in value)
    return value


def _numpy_json(value: Any) -> Any:
    """``json.dumps``'s ``default``: a numpy scalar or array as Python values, anything else refused."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _attributes(attributes: dict[str, Any] | None) -> dict[str, Any]:
    flat = flatten_attributes(_native(attributes or {}))
    return {k: _sanitize(v) for k, v in flat.items()}


def emit_annotation(annotation: dict[str, Any], propagate: bool = True) -> SpanCoreFields:
    """Record an ``agentlightning.annotation`` span carrying ``annotation`` (flattened).

    An empty list is kept as an empty-list attribute (``{"tags": []}`` records ``tags = []``;
    OpenTelemetry allows empty arrays), where Agent-lightning 0.3.0's flattening drops the key.
    A numpy scalar is recorded as its Python value and a 1-d numpy array as a list, in annotations
    as in rewards (any ``numbers.Real``), where 0.3.0 refuses them (``numpy.float64``, a ``float``
    subclass, aside). A NaN or infinity among them goes as a ``float``'s does: the tracer records it
    as OTLP/JSON text (``"NaN"``, ``eventlight.otel.json_double``).

    Raises:
        ValueError: A value is not a str/int/float/bool or a homogeneous list of them.
        RuntimeError: No active tracer and ``propagate=True``.
    """
    marked = _mark_empty_lists(_native(annotation))
    flat = {k: [] if v is _EMPTY_LIST else v for k, v in flatten_attributes(marked).items()}
    for key, value in flat.items():
        ok = isinstance(value, (str, bool, int, float)) or (
            isinstance(value, list)
            and len({type(v) for v in value}) <= 1
            and all(isinstance(v, (str, bool, int, float)) for v in value)
        )
        if not ok:
            raise ValueError(f"annotation attribute {key!r} has an unsupported value {value!r}")
    return _tracer(propagate, "annotation").create_span(
        AGL_ANNOTATION, attributes=flat, status=TraceStatus(status_code="OK")
    )


_EMPTY_LIST = object()


def _mark_empty_lists(value: Any) -> Any:
    """``value`` with each empty list or tuple replaced by a marker that flattening keeps as a leaf."""
    if isinstance(value, dict):
        return {k: _mark_empty_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_empty_lists(v) for v in value] if value else _EMPTY_LIST
    return value


def emit_reward(
    reward: float | dict[str, float],
    *,
    primary_key: str | None = None,
    attributes: dict[str, Any] | None = None,
    propagate: bool = True,
) -> SpanCoreFields:
    """Record a reward (a scalar, or several named dimensions with ``primary_key`` first).

    A reward is any real number (``numbers.Real``: ``int``, ``float``, ``bool``, ``fractions.Fraction``,
    ``numpy.float32``, ...), recorded as a ``float``; 0.3.0 takes only ``int``, ``float`` and ``bool``.

    Raises:
        TypeError: A scalar reward that is not a number.
        ValueError: A dict reward without a valid ``primary_key`` or with a non-numeric value; a NaN
            or infinite reward (no store keeps one: JSON has neither, and a policy update on it is
            NaN), so an agent returning ``float("nan")`` fails its attempt with this message.
    """
    if isinstance(reward, dict):
        if primary_key is None:
            raise ValueError("primary_key is required for a multi-dimensional reward")
        if primary_key not in reward:
            raise ValueError(f"primary_key {primary_key!r} is not one of the reward's keys {list(reward)}")
        for key, value in reward.items():
            if not isinstance(value, numbers.Real):
                raise ValueError(f"Reward value must be a number, got: {value!r} for key {key}")
        order = [primary_key] + [k for k in reward if k != primary_key]
        dims = [{"name": k, "value": _finite(float(reward[k]), k)} for k in order]
    else:
        if not isinstance(reward, numbers.Real):
            raise TypeError(f"Reward must be a number, got: {type(reward).__name__}")
        value = _finite(float(reward), "primary")
        if not attributes:  # what emit_annotation would flatten this to, without its walk
            flat = {_PRIMARY_NAME: "primary", _PRIMARY_VALUE: value}
            status = TraceStatus(status_code="OK")
            return _tracer(propagate, "annotation").create_span(AGL_ANNOTATION, attributes=flat, status=status)
        dims = [{"name": "primary", "value": value}]
    return emit_annotation({AGL_REWARD: dims, **(attributes or {})}, propagate=propagate)


_PRIMARY_NAME = f"{AGL_REWARD}.0.name"
_PRIMARY_VALUE = f"{AGL_REWARD}.0.value"


def _finite(value: float, name: str) -> float:
    if value - value != 0.0:  # NaN and +-inf
        raise ValueError(f"Reward {name!r} must be a finite number, got: {value!r}")
    return value


def emit_message(message: str, attributes: dict[str, Any] | None = None, propagate: bool = True) -> None:
    """Record an ``agentlightning.message`` span.

    Raises:
        TypeError: ``message`` is not a string.
    """
    if not isinstance(message, str):
        raise TypeError(f"message must be a str, got {type(message).__name__}")
    attrs = {"agentlightning.message.body": message, **_attributes(attributes)}
    _tracer(propagate, "message").create_span(AGL_MESSAGE, attributes=attrs)


def emit_object(obj: Any, attributes: dict[str, Any] | None = None, propagate: bool = True) -> SpanCoreFields:
    """Record an ``agentlightning.object`` span holding ``obj`` (literal or JSON).

    numpy scalars and arrays in ``obj`` are written to the JSON as their Python values (0.3.0's
    ``json.dumps`` refuses them); the recorded type stays numpy's (``numpy.int64``).

    Raises:
        RuntimeError: ``obj`` is not JSON serializable.
    """
    attrs: dict[str, Any]
    if isinstance(obj, (str, bool, int, float)):
        attrs = {"agentlightning.object.type": type(obj).__name__, "agentlightning.object.literal": str(obj)}
    elif isinstance(obj, bytes):
        attrs = {
            "agentlightning.object.type": "bytes",
            "agentlightning.object.literal": base64.b64encode(obj).decode(),
        }
    else:
        cls = type(obj)
        name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        try:
            payload = json.dumps(obj, default=_numpy_json)
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"Object must be JSON serializable, got: {type(obj).__name__}") from e
        attrs = {"agentlightning.object.type": name, "agentlightning.object.json": payload}
    attrs.update(_attributes(attributes))
    return _tracer(propagate, "object").create_span(AGL_OBJECT, attributes=attrs, status=TraceStatus(status_code="OK"))


def emit_exception(exception: BaseException, attributes: dict[str, Any] | None = None, propagate: bool = True) -> None:
    """Record an ``agentlightning.exception`` span with the OpenTelemetry ``exception.*`` keys.

    Raises:
        TypeError: ``exception`` is not an exception.
    """
    if not isinstance(exception, BaseException):
        raise TypeError(f"exception must be a BaseException, got {type(exception).__name__}")
    attrs: dict[str, Any] = {
        "exception.type": type(exception).__name__,
        "exception.message": str(exception),
        "exception.escaped": True,
    }
    stack = "".join(traceback.format_exception(exception)).strip()
    if stack:
        attrs["exception.stacktrace"] = stack
    attrs.update(_attributes(attributes))
    _tracer(propagate, "exception").create_span(AGL_EXCEPTION, attributes=attrs, status=TraceStatus(status_code="OK"))


class OperationContext:
    """An ``agentlightning.operation`` span as a context manager (Agent-lightning 0.3.0's
    ``agentlightning.emitter.annotation.OperationContext``); calling it on a function decorates it.

    Unlike Agent-lightning 0.3.0, the tracer is looked up when the operation runs, not when the
    decorator is applied, so a module-level ``@operation`` works (``seed_runtime.md`` §8 #29).
    """

    def __init__(self, *, propagate: bool = True, name: str | None = None, attributes: dict[str, Any] | None = None):
        self.propagate = propagate
        self.name = name
        self.attributes = flatten_attributes(_native(attributes or {}))
        self._cm: Any = None
        self._rec: Any = None

    def _attrs(self, default_name: str | None) -> dict[str, Any]:
        attrs = dict(self.attributes)
        op_name = self.name or default_name
        if op_name:
            attrs["agentlightning.operation.name"] = op_name
        return attrs

    def __call__(self, fn: _Fn) -> _Fn:
        """Wrap ``fn`` (sync or async) so that each call records a span with its inputs and output.

        The wrapper is a plain function (``functools.wraps``), so a decorated method binds ``self``
        as any method does.
        """
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with self._span(fn, args, kwargs) as rec:
                    result = await fn(*args, **kwargs)
                    rec.record_attributes(_io("output", result))
                    return result

            return cast(_Fn, async_wrapper)

        @functools.wraps(fn)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._span(fn, args, kwargs) as rec:
                result = fn(*args, **kwargs)
                rec.record_attributes(_io("output", result))
                return result

        return cast(_Fn, sync_wrapper)

    def _span(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tracer = _tracer(self.propagate, "operation")
        attrs = self._attrs(getattr(fn, "__name__", type(fn).__name__))
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
            bound.apply_defaults()
            attrs.update(_io("input", dict(bound.arguments)))
        except TypeError:
            attrs.update(_io("input", {"args": list(args), "kwargs": kwargs}))
        if isinstance(tracer, DummyTracer):
            return _DummyOperation(AGL_OPERATION, attrs)
        return tracer.operation_context(AGL_OPERATION, attrs)

    def __enter__(self) -> OperationContext:
        tracer = _tracer(self.propagate, "operation")
        attrs = self._attrs(None)
        self._cm = (
            _DummyOperation(AGL_OPERATION, attrs)
            if isinstance(tracer, DummyTracer)
            else (tracer.operation_context(AGL_OPERATION, attrs))
        )
        self._rec = self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._cm.__exit__(*exc)

    def set_input(self, *args: Any, **kwargs: Any) -> None:
        if self._rec is None:
            raise RuntimeError("set_input() must be called inside the operation block")
        data: dict[str, Any] = {f"args.{i}": a for i, a in enumerate(args)}
        data.update(kwargs)
        self._rec.record_attributes(_io("input", data))

    def set_output(self, value: Any) -> None:
        if self._rec is None:
            raise RuntimeError("set_output() must be called inside the operation block")
        self._rec.record_attributes(_io("output", value))

    def span(self) -> SpanCoreFields:
        if self._rec is None:
            raise RuntimeError("Span is not ready yet.")
        recorded: SpanCoreFields = self._rec.get_recorded_span()
        return recorded


def operation(
    fn: Callable[..., Any] | None = None,
    *,
    propagate: bool = True,
    name: str | None = None,
    **attributes: Any,
) -> Any:
    """Record an ``agentlightning.operation`` span, as a decorator or a context manager.

    ``@operation`` and ``@operation(name=..., **attributes)`` return the decorated function itself
    wrapped with ``functools.wraps`` (as in Agent-lightning 0.3.0), so methods, static methods and
    class methods work; ``with operation(**attributes) as op:`` gives an ``OperationContext``.

    Args:
        fn: The function (sync or async) to decorate; ``None`` for the other forms.
        propagate: ``False``: record with a ``DummyTracer`` (nothing is exported).
        name: Stored as ``agentlightning.operation.name`` (default for a decorator: the function's name).
        **attributes: Span attributes (flattened).

    Returns:
        The wrapped function, or an ``OperationContext``.

    Raises:
        ValueError: ``fn`` is not callable (custom span names are not supported).
    """
    if fn is not None and not callable(fn):
        raise ValueError("operation() takes a function; custom span names are not supported")
    context = OperationContext(propagate=propagate, name=name, attributes=attributes)
    return context(fn) if fn is not None else context


def _io(kind: str, value: Any) -> dict[str, Any]:
    prefix = f"agentlightning.operation.{kind}"
    value = _native(value)
    flat = flatten_attributes({prefix: value}) if isinstance(value, (dict, list)) else {prefix: value}
    return {k: _sanitize(v) for k, v in flat.items()}


class _DummyOperation:
    def __init__(self, name: str, attributes: dict[str, Any]):
        self.fields = DummyTracer().create_span(name, attributes)
        self.done: SpanCoreFields | None = None

    def __enter__(self) -> _DummyOperation:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.fields.status = TraceStatus(status_code="ERROR", description=str(exc))
        self.done = self.fields

    def record_attributes(self, attributes: dict[str, Any]) -> None:
        self.fields.attributes.update(attributes)

    def get_recorded_span(self) -> SpanCoreFields:
        if self.done is None:
            raise RuntimeError("Span is not ready yet.")
        return self.done


def reward(fn: _Fn) -> _Fn:
    """Decorate a reward function (sync or async) so that each number it returns is also recorded
    with ``emit_reward`` (Agent-lightning 0.3.0's deprecated ``agentlightning.emitter.reward``);
    ``None`` is returned without a span. The decorated function returns what ``fn`` returns."""

    def record(value: Any) -> Any:
        if value is not None:
            emit_reward(float(value) if isinstance(value, numbers.Real) else value)
        return value

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            return record(await fn(*args, **kwargs))

        return cast(_Fn, async_wrapper)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return record(fn(*args, **kwargs))

    return cast(_Fn, wrapper)
