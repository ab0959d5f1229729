"""Read rewards, messages and objects back from spans (Agent-lightning ``agentlightning.emitter`` readers).

Reward formats recognised by ``get_reward_value``, in this order:

1. v0.3: any attribute key starting with ``agentlightning.reward`` (no dot needed), e.g. what
   ``emit_reward(0.95)`` writes on an ``agentlightning.annotation`` span::

       {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 0.95}

   The first dimension is the primary one.
2. AgentOps (deprecated): ``agentops.task.output`` or ``agentops.entity.output`` holding
   ``{"type": "reward", "value": v}`` as a dict or a JSON string.
3. Legacy: a ``reward`` attribute on a span named ``agentlightning.annotation`` **or**
   ``agentlightning.reward``. Agent-lightning 0.3 only accepts the first name, although v0.2 really
   wrote the second; we accept both (``seed_runtime.md`` sharp edge 34).

Every function takes any span-like object with ``.name`` and ``.attributes`` (an eventlight
``Span`` or an OpenTelemetry ``ReadableSpan``).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any, Protocol, TypeVar

import msgspec

from eventlight.attributes import filter_and_unflatten_attributes

log = logging.getLogger(__name__)

__all__ = [
    "REWARD_PREFIX",
    "RewardDimension",
    "SpanLike",
    "find_final_reward",
    "find_reward_spans",
    "get_message_value",
    "get_object_value",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
]

REWARD_PREFIX = "agentlightning.reward"
ANNOTATION_SPAN = "agentlightning.annotation"
LEGACY_REWARD_SPANS = frozenset({ANNOTATION_SPAN, REWARD_PREFIX})
MESSAGE_BODY = "agentlightning.message.body"
OBJECT_TYPE = "agentlightning.object.type"
OBJECT_LITERAL = "agentlightning.object.literal"
OBJECT_JSON = "agentlightning.object.json"
_AGENTOPS_KEYS = ("agentops.task.output", "agentops.entity.output")


class SpanLike(Protocol):
    """Anything with a span name and flat attributes."""

    @property
    def name(self) -> str: ...

    @property
    def attributes(self) -> Mapping[str, Any] | None: ...


S = TypeVar("S", bound=SpanLike)


class RewardDimension(msgspec.Struct, frozen=True):
    """One dimension of a reward (Agent-lightning ``RewardPydanticModel``).

    Attributes:
        name: Dimension name; ``"primary"`` for a scalar ``emit_reward``.
        value: The reward value.
    """

    name: str
    value: float


def _attributes(span: SpanLike) -> Mapping[str, Any]:
    return span.attributes or {}


def get_rewards_from_span(span: SpanLike) -> list[RewardDimension]:
    """All reward dimensions of a v0.3 reward span, primary first.

    Returns:
        ``[]`` when no attribute key starts with ``agentlightning.reward``.

    Raises:
        ValueError: The reward attributes are malformed (not a list of ``{name, value}``), as
            Agent-lightning's pydantic validation raises.
    """
    attrs = _attributes(span)
    if not any(map(str.startswith, attrs, repeat(REWARD_PREFIX))):
        return []
    try:
        raw = filter_and_unflatten_attributes(attrs, REWARD_PREFIX)
        return msgspec.convert(raw, list[RewardDimension], strict=False)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"malformed reward attributes on span {span.name!r}: {e}") from e


def _agentops_reward(attrs: Mapping[str, Any]) -> tuple[bool, float | None]:
    for key in _AGENTOPS_KEYS:
        payload = attrs.get(key)
        if isinstance(payload, str):
            try:
                payload = json.loads(payload)
            except json.JSONDecodeError:
                continue
        if isinstance(payload, dict) and payload.get("type") == "reward":
            log.warning("AgentOps reward payloads (%s) are deprecated; use emit_reward", key)
            value = payload.get("value")
            return True, None if value is None else float(value)
    return False, None


def get_reward_value(span: SpanLike) -> float | None:
    """The (primary) reward carried by a span, or ``None`` if it carries none.

    Raises:
        ValueError: v0.3 reward attributes are malformed.
    """
    rewards = get_rewards_from_span(span)
    if rewards:
        return rewards[0].value
    attrs = _attributes(span)
    found, value = _agentops_reward(attrs)
    if found:
        return value
    if span.name in LEGACY_REWARD_SPANS and attrs.get("reward") is not None:
        return float(attrs["reward"])
    return None


def is_reward_span(span: SpanLike) -> bool:
    """Whether ``get_reward_value(span)`` is not ``None``."""
    return get_reward_value(span) is not None


def find_reward_spans(spans: Sequence[S]) -> list[S]:
    """The spans that carry a reward, in input order."""
    return [span for span in spans if is_reward_span(span)]


def find_final_reward(spans: Sequence[SpanLike]) -> float | None:
    """The reward of the **last** reward span in list order, or ``None``.

    There is no grouping by attempt and no sorting by time: pass the spans of one attempt ordered
    by ``sequence_id`` (what ``query_spans`` returns).
    """
    for span in reversed(spans):
        value = get_reward_value(span)
        if value is not None:
            return value
    return None


def get_message_value(span: SpanLike) -> str | None:
    """The ``agentlightning.message.body`` of an ``emit_message`` span, or ``None``.

    Raises:
        TypeError: The body is not a ``str``.
    """
    body = _attributes(span).get(MESSAGE_BODY)
    if body is not None and not isinstance(body, str):
        raise TypeError(f"{MESSAGE_BODY} must be a str, got {type(body).__name__}")
    return body


def _decode_literal(kind: Any, literal: str) -> Any:
    if kind == "str":
        return literal
    if kind == "int":
        return int(literal)
    if kind == "float":
        return float(literal)
    if kind == "bool":
        return literal.lower() == "true"
    if kind == "bytes":
        return base64.b64decode(literal)
    raise RuntimeError(f"unknown {OBJECT_TYPE} {kind!r} for a literal object")


def get_object_value(span: SpanLike) -> Any:
    """Decode the payload of an ``emit_object`` span.

    ``agentlightning.object.json`` wins (``json.loads``); otherwise ``agentlightning.object.literal``
    is decoded by ``agentlightning.object.type`` (``str``, ``int``, ``float``, ``bool`` — ``"true"``
    in any case is True — or base64 ``bytes``).

    Returns:
        The object, or ``None`` when the span has neither key.

    Raises:
        RuntimeError: The JSON does not parse, or the literal's type tag is unknown.
    """
    attrs = _attributes(span)
    if OBJECT_JSON in attrs:
        try:
            return json.loads(attrs[OBJECT_JSON])
        except (TypeError, json.JSONDecodeError) as e:
            raise RuntimeError(f"{OBJECT_JSON} is not valid JSON: {e}") from e
    if OBJECT_LITERAL in attrs:
        return _decode_literal(attrs.get(OBJECT_TYPE), str(attrs[OBJECT_LITERAL]))
    return None
