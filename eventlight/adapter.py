"""Adapters: turn the spans of one attempt into training data (Agent-lightning ``agentlightning.adapter``).

::

    Adapter[T_from, T_to]                 __call__(source) -> adapt(source)
    └── TraceAdapter[T_to]                source = Sequence[Span]
        ├── TraceToTripletBase            -> list[Triplet]
        │   ├── TracerTraceToTriplet      span tree + time-based reward matching (tracer spans)
        │   └── LlmProxyTraceToTriplet    sequence-id ordering only (LLM proxy spans)
        └── TraceToMessages               -> list[{"messages": [...], "tools": [...] | None}]

Span attributes follow the OpenTelemetry GenAI conventions as AgentOps/OpenLLMetry write them
(``gen_ai.prompt.{i}.role``, ``gen_ai.completion.{i}.content``, ``gen_ai.response.id``) plus the
token-id attributes that Agent-lightning patches in (``prompt_token_ids``, ``response_token_ids``).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Generic, TypedDict, TypeVar

from eventlight.attributes import unflatten_attributes
from eventlight.core.types import Span, Triplet
from eventlight.rewards import get_reward_value

log = logging.getLogger(__name__)

__all__ = [
    "Adapter",
    "LlmProxyTraceToTriplet",
    "OpenAIMessages",
    "RewardMatchPolicy",
    "TraceAdapter",
    "TraceToMessages",
    "TraceToTripletBase",
    "TraceTree",
    "TracerTraceToTriplet",
]

T_from = TypeVar("T_from")
T_to = TypeVar("T_to")

VIRTUAL_ROOT_ID = "virtual-root"
EVENTLIGHT_PROXY_SPAN = "openai.chat.completion"
"""The span eventlight's ``LLMProxy`` records per call, with ``prompt_token_ids``/``response_token_ids``."""
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


class Adapter(Generic[T_from, T_to]):
    """Converts data of one shape into another; calling the adapter calls ``adapt``."""

    def __call__(self, source: T_from, /) -> T_to:
        return self.adapt(source)

    def adapt(self, source: T_from, /) -> T_to:
        """Convert ``source``.

        Raises:
            NotImplementedError: Subclasses must override it.
        """
        raise NotImplementedError(f"{type(self).__name__}.adapt is not implemented")


class TraceAdapter(Adapter[Sequence[Span], T_to], Generic[T_to]):
    """An adapter from the spans of one attempt (ordered by ``sequence_id``)."""


class TraceToTripletBase(TraceAdapter[list[Triplet]]):
    """An adapter from spans to a trajectory of ``Triplet`` (prompt, response, reward)."""


class RewardMatchPolicy(StrEnum):
    """How ``TracerTraceToTriplet`` credits reward spans to LLM calls.

    Both give each reward to the latest not-yet-rewarded LLM call that **ended before the reward
    started**; they differ in which calls are candidates.
    """

    FIRST_OCCURRENCE = "first_occurrence"
    """Any LLM call of the trace, walking all spans in start-time order (the default)."""

    FIRST_SIBLING = "first_sibling"
    """Only LLM calls that are siblings of the reward span (children of the same parent)."""


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
        if isinstance(value, (list, tuple)) and all(isinstance(x, int) for x in value):
            return list(value)
        log.warning("attribute %s is not a list of ints: %r", key, value)
    return None


def _nested(attrs: Mapping[str, Any], prefix: str) -> dict[str, Any] | list[Any] | None:
    """Unflatten the keys below ``prefix.`` (a key equal to ``prefix`` itself is ignored)."""
    cut = len(prefix) + 1
    below = {k[cut:]: v for k, v in attrs.items() if k.startswith(prefix + ".")}
    return unflatten_attributes(below) if below else None


def _first_nested(attrs: Mapping[str, Any], prefixes: Iterable[str]) -> dict[str, Any] | list[Any] | None:
    for prefix in prefixes:
        found = _nested(attrs, prefix)
        if found:
            return found
    return None


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


