"""One span per LLM call when several layers recorded it: keep the copy with token ids.

An agent written with a framework and run behind the LLM proxy records each call two or three
times: the proxy's span (with the token ids the backend returned), the OpenAI SDK's span, and the
framework's own (OpenInference's ``ChatCompletion``, ``ChatOpenAI``, the Agents SDK's
``generation``), none of which has ids. ``keep_one_copy`` groups the copies of one call and keeps
one per call:

1. **By response id**, when a copy has one: ``gen_ai.response.id`` (the proxy, OpenTelemetry's
   GenAI conventions), ``agentlightning.operation.output.id``, ``llm.hosted_vllm.id``, or the
   ``id`` in OpenInference's JSON ``output.value`` (the OpenAI response, or LangChain's
   ``llm_output`` / ``response_metadata``).
2. **Else by what the model produced**: a copy without response id joins a call whose output
   (assistant text and tool-call ids, in the flat ``gen_ai.completion.0.*``, the JSON
   ``gen_ai.output.messages`` or OpenInference's ``llm.output_messages.0.*``) is the same, whose
   token counts do not differ, and which has no copy of the same span name yet (one copy per
   layer). Clocks are not used: the proxy may run on another machine. A copy that matches nothing
   stays a call of its own; two layers that record *different* calls with the same output and
   counts are taken for one call (rare; give the calls response ids to rule it out).

Of each call the copy kept is the first of: prompt and response token ids, any token ids, the LLM
proxy's span, a response id, the earliest in the input order. The others are counted as dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from eventlight.adapter.attrs import PROMPT_ID_KEYS, RESPONSE_ID_KEYS, RESPONSE_TOKEN_KEYS
from eventlight.core.types import Span

__all__ = ["copy_of", "has_token_ids", "keep_one_copy", "output_fingerprint", "response_id"]

PROXY_SERVICE = "eventlight.llm_proxy"
_ID_KEYS = (*RESPONSE_ID_KEYS, "llm.hosted_vllm.id")
_PROMPT_COUNT_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt")
_COMPLETION_COUNT_KEYS = (
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.completion_tokens",
    "llm.token_count.completion",
)

Fingerprint = tuple[str, tuple[str, ...]]


def _json_id(value: Any) -> str | None:
    """The response id inside OpenInference's JSON ``output.value`` of an LLM span, if any."""
    if not isinstance(value, str) or not value.startswith("{"):
        return None
    try:
        data = json.loads(value)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("id"), str) and "choices" in data:  # the OpenAI chat completion
        return str(data["id"])
    llm_output = data.get("llm_output")  # LangChain's LLMResult
    if isinstance(llm_output, dict) and isinstance(llm_output.get("id"), str):
        return str(llm_output["id"])
    return None


def response_id(attrs: Mapping[str, Any]) -> str | None:
    """The id the backend gave the response this span records, or ``None``."""
    for key in _ID_KEYS:
        value = attrs.get(key)
        if isinstance(value, str) and value:
            return value
    if attrs.get("openinference.span.kind") == "LLM":
        return _json_id(attrs.get("output.value"))
    return None


def has_token_ids(attrs: Mapping[str, Any]) -> tuple[bool, bool]:
    """Whether the span carries (prompt, response) token ids as non-empty lists."""

    def present(keys: Sequence[str]) -> bool:
        return any(isinstance(attrs.get(k), (list, tuple)) and len(attrs[k]) > 0 for k in keys)

    return present(PROMPT_ID_KEYS), present(RESPONSE_TOKEN_KEYS)


def _indexed(attrs: Mapping[str, Any], prefix: str, suffixes: Sequence[str]) -> tuple[str, ...]:
    """``attrs[prefix.{j}.suffix]`` for j = 0, 1, … (the first suffix present at each j)."""
    out: list[str] = []
    for j in range(64):
        value = next((attrs.get(f"{prefix}.{j}.{s}") for s in suffixes if attrs.get(f"{prefix}.{j}.{s}")), None)
        if value is None:
            break
        out.append(str(value))
    return tuple(out)


def _from_output_messages(raw: Any) -> Fingerprint | None:
    try:
        messages = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    first = messages[0] if isinstance(messages, list) and messages else None
    parts = first.get("parts") if isinstance(first, dict) else None
    if not isinstance(parts, list):
        return None
    text = "".join(str(p.get("content", "")) for p in parts if isinstance(p, dict) and p.get("type") == "text")
    calls = tuple(
        str(p.get("id") or p.get("name")) for p in parts if isinstance(p, dict) and p.get("type") == "tool_call"
    )
    return text.strip(), calls


