"""Input checks shared by both backends: ids that become NATS subject tokens, spans, resources."""

from __future__ import annotations

import re
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError, InvalidTypeError
from eventlight.core.types import LLM, MAX_SPAN_SEQUENCE_ID, PromptTemplate, ProxyLLM, RolloutConfig, Span

_json = msgspec.json.Encoder()
_TOKEN = re.compile(r"^[A-Za-z0-9_\-:@+=]{1,200}$")


MAX_WAIT_S = 3600.0
"""The longest ``dequeue_rollout(wait_s=)``, in seconds (an hour; a runner polls again after it)."""


def is_token(value: str) -> bool:
    """Whether ``value`` can be an id (a NATS subject token: no dots, spaces or wildcards)."""
    return bool(_TOKEN.match(value))


MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
"""The largest payload an event may carry (the stream's ``max_msg_size``, ``streams/001_events.json``)."""
MAX_DEPTH = 256
"""How deep a payload may nest (JSON arrays and objects); deeper is refused before it is written."""


def check_payload(what: str, value: msgspec.Struct) -> None:
    """Validate a command or snapshot against its own type before anything is written: msgspec
    structs are not checked when built, so ``RolloutConfig(timeout_seconds="10")`` or
    ``update_attempt(metadata="str")`` would otherwise reach the log and poison the rollout.

    Raises:
        InvalidTypeError: A field's value is not of its type (the message names the field).
        InvalidInputError: A value cannot be stored as JSON (not JSON-like, a lone surrogate,
            a NaN or infinity, nested deeper than ``MAX_DEPTH``).
    """
    try:
        builtins = msgspec.to_builtins(value)
        msgspec.convert(builtins, type(value))
        _check_depth(builtins, MAX_DEPTH)
        size = len(_json.encode(builtins))
    except msgspec.ValidationError as e:
        raise InvalidTypeError(f"{what}: {str(e).replace('$.', '')}") from e
    except _NotFinite as e:
        raise InvalidInputError(f"{what}: {e.where()} is {e.value!r}, {_NOT_FINITE}") from None
    except RecursionError as e:
        raise InvalidInputError(f"{what}: a value is nested deeper than {MAX_DEPTH} levels") from e
    except UnicodeError as e:
        bad = e.object[e.start : e.end] if isinstance(e, UnicodeEncodeError) else ""
        raise InvalidInputError(f"{what}: a string is not valid Unicode text ({e}{f': {bad!r}' if bad else ''})") from e
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
        raise InvalidTypeError(f"{what}: a value cannot be stored as JSON ({e})") from e
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidInputError(
            f"{what}: the payload is {size:,} bytes, over the {MAX_PAYLOAD_BYTES:,} an event may hold; "
            "store large inputs elsewhere and pass a reference"
        )


_NOT_FINITE = "which JSON cannot hold (it would be read back as null): store a finite number or a string"


class _NotFinite(Exception):
    """A NaN or infinity inside a value; ``path`` is filled in on the way out of the walk."""

    def __init__(self, value: float):
        self.value = value
        self.path: list[str] = []

    def where(self) -> str:
        return "".join(reversed(self.path)).lstrip(".") or "a value"


def _check_depth(value: Any, left: int) -> None:
    """Walk a JSON-like value (``dict``/``list``/scalars).

    Raises:
        RecursionError: It nests deeper than ``left``.
        _NotFinite: It holds a NaN or an infinity (``msgspec`` and Postgres' ``jsonb`` would turn it
            into ``null`` or refuse it).
    """
    if isinstance(value, float):
        if value - value != 0.0:  # NaN and +-inf; a finite float gives 0.0
            raise _NotFinite(value)
    elif isinstance(value, (dict, list, tuple)):
        if left <= 0:
            raise RecursionError
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(item, (dict, list, tuple, float)):
                try:
                    _check_depth(item, left - 1)
                except _NotFinite as e:
                    e.path.append(f".{key}" if isinstance(key, str) else f"[{key}]")
                    raise


def check_token(what: str, value: Any) -> str:
    """Validate an id that becomes a NATS subject token (no dots, spaces or wildcards).

    Raises:
        InvalidTypeError: ``value`` is not a string.
        InvalidInputError: ``value`` is not such a string.
    """
    if not isinstance(value, str):
        raise InvalidTypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    if not _TOKEN.match(value):
        raise InvalidInputError(
            f"{what} {value!r} is not a valid id: use 1-200 letters, digits or '_-:@+=' (no dots or spaces)"
        )
    return value