class TraceTree:
    """A span and its children, built from a flat span list (Agent-lightning ``TraceTree``).

    Attributes:
        id: The span id (``"virtual-root"`` for the synthetic root over several roots).
        span: The span; synthetic nodes get an ``agentlightning.virtual`` span with no attributes.
        children: Child nodes in input order.
    """

    def __init__(self, id: str, span: Span, children: list[TraceTree] | None = None):
        self.id = id
        self.span = span
        self.children = children or []

    @property
    def start_time(self) -> float | None:
        return self.span.start_time

    @property
    def end_time(self) -> float | None:
        return self.span.end_time

    def traverse(self) -> list[TraceTree]:
        """All nodes, depth first, pre-order, children in input order."""
        out = [self]
        for child in self.children:
            out.extend(child.traverse())
        return out

    def agent_name(self) -> str | None:
        return _agent_name(self.span)

    def reward(self) -> float | None:
        return get_reward_value(self.span)

    def is_reward_span(self) -> bool:
        """A reward-carrying span, or an ``agentlightning.operation`` named ``agentlightning.reward``."""
        if self.reward() is not None:
            return True
        attrs = self.span.attributes or {}
        return self.span.name == OPERATION_SPAN and attrs.get(OPERATION_NAME) == REWARD_OPERATION

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_spans(cls, spans: Sequence[Span]) -> TraceTree:
        """Link spans by ``parent_id``; missing parents and several roots get synthetic nodes.

        Raises:
            ValueError: ``spans`` is empty, or no span is a root (every parent is itself a span).
        """
        if not spans:
            raise ValueError("no spans to build a trace tree from")
        by_id = {s.span_id: s for s in spans}
        children: dict[str, list[str]] = {}
        roots = [s.span_id for s in spans if s.parent_id is None]
        for s in spans:
            if s.parent_id is not None:
                children.setdefault(s.parent_id, []).append(s.span_id)
        roots += [pid for pid in children if pid not in by_id]  # lost parents (e.g. a session span)
        if not roots:
            raise ValueError("no root span found in the trace (parent links form a cycle)")
        nodes = [cls._build(rid, by_id, children) for rid in roots]
        if len(nodes) == 1:
            return nodes[0]
        return cls(VIRTUAL_ROOT_ID, _synthetic_span(VIRTUAL_ROOT_ID, nodes, name="virtual-root"), nodes)

    @classmethod
    def _build(cls, node_id: str, by_id: dict[str, Span], children: dict[str, list[str]]) -> TraceTree:
        kids = [cls._build(cid, by_id, children) for cid in children.get(node_id, [])]
        span = by_id.get(node_id) or _synthetic_span(node_id, kids)
        return cls(node_id, span, kids)

    # -- repair ----------------------------------------------------------------------------

    def repair_hierarchy(self) -> None:
        """Move top-level children under the span that encloses them most tightly in time.

        Mixed instrumentation can leave LLM spans floating directly under the root instead of
        under their agent. Like Agent-lightning: if this node has one child, repair that child
        instead; otherwise each original child (until one remains) is moved under the node of the
        tree (not itself, not this root) whose ``[start, end]`` contains it with the smallest
        strictly positive slack. Simplified: only this top level is repaired, and nodes with a
        missing start or end time are neither moved nor chosen as parents.
        """
        if len(self.children) == 1:
            self.children[0].repair_hierarchy()
            return
        for node in list(self.children):
            if len(self.children) == 1:
                break
            parent = self._tightest_enclosing(node)
            if parent is not None:
                self.children.remove(node)
                parent.children.append(node)

    def _tightest_enclosing(self, child: TraceTree) -> TraceTree | None:
        if child.start_time is None or child.end_time is None:
            return None
        best: TraceTree | None = None
        best_slack = float("inf")
        for node in self.traverse():
            if node is self or node.id == child.id or node.start_time is None or node.end_time is None:
                continue
            if node.start_time <= child.start_time and node.end_time >= child.end_time:
                slack = (node.end_time - child.end_time) + (child.start_time - node.start_time)
                if 0 < slack < best_slack:
                    best, best_slack = node, slack
        return best

    # -- LLM calls and rewards ---------------------------------------------------------------

    def find_llm_calls(
        self,
        *,
        llm_call_match: str,
        agent_match: str | None,
        exclude_llm_call_in_reward: bool = True,
        dedup_llm_call: bool = True,
    ) -> list[tuple[TraceTree, str]]:
        """LLM call nodes (DFS pre-order) with the name of their enclosing matching agent.

        Rules (Agent-lightning 0.3): the span name must ``re.search``-match ``llm_call_match``;
        with ``agent_match=None`` the whole tree counts (agent ``"*"``), otherwise only nodes below
        an agent whose name matches (a non-matching agent resets it); with
        ``exclude_llm_call_in_reward`` nothing below a reward span counts; with ``dedup_llm_call``
        a response id seen before, or a nested match without response id below a matched call, is
        skipped. A node's own agent/reward status applies to its descendants only.
        """
        walker = _LlmCallWalker(llm_call_match, agent_match, exclude_llm_call_in_reward, dedup_llm_call)
        walker.visit(self, "*" if agent_match is None else None, False, False)
        return walker.found

    def match_rewards(self, policy: RewardMatchPolicy | str, llm_calls: Sequence[TraceTree]) -> dict[str, float]:
        """Map LLM call ids to the rewards credited to them (see ``RewardMatchPolicy``).

        Spans without a start time sort last; a call without an end time is never credited.
        """
        ids = {c.id for c in llm_calls}
        rewards: dict[str, float] = {}
        if RewardMatchPolicy(policy) is RewardMatchPolicy.FIRST_OCCURRENCE:
            ordered = sorted(self.traverse(), key=lambda n: _time(n.start_time, float("inf")))
            _credit_in_order(ordered, ids, rewards)
        else:
            for node in self.traverse():
                _credit_in_order(node.children, ids, rewards)
        return rewards