def output_fingerprint(attrs: Mapping[str, Any]) -> Fingerprint | None:
    """(assistant text, tool-call ids or names) of the first choice, or ``None`` when neither is there."""
    found: Fingerprint | None = None
    if "gen_ai.completion.0.content" in attrs or "gen_ai.completion.0.tool_calls.0.id" in attrs:
        text = attrs.get("gen_ai.completion.0.content")
        found = str(text or "").strip(), _indexed(attrs, "gen_ai.completion.0.tool_calls", ("id", "name"))
    elif "gen_ai.output.messages" in attrs:
        found = _from_output_messages(attrs["gen_ai.output.messages"])
    elif any(k.startswith("llm.output_messages.0.") for k in attrs):
        prefix = "llm.output_messages.0.message"
        parts = _indexed(attrs, f"{prefix}.contents", ("message_content.text",))
        text = attrs.get(f"{prefix}.content") or "".join(parts)
        found = str(text).strip(), _indexed(attrs, f"{prefix}.tool_calls", ("tool_call.id", "tool_call.function.name"))
    return found if found and (found[0] or found[1]) else None


def _counts(attrs: Mapping[str, Any]) -> tuple[int | None, int | None]:
    def first(keys: Sequence[str]) -> int | None:
        return next((v for k in keys if isinstance(v := attrs.get(k), int) and not isinstance(v, bool)), None)

    return first(_PROMPT_COUNT_KEYS), first(_COMPLETION_COUNT_KEYS)


def _compatible(a: tuple[int | None, int | None], b: tuple[int | None, int | None]) -> bool:
    return all(x is None or y is None or x == y for x, y in zip(a, b, strict=True))


class _Call:
    """The copies of one LLM call found so far (indices into the input); what they produced is
    read only when a copy without response id needs it."""

    def __init__(self, index: int, span: Span):
        self.members = [index]
        self.spans = [span]
        self._fingerprint: Fingerprint | None = None
        self._counts: tuple[int | None, int | None] | None = None

    def add(self, index: int, span: Span) -> None:
        self.members.append(index)
        self.spans.append(span)
        self._fingerprint = self._counts = None

    def fingerprint(self) -> Fingerprint | None:
        if self._fingerprint is None:
            self._fingerprint = next(
                (f for s in self.spans if (f := output_fingerprint(s.attributes or {})) is not None), None
            )
        return self._fingerprint

    def counts(self) -> tuple[int | None, int | None]:
        if self._counts is None:
            found = [_counts(s.attributes or {}) for s in self.spans]
            self._counts = (
                next((p for p, _ in found if p is not None), None),
                next((c for _, c in found if c is not None), None),
            )
        return self._counts

    def accepts(self, span: Span, fingerprint: Fingerprint) -> bool:
        return (
            all(s.name != span.name for s in self.spans)
            and self.fingerprint() == fingerprint
            and _compatible(self.counts(), _counts(span.attributes or {}))
        )


def _rank(index: int, span: Span) -> tuple[bool, bool, bool, bool, int]:
    attrs = span.attributes or {}
    prompt_ids, response_ids = has_token_ids(attrs)
    service = (span.resource.attributes or {}).get("service.name") if span.resource is not None else None
    from_proxy = service == PROXY_SERVICE
    return prompt_ids and response_ids, prompt_ids or response_ids, from_proxy, bool(response_id(attrs)), -index


def copy_of(spans: Sequence[Span]) -> list[int]:
    """Group the LLM-call spans ``spans`` by call (module docstring).

    Args:
        spans: Spans that each record one LLM call, in the adapter's order.

    Returns:
        For each span, the index of the copy of its call that is kept (its own index if kept).
    """
    rids = [response_id(span.attributes or {}) for span in spans]
    if None not in rids and len(set(rids)) == len(rids):
        return list(range(len(spans)))  # the common case: one copy of each call
    calls: list[_Call] = []
    by_id: dict[str, _Call] = {}
    later: list[int] = []
    for i, (span, rid) in enumerate(zip(spans, rids, strict=True)):
        if rid is None:
            later.append(i)
        elif rid in by_id:
            by_id[rid].add(i, span)
        else:
            by_id[rid] = _Call(i, span)
            calls.append(by_id[rid])
    for i in later:
        span = spans[i]
        fingerprint = output_fingerprint(span.attributes or {})
        match = next((c for c in calls if fingerprint and c.accepts(span, fingerprint)), None)
        if match is None:
            calls.append(_Call(i, span))
        else:
            match.add(i, span)
    kept = list(range(len(spans)))
    for call in calls:
        if len(call.members) == 1:
            continue
        best = max(call.members, key=lambda i: _rank(i, spans[i]))
        for i in call.members:
            kept[i] = best
    return kept


def keep_one_copy(spans: Sequence[Span]) -> tuple[list[int], dict[int, int]]:
    """Keep one copy of each LLM call in ``spans`` (``copy_of``).

    Returns:
        The indices of the kept spans in input order, and for each kept index that dropped
        copies of its call how many.
    """
    kept = copy_of(spans)
    dropped: dict[int, int] = {}
    for i, k in enumerate(kept):
        if i != k:
            dropped[k] = dropped.get(k, 0) + 1
    return sorted(set(kept)), dropped
