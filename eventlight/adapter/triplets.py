"""Triplet adapters: ``TracerTraceToTriplet`` (span tree + reward matching) and ``LlmProxyTraceToTriplet``."""

from __future__ import annotations

import ast
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from eventlight.adapter.attrs import (
    EVENTLIGHT_PROXY_SPAN,
    PROMPT_ID_KEYS,
    RESPONSE_ID_KEYS,
    RESPONSE_TOKEN_KEYS,
    TOKEN_IDS_INCOMPLETE,
    VIRTUAL_ROOT_ID,
    Heads,
    _first_ids,
    _first_str,
    _time,
    _unflat,
)
from eventlight.adapter.base import RewardMatchPolicy, TraceToTripletBase
from eventlight.adapter.stats import AdapterStats, is_error
from eventlight.adapter.tree import TraceTree
from eventlight.core.types import Span, Triplet
from eventlight.genai import INPUT_MESSAGES, OUTPUT_MESSAGES, openai_messages
from eventlight.rewards import get_reward_value

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# Triplets from tracer spans


def _image_urls(prompt: Any) -> list[str]:
    """URLs of ``image_url`` content parts in prompt messages, in order."""
    messages = prompt if isinstance(prompt, list) else [prompt] if isinstance(prompt, dict) else []
    urls: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            if not content.lstrip(" \t\n\r").startswith("["):
                continue  # JSON text that is not a list holds no content parts
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
_OP_INPUT, _OP_OUTPUT = "agentlightning.operation.input", "agentlightning.operation.output"  # Weave's
_TRIPLET_HEADS = Heads(
    "gen_ai.prompt",
    "gen_ai.completion",
    "gen_ai.request",
    "gen_ai.response",
    _OP_INPUT,
    _OP_INPUT + ".messages",
    _OP_OUTPUT,
    _OP_OUTPUT + ".choices",
)


def span_to_triplet(span: Span, agent_name: str) -> Triplet:
    """Build the triplet of one LLM call span (reward left ``None``).

    Returns:
        ``Triplet(prompt={"token_ids", "raw_content", "image_urls"}, response={"token_ids",
        "raw_content"[, "logprobs"]}, metadata={"request", "response", "response_id", "agent_name"})``;
        raw contents are the unflattened ``gen_ai.prompt`` / ``gen_ai.completion`` (or the Weave
        ``agentlightning.operation.*`` equivalents, or the current ``gen_ai.input.messages`` /
        ``gen_ai.output.messages`` as OpenAI-style messages).
    """
    attrs = span.attributes or {}
    below = _TRIPLET_HEADS.below(attrs)
    prompt_raw = _unflat(below.get("gen_ai.prompt")) or _unflat(below.get(_OP_INPUT + ".messages"))
    if prompt_raw is None:
        prompt_raw = openai_messages(attrs, INPUT_MESSAGES)  # the current GenAI conventions
    completion_raw = _unflat(below.get("gen_ai.completion")) or _unflat(below.get(_OP_OUTPUT + ".choices"))
    if completion_raw is None:
        completion_raw = openai_messages(attrs, OUTPUT_MESSAGES)
    response: dict[str, Any] = {
        "token_ids": _first_ids(attrs, RESPONSE_TOKEN_KEYS) or [],
        "raw_content": completion_raw,
    }
    if isinstance(attrs.get("logprobs.content"), str):
        response["logprobs"] = json.loads(attrs["logprobs.content"])
    request_meta = _unflat(below.get("gen_ai.request")) or _unflat(below.get(_OP_INPUT))
    response_meta = _unflat(below.get("gen_ai.response")) or _unflat(below.get(_OP_OUTPUT))
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

    Attributes:
        last_unmatched: The span names of the latest ``adapt`` call's spans when none matched
            ``llm_call_match`` (sorted), else ``None``.
        warn_unmatched: Log a warning for each ``adapt`` call whose spans none matched (default);
            ``eventlight.replay`` turns it off and tells once for the whole replay.
    """

    last_unmatched: tuple[str, ...] | None = None
    warn_unmatched: bool = True
    warn_left_out: bool = True
    """Log a warning for an attempt whose LLM calls were all left out (``eventlight.replay`` turns it
    off and tells them once, counted, at its end)."""

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
            span matches ``llm_call_match`` or ``source`` is empty. Of the copies of one call that
            several instrumentation layers recorded (the LLM proxy's beside a framework's), the one
            with token ids is kept; its ``metadata["duplicates_dropped"]`` and ``stats.duplicates``
            count the others.
        """
        stats = AdapterStats()
        self.last_unmatched = None
        if not source:
            self._counted(stats)
            return []
        tree = self.build_tree(source)
        calls, dropped = tree.find_llm_calls_counted(
            llm_call_match=self.llm_call_match,
            agent_match=self.agent_match,
            exclude_llm_call_in_reward=self.exclude_llm_call_in_reward,
        )
        stats.duplicates += sum(dropped.values())
        stats.llm_calls = len(calls) + stats.duplicates
        stats.cycles_cut = tree.cycles_cut
        pairs = []
        for node, agent in calls:
            if is_error(node.span):  # an upstream error: no completion to train on
                stats.errors += 1
                continue
            triplet = _marked(span_to_triplet(node.span, agent), node.span, stats)
            if dropped.get(node.id):
                triplet.metadata["duplicates_dropped"] = dropped[node.id]
            if self._skip_empty_token_spans and triplet.metadata.get("token_ids_missing"):
                continue
            pairs.append((node, triplet))
        stats.triplets = len(pairs)
        self._counted(stats)
        if not pairs:
            if calls:  # matched, and every one left out: say why rather than "no span matches"
                if self.warn_left_out:
                    span = calls[0][0].span
                    log.warning(
                        "no triplet: all %d LLM call(s) were left out (rollout %s, attempt %s): %s",
                        stats.llm_calls,
                        span.rollout_id,
                        span.attempt_id,
                        stats,
                    )
                return []
            self.last_unmatched = tuple(sorted({n.span.name for n in tree.traverse() if n.id != VIRTUAL_ROOT_ID}))
            if self.warn_unmatched:
                log.warning(
                    "no span matches llm_call_match=%r; span names seen: %s (%s)",
                    self.llm_call_match,
                    list(self.last_unmatched),
                    stats,
                )
            return []
        rewards = tree.match_rewards(self.reward_match, [n for n, _ in pairs])
        for node, triplet in pairs:
            triplet.reward = rewards.get(node.id)
        return [t for _, t in pairs]