class _LlmCallWalker:
    """Depth-first search state of ``TraceTree.find_llm_calls``."""

    def __init__(self, llm_call_match: str, agent_match: str | None, exclude_in_reward: bool, dedup: bool):
        self.llm_call_match = llm_call_match
        self.agent_match = agent_match
        self.exclude_in_reward = exclude_in_reward
        self.dedup = dedup
        self.seen_response_ids: set[str] = set()
        self.found: list[tuple[TraceTree, str]] = []

    def visit(self, node: TraceTree, agent: str | None, in_reward: bool, in_llm_call: bool) -> None:
        if self._is_call(node, agent, in_reward, in_llm_call):
            self.found.append((node, agent))  # type: ignore[arg-type]  # _is_call checks agent
            in_llm_call = True
        name = node.agent_name()
        if name is not None:
            agent = name if self.agent_match is None or re.search(self.agent_match, name) else None
        in_reward = in_reward or (self.exclude_in_reward and node.is_reward_span())
        for child in node.children:
            self.visit(child, agent, in_reward, in_llm_call)

    def _is_call(self, node: TraceTree, agent: str | None, in_reward: bool, in_llm_call: bool) -> bool:
        if agent is None or in_reward or re.search(self.llm_call_match, node.span.name) is None:
            return False
        if not self.dedup:
            return True
        response_id = _first_str(node.span.attributes or {}, RESPONSE_ID_KEYS)
        if response_id is None:
            return not in_llm_call
        if response_id in self.seen_response_ids:
            return False
        self.seen_response_ids.add(response_id)
        return True


def _credit_in_order(nodes: Sequence[TraceTree], llm_ids: set[str], rewards: dict[str, float]) -> None:
    """Walk ``nodes`` in order; each reward goes to the latest unrewarded call that ended before it."""
    calls: list[tuple[str, float]] = []
    for node in nodes:
        if node.id in llm_ids:
            calls.append((node.id, _time(node.end_time, float("inf"))))
        value = node.reward()
        if value is None:
            continue
        start = _time(node.start_time, float("inf"))
        for call_id, end in reversed(calls):
            if end <= start and call_id not in rewards:
                rewards[call_id] = value
                break


