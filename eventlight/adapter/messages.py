"""``TraceToMessages``: one OpenAI fine-tuning JSONL record per LLM call."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from eventlight.adapter.attrs import Heads
from eventlight.adapter.base import TraceAdapter
from eventlight.adapter.dedup import keep_one_copy
from eventlight.adapter.stats import AdapterStats, CountingAdapter, is_error
from eventlight.attributes import unflatten_attributes
from eventlight.core.types import Span
from eventlight.genai import INPUT_MESSAGES, OUTPUT_MESSAGES, openai_messages

log = logging.getLogger(__name__)

# OpenAI chat messages


class OpenAIMessages(TypedDict):
    """One LLM call as an OpenAI fine-tuning JSONL record.

    Attributes:
        messages: Chat messages (``{"role", "content", ...}``), prompt then completion.
        tools: Function tool definitions offered to the model, or ``None``.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


_GENAI_HEADS = Heads("gen_ai.prompt", "gen_ai.completion", "gen_ai.request", "gen_ai.response")
_TOOL_HEADS = Heads("tool")


def _grouped(below: dict[str, Any] | None) -> Any:
    """Unflatten the attributes ``Heads.below`` sorted out under one head; ``None`` when there are none.

    Index levels become lists even when indices have gaps (sorted), as Agent-lightning's
    ``group_genai_dict`` does for ``gen_ai.prompt.{i}``.
    """
    return _gaps_to_list(unflatten_attributes(below)) if below else None


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


def _children(spans: Sequence[Span]) -> dict[str | None, list[Span]]:
    """Spans by ``parent_id``, in input order."""
    out: dict[str | None, list[Span]] = {}
    for span in spans:
        out.setdefault(span.parent_id, []).append(span)
    return out


def _tool_calls(span: Span, children: Mapping[str | None, list[Span]]) -> list[dict[str, Any]]:
    """Tool calls recorded as direct children of ``span`` with ``tool.*`` attributes."""
    calls: list[dict[str, Any]] = []
    for child in children.get(span.span_id, ()):
        tool = _grouped(_TOOL_HEADS.below(child.attributes or {}).get("tool"))
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


class TraceToMessages(CountingAdapter, TraceAdapter[list[OpenAIMessages]]):
    """OpenAI chat records from ``gen_ai.*`` span attributes (Agent-lightning ``TraceToMessages``).

    Every span with any ``gen_ai.prompt.*``, ``gen_ai.completion.*``, ``gen_ai.request.*`` or
    ``gen_ai.response.*`` attribute gives one record; when several instrumentation layers recorded
    the same call (the same response id, or the same output: ``eventlight.adapter.dedup``), only
    the copy with token ids (the LLM proxy's) gives one, and ``stats.duplicates``
    counts the others. Prompt messages come from ``gen_ai.prompt.{i}.*`` (or, without
    it, from the current conventions' ``gen_ai.input.messages`` / ``gen_ai.output.messages``); each
    ``gen_ai.completion.{i}`` with role ``assistant`` is appended, carrying as ``tool_calls`` the
    direct child spans with ``tool.*`` attributes (``tool.call.id``, ``tool.call.type``,
    ``tool.name``, ``tool.parameters``); ``tools`` come from ``gen_ai.request.functions.{i}``.
    The output matches the OpenAI fine-tuning JSONL schema. APO shows these records to its critic.
    Spans with status ``ERROR`` give no record; ``stats`` / ``last_stats`` count them (``errors``).
    """

    def adapt(self, source: Sequence[Span], /) -> list[OpenAIMessages]:
        """Convert spans into records.

        Raises:
            ValueError: A span's prompt/completion is not a list, or its request/response not a dict.
        """
        children = _children(source)
        found = [(span, record) for span in source if (record := self._record(span, children)) is not None]
        kept, _ = keep_one_copy([span for span, _ in found])  # one record per call: the copy with token ids
        stats, records = AdapterStats(llm_calls=len(found), duplicates=len(found) - len(kept)), []
        for span, record in (found[i] for i in kept):
            if is_error(span):  # a failed call (an upstream 400): a prompt with no answer to learn from
                stats.errors += 1
                continue
            records.append(record)
        stats.triplets = len(records)
        self._counted(stats)
        return records

    def _record(self, span: Span, children: Mapping[str | None, list[Span]]) -> OpenAIMessages | None:
        attrs = span.attributes or {}
        below = _GENAI_HEADS.below(attrs)
        prompt, completion = _grouped(below.get("gen_ai.prompt")), _grouped(below.get("gen_ai.completion"))
        if prompt is None and completion is None:  # the current GenAI conventions
            prompt, completion = openai_messages(attrs, INPUT_MESSAGES), openai_messages(attrs, OUTPUT_MESSAGES)
        request, response = _grouped(below.get("gen_ai.request")), _grouped(below.get("gen_ai.response"))
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
        tool_calls = _tool_calls(span, children)
        for comp in completion or []:
            if isinstance(comp, dict) and comp.get("role") == "assistant":
                message: dict[str, Any] = {"role": "assistant", "content": comp.get("content")}
                if tool_calls:
                    message["tool_calls"] = tool_calls
                messages.append(message)
        return OpenAIMessages(messages=messages, tools=_tools(request or {}))
