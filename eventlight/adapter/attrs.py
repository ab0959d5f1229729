"""Span names, attribute keys and small attribute readers shared by the adapters."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from itertools import repeat
from typing import Any

from eventlight.attributes import unflatten_attributes
from eventlight.core.types import Span

log = logging.getLogger(__name__)

VIRTUAL_ROOT_ID = "virtual-root"
EVENTLIGHT_PROXY_SPAN = "openai.chat.completion"
"""The span eventlight's ``LLMProxy`` records per call, with ``prompt_token_ids``/``response_token_ids``."""
TOKEN_IDS_MISSING = "eventlight.token_ids.missing"
"""Span attribute the LLM proxy writes on a successful call whose response lacked token ids: which
ones, ``["prompt"]``, ``["response"]`` or both."""
TOKEN_IDS_INCOMPLETE = "token_ids_incomplete"
"""Span attribute ``True`` when the ids do not add up to the call's usage counts (peer failure C14)."""
OPERATION_SPAN = "agentlightning.operation"
OPERATION_NAME = "agentlightning.operation.name"
REWARD_OPERATION = "agentlightning.reward"
RESPONSE_ID_KEYS = ("gen_ai.response.id", "agentlightning.operation.output.id")
PROMPT_ID_KEYS = ("prompt_token_ids", "agentlightning.operation.output.prompt_token_ids")
RESPONSE_TOKEN_KEYS = (
    "response_token_ids",
    "agentlightning.operation.output.response_token_ids.0",
    "agentlightning.operation.output.choices.0.token_ids",
    "agentlightning.operation.output.choices.0.provider_specific_fields.token_ids",
)


# ------------------------------------------------------------------------------------------
# Small attribute readers


def _first_str(attrs: Mapping[str, Any], keys: Iterable[str]) -> str | None:
    for key in keys:
        value = attrs.get(key)
        if isinstance(value, str):
            return value
        if value is not None:
            log.warning("attribute %s is not a string: %r", key, value)
    return None


def _first_ids(attrs: Mapping[str, Any], keys: Iterable[str]) -> list[int] | None:
    for key in keys:
        value = attrs.get(key)
        if value is None:
            continue
        if isinstance(value, (list, tuple)) and all(map(isinstance, value, repeat(int))):
            return list(value)
        log.warning("attribute %s is not a list of ints: %r", key, value)
    return None


def _nested(attrs: Mapping[str, Any], prefix: str) -> dict[str, Any] | list[Any] | None:
    """Unflatten the keys below ``prefix.`` (a key equal to ``prefix`` itself is ignored)."""
    dotted = prefix + "."
    cut = len(dotted)
    below = {k[cut:]: v for k, v in attrs.items() if k.startswith(dotted)}
    return unflatten_attributes(below) if below else None


class Heads:
    """A set of attribute prefixes ("heads") whose keys ``below`` sorts out in one pass.

    Span attribute keys repeat from span to span (``gen_ai.prompt.0.role`` in every LLM call), so
    where each key goes is worked out once per key and kept (up to ``CACHED_KEYS`` keys).
    """

    CACHED_KEYS = 65536

    def __init__(self, *heads: str):
        self.heads = frozenset(heads)
        self._where: dict[str, tuple[tuple[str, str], ...]] = {}

    def _split(self, key: str) -> tuple[tuple[str, str], ...]:
        """``(head, rest)`` for each head ``key`` is below (``head.rest``), shortest head first."""
        out = []
        i = key.find(".")
        while i >= 0:
            if key[:i] in self.heads:
                out.append((key[:i], key[i + 1 :]))
            i = key.find(".", i + 1)
        if len(self._where) >= self.CACHED_KEYS:
            self._where.clear()
        found = self._where[key] = tuple(out)
        return found

    def below(self, attrs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """``{head: {rest of key: value}}`` for each head some key of ``attrs`` is below
        (``head.rest``), keys in ``attrs`` order; a key can be below several nested heads. The
        same as one ``_nested`` filter per head, in one pass over ``attrs``."""
        out: dict[str, dict[str, Any]] = {}
        where = self._where
        for key, value in attrs.items():
            found = where.get(key)
            if found is None:
                found = self._split(key)
            for head, rest in found:
                group = out.get(head)
                if group is None:
                    group = out[head] = {}
                group[rest] = value
        return out


def _unflat(below: dict[str, Any] | None) -> dict[str, Any] | list[Any] | None:
    """``_nested`` of a group ``Heads.below`` sorted out."""
    return unflatten_attributes(below) if below else None


def _time(value: float | None, missing: float) -> float:
    return missing if value is None else value


# ------------------------------------------------------------------------------------------
# The span tree


def _agent_name(span: Span) -> str | None:
    """The agent a span stands for, from the attributes common agent frameworks write."""
    attrs = span.attributes or {}
    candidates = (
        attrs.get("agent.name"),  # OpenAI Agents SDK
        attrs.get("operation.name") if attrs.get("agentops.span.kind") == "agent" else None,  # AgentOps
        attrs.get("recipient_agent_type"),  # AutoGen
        attrs.get("langchain.chain.type"),  # LangGraph
        attrs.get("executor.id"),  # agent-framework
        attrs.get("agentlightning.operation.input.name") if attrs.get("type") == "agent" else None,  # Weave
        attrs.get("lc_name") if span.name.startswith("langchain.Chain.") else None,  # Weave + LangChain
    )
    return next((str(c) for c in candidates if c is not None), None)