def _synthetic_span(span_id: str, children: Sequence[TraceTree], name: str | None = None) -> Span:
    """A placeholder span covering ``children`` in time, with ids copied from the first child."""
    first = children[0].span
    starts = [c.start_time for c in children if c.start_time is not None]
    ends = [c.end_time for c in children if c.end_time is not None]
    return Span.from_attributes(
        attributes={},
        rollout_id=first.rollout_id,
        attempt_id=first.attempt_id,
        sequence_id=first.sequence_id,
        trace_id=first.trace_id,
        span_id=span_id,
        name=name,
        start_time=min(starts) if starts else None,
        end_time=max(ends) if ends else None,
    )


# ------------------------------------------------------------------------------------------
# Triplets from tracer spans


def _image_urls(prompt: Any) -> list[str]:
    """URLs of ``image_url`` content parts in prompt messages, in order."""
    messages = prompt if isinstance(prompt, list) else [prompt] if isinstance(prompt, dict) else []
    urls: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            try:
                content = json.loads(content)
            except json.JSONDecodeError:
                continue
        for part in content if isinstance(content, list) else []:
            is_image = isinstance(part, dict) and part.get("type") == "image_url"
            image = part.get("image_url") if is_image else None
            if isinstance(image, dict) and "url" in image:
                urls.append(image["url"])
    return urls


def _strip_keys(data: Any, keys: frozenset[str]) -> Any:
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if k not in keys}
    return data


_RESPONSE_META_DROP = frozenset({"choices", "prompt_token_ids", "response_token_ids"})


def span_to_triplet(span: Span, agent_name: str) -> Triplet:
    """Build the triplet of one LLM call span (reward left ``None``).

    Returns:
        ``Triplet(prompt={"token_ids", "raw_content", "image_urls"}, response={"token_ids",
        "raw_content"[, "logprobs"]}, metadata={"request", "response", "response_id", "agent_name"})``;
        raw contents are the unflattened ``gen_ai.prompt`` / ``gen_ai.completion`` (or the Weave
        ``agentlightning.operation.*`` equivalents).
    """
    attrs = span.attributes or {}
    prompt_raw = _first_nested(attrs, ("gen_ai.prompt", "agentlightning.operation.input.messages"))
    response: dict[str, Any] = {
        "token_ids": _first_ids(attrs, RESPONSE_TOKEN_KEYS) or [],
        "raw_content": _first_nested(attrs, ("gen_ai.completion", "agentlightning.operation.output.choices")),
    }
    if isinstance(attrs.get("logprobs.content"), str):
        response["logprobs"] = json.loads(attrs["logprobs.content"])
    request_meta = _first_nested(attrs, ("gen_ai.request", "agentlightning.operation.input"))
    response_meta = _first_nested(attrs, ("gen_ai.response", "agentlightning.operation.output"))
    return Triplet(
        prompt={
            "token_ids": _first_ids(attrs, PROMPT_ID_KEYS) or [],
            "raw_content": prompt_raw,
            "image_urls": _image_urls(prompt_raw),
        },
        response=response,
        metadata={
            "request": _strip_keys(request_meta, frozenset({"messages"})),
            "response": _strip_keys(response_meta, _RESPONSE_META_DROP),
            "response_id": _first_str(attrs, RESPONSE_ID_KEYS),
            "agent_name": agent_name,
        },
    )


def _as_spans(source: Sequence[Any]) -> list[Span]:
    """Accept eventlight spans or OpenTelemetry ``ReadableSpan`` (converted with dummy ids)."""
    if all(isinstance(s, Span) for s in source):
        return list(source)
    from eventlight.otel import span_from_readable

    return [s if isinstance(s, Span) else span_from_readable(s, "dummy", "dummy", 0) for s in source]


