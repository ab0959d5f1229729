"""Span attributes of a proxied chat completion: the OpenTelemetry GenAI conventions twice, as the
current JSON attributes (``gen_ai.input.messages``, ``gen_ai.output.messages``,
``gen_ai.system_instructions``, ``gen_ai.provider.name``, ``gen_ai.usage.input_tokens``; see
``eventlight.genai``) and flattened as Agent-lightning 0.3's tracer writes them
(``gen_ai.prompt.{i}.*``, ``gen_ai.completion.{i}.*``), plus token ids when the backend returns them."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from eventlight.core.types import Event, OtelResource, Span, TraceStatus
from eventlight.genai import genai_attributes
from eventlight.llm_proxy.token_ids import token_id_marks, token_ids
from eventlight.store.validate import MAX_PAYLOAD_BYTES

log = logging.getLogger(__name__)

SPAN_NAME = "openai.chat.completion"
ROUTE_ATTRIBUTE = "eventlight.llm_proxy.route"
"""The client API of a call made through a route other than chat completions (``anthropic.messages``)."""
OMITTED_ATTRIBUTE = "eventlight.llm_proxy.omitted_attributes"
"""The attributes left off a span that would not fit one event (the largest texts first), sorted."""
_SPAN_BUDGET_BYTES = MAX_PAYLOAD_BYTES - 256 * 1024  # the rest of the span and the event's envelope
_json = msgspec.json.Encoder()


def _attr_value(value: Any) -> Any:
    """An OpenTelemetry-legal attribute value: a primitive, a list of one primitive type, or JSON text."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and next(iter(kinds)) in (str, bool, int, float):
            return list(value)
    return json.dumps(value, default=str, ensure_ascii=False)


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else an empty one (fields of a response may be missing or null)."""
    return value if isinstance(value, Mapping) else {}


def _put(attrs: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        attrs[key] = _attr_value(value)


def _put_tool_calls(attrs: dict[str, Any], prefix: str, tool_calls: Any) -> None:
    if not isinstance(tool_calls, list):
        return
    for j, call in enumerate(tool_calls):
        if not isinstance(call, Mapping):
            continue
        function = _mapping(call.get("function"))
        _put(attrs, f"{prefix}.tool_calls.{j}.id", call.get("id"))
        _put(attrs, f"{prefix}.tool_calls.{j}.type", call.get("type") or "function")
        _put(attrs, f"{prefix}.tool_calls.{j}.name", function.get("name"))
        _put(attrs, f"{prefix}.tool_calls.{j}.arguments", function.get("arguments"))


def build_chat_span_attributes(
    request: Mapping[str, Any],
    response: Mapping[str, Any] | None = None,
    *,
    system: str | None = None,
    streaming: bool = False,
    error: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Flatten one chat-completion call into OpenTelemetry GenAI span attributes.

    Args:
        request: The client's JSON body (``model``, ``messages``, sampling parameters, ``tools``).
        response: The completion as a JSON dict, ``None`` when the call failed.
        system: ``gen_ai.system`` (the LiteLLM provider, e.g. ``"openai"`` or ``"hosted_vllm"``).
        streaming: Whether the client asked for a stream (recorded as ``llm.is_streaming``).
        error: ``{"type", "status_code", "message"}`` of a failed call.

    Returns:
        Flat attributes whose values are str/int/float/bool or lists of one of them; they
        unflatten without conflicts (``eventlight.attributes.unflatten_attributes``).
    """
    attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "llm.request.type": "chat"}
    _put(attrs, "gen_ai.system", system)
    _put(attrs, "gen_ai.provider.name", system)
    _put(attrs, "gen_ai.request.model", request.get("model"))
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "n"):
        _put(attrs, f"gen_ai.request.{key}", request.get(key))
    max_tokens = request.get("max_tokens", request.get("max_completion_tokens"))
    _put(attrs, "gen_ai.request.max_tokens", max_tokens)
    stop = request.get("stop")
    _put(attrs, "gen_ai.request.stop", [stop] if isinstance(stop, str) else stop)
    attrs["llm.is_streaming"] = bool(streaming)

    for i, tool in enumerate(request.get("tools") or []):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping):
            _put(attrs, f"gen_ai.request.functions.{i}.name", function.get("name"))
            _put(attrs, f"gen_ai.request.functions.{i}.description", function.get("description"))
            _put(attrs, f"gen_ai.request.functions.{i}.parameters", function.get("parameters"))

    for i, message in enumerate(request.get("messages") or []):
        if not isinstance(message, Mapping):
            _put(attrs, f"gen_ai.prompt.{i}.content", message)
            continue
        _put(attrs, f"gen_ai.prompt.{i}.role", message.get("role"))
        _put(attrs, f"gen_ai.prompt.{i}.content", message.get("content"))
        _put(attrs, f"gen_ai.prompt.{i}.name", message.get("name"))
        _put(attrs, f"gen_ai.prompt.{i}.tool_call_id", message.get("tool_call_id"))
        _put_tool_calls(attrs, f"gen_ai.prompt.{i}", message.get("tool_calls"))

    messages = request.get("messages")
    choices = response.get("choices") if response is not None else None
    attrs.update(
        genai_attributes(messages if isinstance(messages, list) else [], choices if isinstance(choices, list) else None)
    )

    if response is not None:
        _put(attrs, "gen_ai.response.id", response.get("id"))
        _put(attrs, "gen_ai.response.model", response.get("model"))
        finish_reasons: list[str] = []
        for choice in response.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            i = choice.get("index", len(finish_reasons))
            message = _mapping(choice.get("message"))
            prefix = f"gen_ai.completion.{i}"
            _put(attrs, f"{prefix}.role", message.get("role") or "assistant")
            _put(attrs, f"{prefix}.content", message.get("content"))
            _put(attrs, f"{prefix}.reasoning_content", message.get("reasoning_content"))
            _put(attrs, f"{prefix}.finish_reason", choice.get("finish_reason"))
            _put_tool_calls(attrs, prefix, message.get("tool_calls"))
            if choice.get("finish_reason"):
                finish_reasons.append(str(choice["finish_reason"]))
            logprobs = choice.get("logprobs")
            if i == 0 and isinstance(logprobs, Mapping) and logprobs.get("content") is not None:
                attrs["logprobs.content"] = json.dumps(logprobs["content"], default=str)
        if finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = finish_reasons
        usage = _mapping(response.get("usage"))
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                attrs[f"gen_ai.usage.{key}"] = value
        for old_key, key in (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens")):
            if f"gen_ai.usage.{old_key}" in attrs:  # the current names of the same counts
                attrs[f"gen_ai.usage.{key}"] = attrs[f"gen_ai.usage.{old_key}"]

        prompt_ids, per_choice = token_ids(response)
        if prompt_ids is not None:
            attrs["prompt_token_ids"] = prompt_ids
        if per_choice:
            attrs["response_token_ids"] = per_choice[0]
        if error is None:
            attrs.update(token_id_marks(response, prompt_ids, per_choice))

    if error is not None:
        _put(attrs, "error.type", error.get("type"))
        _put(attrs, "http.status_code", error.get("status_code"))
        _put(attrs, "error.message", error.get("message"))
    else:
        attrs["http.status_code"] = 200
    return attrs


def fit_attributes(attributes: dict[str, Any], budget: int = _SPAN_BUDGET_BYTES) -> None:
    """Leave attributes off, in place, until they fit ``budget`` bytes of JSON (what one event holds).

    A prompt with large images or documents (held twice: flattened and as ``gen_ai.input.messages``)
    makes a span the store refuses, and the call would leave no span at all. The largest texts go
    first, then the largest lists; the names of those left off are in ``OMITTED_ATTRIBUTE``.
    """
    # JSON spends at most 6 bytes on a character (an escaped control character), rarely 24 on a list item
    rough = sum(len(k) + (len(v) if isinstance(v, (str, list)) else 2) for k, v in attributes.items())
    if 24 * rough < budget:
        return
    sizes = {key: len(key) + len(_json.encode(value)) + 4 for key, value in attributes.items()}
    total = sum(sizes.values())
    omitted = []
    for key in sorted(sizes, key=lambda k: (not isinstance(attributes[k], str), -sizes[k])):
        if total <= budget:
            break
        total -= sizes[key]
        del attributes[key]
        omitted.append(key)
    if omitted:
        attributes[OMITTED_ATTRIBUTE] = sorted(omitted)


def make_span(
    body: dict[str, Any],
    completion: dict[str, Any] | None,
    error: dict[str, Any] | None,
    *,
    system: str | None,
    streaming: bool,
    rollout_id: str,
    attempt_id: str,
    sequence_id: int,
    start_time: float,
    route: str | None = None,
) -> Span:
    """The one span of a proxied call (``completion`` or ``error`` set), named ``SPAN_NAME``.

    ``route`` names the client's API when it is not OpenAI's chat completions (``"anthropic.messages"``:
    the request and answer on the span are the OpenAI-shaped ones LiteLLM translated them to).
    """
    attributes = build_chat_span_attributes(body, completion, system=system, streaming=streaming, error=error)
    if route is not None:
        attributes[ROUTE_ATTRIBUTE] = route
    fit_attributes(attributes)
    status = TraceStatus(status_code="ERROR", description=error["message"]) if error else TraceStatus(status_code="OK")
    span = Span.from_attributes(
        attributes=attributes,
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        name=SPAN_NAME,
        trace_id=uuid.uuid4().hex,
        span_id=uuid.uuid4().hex[:16],
        start_time=start_time,
        end_time=time.time(),
        status=status,
        resource=OtelResource(
            attributes={
                "service.name": "eventlight.llm_proxy",
                "agentlightning.rollout_id": rollout_id,
                "agentlightning.attempt_id": attempt_id,
                "agentlightning.span_sequence_id": sequence_id,
            }
        ),
    )
    if error:
        span.events.append(
            Event(
                name="exception",
                attributes={
                    "exception.type": str(error["type"]),
                    "exception.message": str(error["message"]),
                },
                timestamp=span.end_time,
            )
        )
    return span