def check_wait(what: str, value: Any, most: float = MAX_WAIT_S) -> float:
    """``value`` as seconds to wait: a number from 0 to ``most`` (``dequeue_rollout(wait_s=)``).

    Raises:
        InvalidTypeError: Not an ``int`` or ``float`` (a ``bool`` is refused too).
        InvalidInputError: Negative, NaN, or over ``most`` (infinity included: a wait without end
            would never return, and JetStream takes a pull's expiry in int64 nanoseconds).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{what} must be a number of seconds, not {type(value).__name__}: {value!r}")
    if not 0 <= value <= most:  # NaN fails both comparisons; a huge int is compared exactly
        raise InvalidInputError(f"{what} must be a number of seconds from 0 to {most:g}, got {value!r}")
    return float(value)


def check_spans(spans: Sequence[Any]) -> None:
    """Validate spans before anything is written, so a span a backend accepts is one it can store.

    Raises:
        InvalidTypeError: An item is not a ``Span``, its name not a string or its attributes not a dict.
        InvalidInputError: An item lacks its rollout, attempt, span or trace id; has a sequence id
            outside 0 to ``MAX_SPAN_SEQUENCE_ID`` (2**31 - 1), a non-string attribute key, an
            attribute value that cannot be encoded as JSON, a NaN or infinity anywhere (JSON has
            neither: it was read back as ``null`` on JetStream), or a string with a lone surrogate
            (not UTF-8 text). ASCII strings and finite floats, nearly every value, take one check each.
    """
    for i, span in enumerate(spans):
        if not isinstance(span, Span):
            raise InvalidTypeError(f"span #{i} is a {type(span).__name__}, not an eventlight Span")
        if not isinstance(span.name, str):
            raise InvalidTypeError(f"span #{i} has a name of type {type(span.name).__name__}, not str")
        for field in ("rollout_id", "attempt_id", "span_id", "trace_id"):
            value = getattr(span, field)
            if not value or not isinstance(value, str):
                raise InvalidInputError(f"span #{i} ({span.name!r}) lacks a {field} (got {value!r})")
            if not value.isascii():
                _check_text(i, span, field, value)
        if not span.name.isascii():
            _check_text(i, span, "name", span.name)
        if span.attempt_id == "latest":
            raise InvalidInputError(f"span #{i} ({span.name!r}) must name its attempt id, not 'latest'")
        sid = span.sequence_id
        if not isinstance(sid, int) or isinstance(sid, bool) or not 0 <= sid <= MAX_SPAN_SEQUENCE_ID:
            raise InvalidInputError(
                f"span #{i} ({span.name!r}) has an invalid sequence_id {_shown(sid)}"
                f" (an integer from 0 to {MAX_SPAN_SEQUENCE_ID})"
            )
        if not isinstance(span.attributes, dict):
            raise InvalidTypeError(
                f"span #{i} ({span.name!r}) has attributes of type {type(span.attributes).__name__}, not dict"
            )
        rough = _ascii_text_chars(span.attributes)
        if rough is None:
            rough = _check_attributes(i, span)
        if 4 * rough >= MAX_PAYLOAD_BYTES:
            _check_span_size(i, span)
        if span.events or span.links or not _plain(span):
            fields = ("start_time", "end_time", "status", "events", "links", "resource", "parent_id")
            _check_json(i, span, "a field", {f: getattr(span, f) for f in fields})


def _ascii_text_chars(attributes: dict[Any, Any]) -> int | None:
    """The characters of the values when every key is an ASCII string and every value an ASCII
    ``str`` (most spans' attributes), which needs no check one by one: found by a join and a scan of
    each in C, about a fifth of the loop's CPU (``_check_attributes``). ``None`` otherwise."""
    values = attributes.values()
    if {*map(type, values)} != {str}:
        return None
    try:
        keys = "".join(attributes)
    except TypeError:  # a key that is not a string: the loop names it
        return None
    text = "".join(values)
    return len(text) if keys.isascii() and text.isascii() else None


def _check_attributes(i: int, span: Span) -> int:
    """Check the attributes one by one; their size, roughly (a UTF-8 character is at most 4 bytes, a
    list item rarely over 24).

    Raises:
        InvalidInputError: A key that is not a string, a NaN or infinity, a lone surrogate, a value
            that cannot be encoded as JSON.
    """
    rough = 0
    for key, value in span.attributes.items():
        if type(key) is not str:
            if not isinstance(key, str):
                raise InvalidInputError(f"span #{i} ({span.name!r}) has a non-string attribute key {key!r}")
        elif not key.isascii():
            _check_text(i, span, "an attribute key", key)
        kind = type(value)
        if kind is str:
            rough += len(value)
            if not value.isascii():
                _check_text(i, span, f"attribute {key!r}", value)
            continue
        if kind is float:
            if value - value != 0.0:  # NaN and +-inf
                raise InvalidInputError(f"span #{i} ({span.name!r}) attribute {key!r} is {value!r}, {_NOT_FINITE}")
            continue
        if value is None or kind is int or kind is bool:
            continue
        if kind is list:
            rough += 6 * len(value)
        _check_json(i, span, f"attribute {key!r}", value)
    return rough


def _plain_value(v: Any) -> bool:
    """Whether an attribute value needs no walk: an ASCII string, an int, a finite float, or a
    list of those (OpenTelemetry's attribute values)."""
    kind = type(v)
    if kind is str:
        return bool(v.isascii())
    if kind is float:
        return bool(v - v == 0.0)
    if kind is int or kind is bool or v is None:
        return True
    return kind is list and all(type(x) is not list and _plain_value(x) for x in v)


def _plain(span: Span) -> bool:
    """Whether a span's other fields need no walk: finite times, ASCII status, parent and resource."""
    return (
        _plain_value(span.start_time)
        and _plain_value(span.end_time)
        and _plain_value(span.status.description)
        and _plain_value(span.parent_id)
        and all(k.isascii() and _plain_value(v) for k, v in span.resource.attributes.items())
    )


def _check_text(i: int, span: Span, what: str, text: str) -> None:
    """A string must be UTF-8 encodable (a lone surrogate, e.g. half an emoji cut from a model's
    JSON, is not: the event log could not encode the span, and its whole batch would fail).

    Raises:
        InvalidInputError: It holds a lone surrogate.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(
            f"span #{i} ({span.name!r}) {what} is not valid Unicode text: a lone surrogate"
            f" {text[e.start : e.end]!r} at character {e.start}"
        ) from None


def _check_json(i: int, span: Span, what: str, value: Any) -> None:
    """A nested value must encode as JSON and hold no NaN, infinity or lone surrogate.

    Raises:
        InvalidInputError: It does not.
    """
    try:
        _json.encode(value)
        _check_depth(msgspec.to_builtins(value), MAX_DEPTH)
    except _NotFinite as e:
        raise InvalidInputError(
            f"span #{i} ({span.name!r}) {what}: {e.where()} is {e.value!r}, {_NOT_FINITE}"
        ) from None
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"span #{i} ({span.name!r}) {what} is not valid Unicode text: {e}") from None
    except RecursionError:
        raise InvalidInputError(f"span #{i} ({span.name!r}) {what} is nested deeper than {MAX_DEPTH} levels") from None
    except (TypeError, ValueError, msgspec.EncodeError) as e:
        raise InvalidInputError(f"span #{i} ({span.name!r}) {what} cannot be stored as JSON: {e}") from e


def _shown(value: Any) -> str:
    """``repr(value)`` shortened (``reprlib``: an int of 1e300 as its first and last digits), or
    what it is when Python will not print it (an int over 4,300 digits)."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return f"(an integer of {int(abs(value).bit_length() * 0.30103) + 1} digits)"


def check_span_ids_left(rollout_id: str, attempt_id: str, high: int) -> None:
    """For the event logs' span numbering: the ids given out (numbered spans, reservations) must
    stay within ``MAX_SPAN_SEQUENCE_ID``; checked before anything is appended.

    Raises:
        InvalidInputError: ``high``, the attempt's highest id after this append, is over it (an
            earlier span of the attempt carried an id near the limit).
    """
    if high > MAX_SPAN_SEQUENCE_ID:
        raise InvalidInputError(
            f"spans of {rollout_id}/{attempt_id}: no sequence id left to give out (the next would be"
            f" over {MAX_SPAN_SEQUENCE_ID}; a span of this attempt carries an id near the limit)"
        )


def check_one_attempt(rollout_id: str, attempt_id: str, spans: Sequence[Any]) -> None:
    """For ``add_spans_numbered``: every span must belong to the attempt being numbered.

    Raises:
        InvalidInputError: A span names another rollout or attempt.
    """
    if any(getattr(s, "rollout_id", None) != rollout_id or getattr(s, "attempt_id", None) != attempt_id for s in spans):
        raise InvalidInputError(f"add_spans_numbered: every span must belong to {rollout_id}/{attempt_id}")


def check_stats(stats: Any) -> dict[str, Any]:
    """Validate a worker's ``heartbeat_stats`` (a JSON-encodable ``dict``); returns a copy.

    Raises:
        InvalidTypeError: Not a dict (0.3.0 raises ``TypeError`` too).
        InvalidInputError: Not encodable as JSON.
    """
    if not isinstance(stats, Mapping):
        raise InvalidTypeError(f"heartbeat_stats must be a dict, got {type(stats).__name__}")
    try:
        _json.encode(stats)
    except (TypeError, ValueError, msgspec.EncodeError) as e:
        raise InvalidInputError(f"heartbeat_stats cannot be stored as JSON: {e}") from e
    return dict(stats)


def check_resources(resources: Mapping[str, Any]) -> None:
    """Validate named resources.

    Raises:
        InvalidTypeError: Not a mapping of names to ``LLM``/``ProxyLLM``/``PromptTemplate``.
    """
    if not isinstance(resources, Mapping):
        raise InvalidTypeError(f"resources must be a dict of name -> resource, got {type(resources).__name__}")
    for name, res in resources.items():
        if not isinstance(name, str) or not isinstance(res, (LLM, ProxyLLM, PromptTemplate)):
            raise InvalidTypeError(f"resource {name!r} is a {type(res).__name__}, not an LLM or PromptTemplate")


def _check_span_size(i: int, span: Span) -> None:
    """Refuse a span no event can hold (both backends alike); called for spans with large text only."""
    try:
        size = len(_json.encode(span))
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
        return  # not encodable: the backend's own encoding says why
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidInputError(
            f"span #{i} ({span.name!r}) is {size:,} bytes, over the {MAX_PAYLOAD_BYTES:,} an event may hold; "
            "store large values elsewhere and put a reference in the attribute"
        )


def check_rollout_config(value: Any, what: str = "rollout_config") -> RolloutConfig | None:
    """``value`` as a ``RolloutConfig``: one already, a mapping of its fields, or ``None``.

    Args:
        value: The config.
        what: Its name in messages (``"config"`` for ``enqueue_rollout(config=)``).

    Raises:
        InvalidTypeError: ``value`` is neither (a ``TypeError``), or a field has the wrong type.
        InvalidInputError: A field is unknown or out of range (a ``ValueError``): ``max_attempts < 1``,
            a ``retry_condition`` status that does not exist, or a ``timeout_seconds`` /
            ``unresponsive_seconds`` that is neither ``None`` nor a finite number of seconds > 0 (a
            negative one timed every attempt out at the watchdog's first tick, NaN never). Stored
            configs are not checked again, so old events still read.
    """
    if value is None:
        return None
    if not isinstance(value, RolloutConfig | Mapping):
        raise InvalidTypeError(f"{what} must be a RolloutConfig or a dict of its fields, got {type(value).__name__}")
    if isinstance(value, Mapping):
        fields = set(RolloutConfig.__struct_fields__)
        unknown = sorted(set(value) - fields)
        if unknown:
            raise InvalidInputError(f"{what} has unknown fields {unknown}; known: {sorted(fields)}")
    try:  # a struct is not checked when built: RolloutConfig(timeout_seconds="10") is checked here
        config = msgspec.convert(
            msgspec.to_builtins(dict(value) if isinstance(value, Mapping) else value), RolloutConfig
        )
    except msgspec.ValidationError as exc:
        raise InvalidTypeError(f"{what}: {str(exc).replace('`$.', f'`{what}.')}") from exc
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{what}: {exc}") from exc
    for name in ("timeout_seconds", "unresponsive_seconds"):
        bound = getattr(config, name)
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, int | float):
            raise InvalidTypeError(f"{what}.{name} must be a number of seconds or None, got {bound!r}")
        if not 0 < bound < float("inf"):
            raise InvalidInputError(f"{what}.{name} must be a finite number of seconds > 0 or None, got {bound!r}")
    return config