class TracerTraceToTriplet(TraceToTripletBase):
    """Triplets from tracer spans: one per LLM call, rewards matched by time (Agent-lightning 0.3).

    Args:
        repair_hierarchy: Re-parent floating top-level spans first (``TraceTree.repair_hierarchy``,
            a simplified version: top level only, spans without timestamps left alone).
        llm_call_match: Regex (``re.search``) on span names that marks LLM calls.
        agent_match: Regex on agent names; only calls below a matching agent count. ``None`` = all.
        exclude_llm_call_in_reward: Ignore LLM calls inside reward spans (e.g. an LLM judge).
        reward_match: ``RewardMatchPolicy`` (or its string value).
        _skip_empty_token_spans: Drop calls lacking prompt or response token ids.

    Output order is DFS pre-order with children in input order (not time order).
    """

    def __init__(
        self,
        repair_hierarchy: bool = True,
        llm_call_match: str = r"openai\.chat\.completion",
        agent_match: str | None = None,
        exclude_llm_call_in_reward: bool = True,
        reward_match: RewardMatchPolicy | str = RewardMatchPolicy.FIRST_OCCURRENCE,
        _skip_empty_token_spans: bool = False,
    ):
        self.repair_hierarchy = repair_hierarchy
        self.llm_call_match = llm_call_match
        self.agent_match = agent_match
        self.exclude_llm_call_in_reward = exclude_llm_call_in_reward
        self.reward_match = RewardMatchPolicy(reward_match)
        self._skip_empty_token_spans = _skip_empty_token_spans

    def build_tree(self, source: Sequence[Any]) -> TraceTree:
        """The (optionally repaired) span tree of ``source``.

        Raises:
            ValueError: ``source`` is empty.
        """
        tree = TraceTree.from_spans(_as_spans(source))
        if self.repair_hierarchy:
            tree.repair_hierarchy()
        return tree

    def adapt(self, source: Sequence[Any], /) -> list[Triplet]:
        """Convert the spans of one attempt into triplets.

        Returns:
            One triplet per matched LLM call; ``[]`` (with a warning naming the spans seen) when no
            span matches ``llm_call_match`` or ``source`` is empty.
        """
        if not source:
            return []
        tree = self.build_tree(source)
        calls = tree.find_llm_calls(
            llm_call_match=self.llm_call_match,
            agent_match=self.agent_match,
            exclude_llm_call_in_reward=self.exclude_llm_call_in_reward,
        )
        pairs = [(node, span_to_triplet(node.span, agent)) for node, agent in calls]
        if self._skip_empty_token_spans:
            pairs = [(n, t) for n, t in pairs if t.prompt["token_ids"] and t.response["token_ids"]]
        if not pairs:
            names = sorted({n.span.name for n in tree.traverse()})
            log.warning("no span matches llm_call_match=%r; span names seen: %s", self.llm_call_match, names)
            return []
        rewards = tree.match_rewards(self.reward_match, [n for n, _ in pairs])
        for node, triplet in pairs:
            triplet.reward = rewards.get(node.id)
        return [t for _, t in pairs]


# ------------------------------------------------------------------------------------------
# Triplets from LLM proxy spans