def _marked(triplet: Triplet, span: Span, stats: AdapterStats) -> Triplet:
    """Mark (and count) missing or incomplete token ids in the triplet's metadata."""
    missing = [
        what for what, part in (("prompt", triplet.prompt), ("response", triplet.response)) if not part["token_ids"]
    ]
    if missing:
        triplet.metadata["token_ids_missing"] = missing
        stats.missing_token_ids += 1
    if (span.attributes or {}).get(TOKEN_IDS_INCOMPLETE) is True:
        triplet.metadata["token_ids_incomplete"] = True
        stats.incomplete_token_ids += 1
    return triplet


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
       (``prompt_token_ids``/``response_token_ids``). Both lists must be non-empty, so framework
       copies of a call (no ids) never count. Calls are deduplicated by ``gen_ai.response.id`` or
       ``llm.hosted_vllm.id`` (the first kept; ``stats.duplicates`` counts the others).
       Extension: spans named ``openai.chat.completion`` with ``prompt_token_ids``/
       ``response_token_ids`` (what eventlight's own ``LLMProxy`` records) count too.
    3. Each reward, in sequence order, goes to the latest unrewarded call with a strictly smaller
       sequence id.
    """

    def adapt(self, source: Sequence[Span], /) -> list[Triplet]:
        """Convert proxy spans into ``Triplet(prompt={"token_ids"}, response={"token_ids"}, reward,
        metadata={"response_id"})`` items in sequence order."""
        spans = sorted(source, key=lambda s: (s.sequence_id, _time(s.start_time, 0.0)))
        stats = AdapterStats()
        calls = self._llm_calls(spans, stats)
        stats.triplets = len(calls)
        self._counted(stats)
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
                metadata={"response_id": rid, **_incomplete(span)},
            )
            for i, (span, prompt, response, rid) in enumerate(calls)
        ]

    @staticmethod
    def _llm_calls(spans: Sequence[Span], stats: AdapterStats) -> list[tuple[Span, list[int], list[int], str | None]]:
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
            stats.llm_calls += 1
            if is_error(span):
                stats.errors += 1
                continue
            if not (prompt and response):
                stats.missing_token_ids += 1
                continue
            rid = attrs.get("gen_ai.response.id") or attrs.get("llm.hosted_vllm.id")
            rid = rid if isinstance(rid, str) and rid else None
            if rid is not None and rid in seen:
                stats.duplicates += 1
                continue
            if rid is not None:
                seen.add(rid)
            stats.incomplete_token_ids += attrs.get(TOKEN_IDS_INCOMPLETE) is True
            calls.append((span, prompt, response, rid))
        return calls


def _incomplete(span: Span) -> dict[str, Any]:
    return {"token_ids_incomplete": True} if (span.attributes or {}).get(TOKEN_IDS_INCOMPLETE) is True else {}
