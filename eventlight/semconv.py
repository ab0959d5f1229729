"""Span names and attribute keys of Agent-lightning 0.3.0 (``agentlightning.semconv``), same values.

The emitters (``eventlight.emitter``) write these and the reward helpers (``eventlight.rewards``)
read them, so spans recorded by either project read the same.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

__all__ = [
    "AGL_ANNOTATION",
    "AGL_EXCEPTION",
    "AGL_MESSAGE",
    "AGL_OBJECT",
    "AGL_OPERATION",
    "AGL_REWARD",
    "AGL_VIRTUAL",
    "LightningResourceAttributes",
    "LightningSpanAttributes",
    "LinkAttributes",
    "LinkPydanticModel",
    "RewardAttributes",
    "RewardPydanticModel",
]

AGL_ANNOTATION = "agentlightning.annotation"
AGL_EXCEPTION = "agentlightning.exception"
AGL_MESSAGE = "agentlightning.message"
AGL_OBJECT = "agentlightning.object"
AGL_OPERATION = "agentlightning.operation"
AGL_REWARD = "agentlightning.reward"
AGL_VIRTUAL = "agentlightning.virtual"


class LightningResourceAttributes(StrEnum):
    """Keys of the OpenTelemetry *resource* of a span batch (which attempt it belongs to)."""

    ROLLOUT_ID = "agentlightning.rollout_id"
    ATTEMPT_ID = "agentlightning.attempt_id"
    SPAN_SEQUENCE_ID = "agentlightning.span_sequence_id"
    TRACER_NAME = "agentlightning.tracer.name"


class LightningSpanAttributes(StrEnum):
    """Attribute keys (prefixes) of the spans the emitters write."""

    REWARD = "agentlightning.reward"
    LINK = "agentlightning.link"
    TAG = "agentlightning.tag"
    MESSAGE_BODY = "agentlightning.message.body"
    OBJECT_TYPE = "agentlightning.object.type"
    OBJECT_LITERAL = "agentlightning.object.literal"
    OBJECT_JSON = "agentlightning.object.json"
    OPERATION_NAME = "agentlightning.operation.name"
    OPERATION_INPUT = "agentlightning.operation.input"
    OPERATION_OUTPUT = "agentlightning.operation.output"


class LinkAttributes(StrEnum):
    """Keys of one ``agentlightning.link.<i>`` entry."""

    KEY_MATCH = "key_match"
    VALUE_MATCH = "value_match"


class RewardAttributes(StrEnum):
    """Keys of one ``agentlightning.reward.<i>`` entry."""

    REWARD_NAME = "name"
    REWARD_VALUE = "value"


class LinkPydanticModel(msgspec.Struct, kw_only=True):
    """One link of a span to another (0.3.0's pydantic model, here a msgspec struct)."""

    key_match: str
    value_match: str


class RewardPydanticModel(msgspec.Struct, kw_only=True):
    """One reward dimension (0.3.0's pydantic model, here a msgspec struct)."""

    name: str
    value: float