def _literal(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


def _int_list(value: Any) -> list[int]:
    value = _literal(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(x, int) for x in value):
        return list(value)
    return []


def _raw_request_ids(attrs: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """Token ids of a ``raw_gen_ai_request`` span (vLLM via LiteLLM), flat or stringified."""
    prompt = _int_list(attrs.get("llm.hosted_vllm.prompt_token_ids"))
    nested = _literal(attrs.get("llm.hosted_vllm.response_token_ids"))
    response = _int_list(nested[0]) if isinstance(nested, list) and nested else []
    response = response or _int_list(attrs.get("llm.hosted_vllm.response_token_ids.0"))
    choices = _literal(attrs.get("llm.hosted_vllm.choices"))
    if not response and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        response = _int_list(choices[0].get("token_ids"))
    return prompt, response or _int_list(attrs.get("llm.hosted_vllm.choices.0.token_ids"))


class LlmProxyTraceToTriplet(TraceToTripletBase):
    """Triplets from LLM proxy spans, ordered purely by ``sequence_id`` (Agent-lightning, experimental).

    Timestamps are ignored on purpose: proxies on other machines may have skewed clocks.

    1. Spans are sorted by ``(sequence_id, start_time)``.
    2. LLM calls are ``raw_gen_ai_request`` spans (``llm.hosted_vllm.prompt_token_ids``, response
       from ``llm.hosted_vllm.response_token_ids[0]`` or ``llm.hosted_vllm.choices[0].token_ids``;
       strings are parsed with ``ast.literal_eval``) or ``litellm_request`` spans
       (``prompt_token_ids``/``response_token_ids``). Both lists must be non-empty. Calls are
       deduplicated by ``gen_ai.response.id`` or ``llm.hosted_vllm.id``. Extension: spans named
       ``openai.chat.completion`` with ``prompt_token_ids``/``response_token_ids`` (what
       eventlight's own ``LLMProxy`` records) count too.
    3. Each reward, in sequence order, goes to the latest unrewarded call with a strictly smaller
       sequence id.
    """

    def adapt(self, source: Sequence[Span], /) -> list[Triplet]:
        """Convert proxy spans into ``Triplet(prompt={"token_ids"}, response={"token_ids"}, reward,
        metadata={"response_id"})`` items in sequence order."""
        spans = sorted(source, key=lambda s: (s.sequence_id, _time(s.start_time, 0.0)))
        calls = self._llm_calls(spans)
        rewarded: dict[int, float] = {}
        for span in spans:
            value = get_reward_value(span)
            if value is None:
                continue
            for i in reversed(range(len(calls))):
                if i not in rewarded and calls[i][0].sequence_id < span.sequence_id:
                    rewarded[i] = value
                    break
        return [
            Triplet(
                prompt={"token_ids": prompt},
                response={"token_ids": response},
                reward=rewarded.get(i),
                metadata={"response_id": rid},
            )
            for i, (_, prompt, response, rid) in enumerate(calls)
        ]

    @staticmethod
    def _llm_calls(spans: Sequence[Span]) -> list[tuple[Span, list[int], list[int], str | None]]:
        calls: list[tuple[Span, list[int], list[int], str | None]] = []
        seen: set[str] = set()
        for span in spans:
            attrs = span.attributes or {}
            if span.name == "raw_gen_ai_request":
                prompt, response = _raw_request_ids(attrs)
            elif span.name in ("litellm_request", EVENTLIGHT_PROXY_SPAN):
                prompt = _int_list(attrs.get("prompt_token_ids"))
                response = _int_list(attrs.get("response_token_ids"))
            else:
                continue
            if not (prompt and response):
                continue
            rid = attrs.get("gen_ai.response.id") or attrs.get("llm.hosted_vllm.id")
            rid = rid if isinstance(rid, str) and rid else None
            if rid is not None and rid in seen:
                continue
            if rid is not None:
                seen.add(rid)
            calls.append((span, prompt, response, rid))
        return calls


# ------------------------------------------------------------------------------------------
# OpenAI chat messages


class OpenAIMessages(TypedDict):
    """One LLM call as an OpenAI fine-tuning JSONL record.

    Attributes:
        messages: Chat messages (``{"role", "content", ...}``), prompt then completion.
        tools: Function tool definitions offered to the model, or ``None``.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def _group(attrs: Mapping[str, Any], prefix: str) -> Any:
    """Unflatten the attributes below ``prefix.``; ``None`` when there are none.

    Index levels become lists even when indices have gaps (sorted), as Agent-lightning's
    ``group_genai_dict`` does for ``gen_ai.prompt.{i}``.
    """
    value = _nested(attrs, prefix)
    return _gaps_to_list(value) if value is not None else None


def _gaps_to_list(value: Any) -> Any:
    if isinstance(value, list):
        return [_gaps_to_list(v) for v in value]
    if not isinstance(value, dict):
        return value
    digits = [k for k in value if k.isdigit()]
    if digits:
        return [_gaps_to_list(value[k]) for k in sorted(digits, key=int)]
    return {k: _gaps_to_list(v) for k, v in value.items()}


def _function(name: Any, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def _prompt_message(msg: dict[str, Any]) -> dict[str, Any] | None:
    role = msg.get("role")
    if role is None:  # some tracers drop the role of re-emitted turns; infer it when unambiguous
        role = "assistant" if "tool_calls" in msg else "tool" if "tool_call_id" in msg else None
    if role is None:
        log.warning("skipping a prompt message with no role: %r", msg)
        return None
    if role == "assistant" and isinstance(msg.get("tool_calls"), list):
        calls = [
            {"id": c.get("id"), "type": "function", "function": _function(c.get("name"), c.get("arguments"))}
            for c in msg["tool_calls"]
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    out: dict[str, Any] = {"role": role, "content": msg.get("content", "")}
    if role == "tool" or msg.get("tool_call_id") is not None:
        out["tool_call_id"] = msg.get("tool_call_id")
    return out


def _tool_calls(span: Span, spans: Sequence[Span]) -> list[dict[str, Any]]:
    """Tool calls recorded as direct children of ``span`` with ``tool.*`` attributes."""
    calls: list[dict[str, Any]] = []
    for child in spans:
        tool = _group(child.attributes or {}, "tool") if child.parent_id == span.span_id else None
        if not tool:
            continue
        if not isinstance(tool, dict):
            raise ValueError(f"tool attributes of span {child.span_id} are not a dict: {tool!r}")
        raw_call = tool.get("call")
        call: dict[str, Any] = raw_call if isinstance(raw_call, dict) else {}
        calls.append(
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": _function(tool.get("name"), tool.get("parameters")),
            }
        )
    return calls


def _tools(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    functions = request.get("functions")
    if not isinstance(functions, list):
        return None
    defined = [fn for fn in functions if isinstance(fn, dict)]
    return [{"type": "function", "function": _function_definition(fn)} for fn in defined]


def _function_definition(fn: dict[str, Any]) -> dict[str, Any]:
    parameters = fn.get("parameters")
    return {
        "name": fn.get("name"),
        "description": fn.get("description", ""),
        "parameters": json.loads(parameters) if isinstance(parameters, str) else parameters,
    }


class TraceToMessages(TraceAdapter[list[OpenAIMessages]]):
    """OpenAI chat records from ``gen_ai.*`` span attributes (Agent-lightning ``TraceToMessages``).

    Every span with any ``gen_ai.prompt.*``, ``gen_ai.completion.*``, ``gen_ai.request.*`` or
    ``gen_ai.response.*`` attribute gives one record (no tree: two instrumentation layers recording
    the same call give two records). Prompt messages come from ``gen_ai.prompt.{i}.*``; each
    ``gen_ai.completion.{i}`` with role ``assistant`` is appended, carrying as ``tool_calls`` the
    direct child spans with ``tool.*`` attributes (``tool.call.id``, ``tool.call.type``,
    ``tool.name``, ``tool.parameters``); ``tools`` come from ``gen_ai.request.functions.{i}``.
    The output matches the OpenAI fine-tuning JSONL schema. APO shows these records to its critic.
    """

    def adapt(self, source: Sequence[Span], /) -> list[OpenAIMessages]:
        """Convert spans into records.

        Raises:
            ValueError: A span's prompt/completion is not a list, or its request/response not a dict.
        """
        return [record for span in source if (record := self._record(span, source)) is not None]

    def _record(self, span: Span, spans: Sequence[Span]) -> OpenAIMessages | None:
        attrs = span.attributes or {}
        prompt, completion = _group(attrs, "gen_ai.prompt"), _group(attrs, "gen_ai.completion")
        request, response = _group(attrs, "gen_ai.request"), _group(attrs, "gen_ai.response")
        for what, value, kind in (
            ("prompt", prompt, list),
            ("completion", completion, list),
            ("request", request, dict),
            ("response", response, dict),
        ):
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"gen_ai.{what} of span {span.span_id} is not a {kind.__name__}: {value!r}")
        if prompt is None and completion is None and request is None and response is None:
            return None
        messages = [m for m in map(_prompt_message, prompt or []) if m is not None]
        tool_calls = _tool_calls(span, spans)
        for comp in completion or []:
            if isinstance(comp, dict) and comp.get("role") == "assistant":
                message: dict[str, Any] = {"role": "assistant", "content": comp.get("content")}
                if tool_calls:
                    message["tool_calls"] = tool_calls
                messages.append(message)
        return OpenAIMessages(messages=messages, tools=_tools(request or {}))
