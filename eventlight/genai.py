"""Chat messages in the current OpenTelemetry GenAI conventions, and back.

The GenAI semantic conventions (v1.37 and later) record a call's messages as JSON attributes:
``gen_ai.input.messages`` (the chat history the model saw), ``gen_ai.output.messages`` (its
choices) and ``gen_ai.system_instructions`` (system text), each message ``{"role", "parts": [...]}``
with parts ``{"type": "text", "content"}``, ``{"type": "tool_call", "id", "name", "arguments"}``,
``{"type": "tool_call_response", "id", "response"}``, ``{"type": "reasoning", "content"}`` and
``{"type": "uri", "modality", "uri"}``; an output message also has its ``finish_reason``. Schemas:
``docs/gen-ai/gen-ai-{input,output}-messages.json`` of open-telemetry/semantic-conventions.

Agent-lightning 0.3 reads the older flat ``gen_ai.prompt.{i}.*`` / ``gen_ai.completion.{i}.*``
attributes; the LLM proxy writes both, and the adapters read either (``openai_messages``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"


def _parts(content: Any) -> list[dict[str, Any]]:
    """OpenAI message ``content`` (a string, or a list of ``text``/``image_url`` parts) as GenAI parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    parts: list[dict[str, Any]] = []
    for item in content if isinstance(content, list) else [content]:
        if isinstance(item, Mapping) and item.get("type") == "text":
            parts.append({"type": "text", "content": str(item.get("text", ""))})
        elif isinstance(item, Mapping) and item.get("type") == "image_url":
            image = item.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            parts.append({"type": "uri", "modality": "image", "uri": str(url)})
        else:
            parts.append({"type": "text", "content": item if isinstance(item, str) else json.dumps(item, default=str)})
    return parts


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as the JSON value they encode (OpenAI sends a string), else as given."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _tool_call_parts(tool_calls: Any) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for call in tool_calls if isinstance(tool_calls, list) else []:
        if not isinstance(call, Mapping):
            continue
        raw = call.get("function")
        function: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        parts.append(
            {
                "type": "tool_call",
                "id": call.get("id"),
                "name": function.get("name"),
                "arguments": _arguments(function.get("arguments")),
            }
        )
    return parts


def genai_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI chat message as a GenAI ``ChatMessage``."""
    role = str(message.get("role") or "user")
    if role == "tool":
        return {
            "role": "tool",
            "parts": [
                {"type": "tool_call_response", "id": message.get("tool_call_id"), "response": message.get("content")}
            ],
        }
    parts: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        parts.append({"type": "reasoning", "content": reasoning})
    parts += _parts(message.get("content"))
    parts += _tool_call_parts(message.get("tool_calls"))
    out: dict[str, Any] = {"role": role, "parts": parts}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def genai_attributes(messages: Sequence[Any], choices: Sequence[Any] | None) -> dict[str, str]:
    """``gen_ai.input.messages``, ``gen_ai.system_instructions`` (when there is system text) and,
    given the response's ``choices``, ``gen_ai.output.messages``: JSON strings.

    The input keeps every message in order, system ones included (the model saw them there);
    ``gen_ai.system_instructions`` repeats the system and developer text for tools that read it
    from there.
    """
    inputs = [genai_message(m) for m in messages if isinstance(m, Mapping)]
    attrs = {INPUT_MESSAGES: json.dumps(inputs, ensure_ascii=False, default=str)}
    system = [p for m in inputs if m["role"] in ("system", "developer") for p in m["parts"]]
    if system:
        attrs[SYSTEM_INSTRUCTIONS] = json.dumps(system, ensure_ascii=False, default=str)
    if choices is not None:
        outputs = []
        for choice in choices:
            if not isinstance(choice, Mapping):
                continue
            raw = choice.get("message")
            message: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
            out = genai_message({"role": "assistant", **message})
            out["finish_reason"] = str(choice.get("finish_reason") or "")
            outputs.append(out)
        attrs[OUTPUT_MESSAGES] = json.dumps(outputs, ensure_ascii=False, default=str)
    return attrs


def _openai_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A GenAI ``ChatMessage`` as an OpenAI-style message (``role``, ``content``, ``tool_calls``...)."""
    out: dict[str, Any] = {"role": message.get("role")}
    texts: list[str] = []
    content: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    for part in message.get("parts") or []:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("content", "")))
            content.append({"type": "text", "text": str(part.get("content", ""))})
        elif kind == "uri" and part.get("modality") == "image":
            content.append({"type": "image_url", "image_url": {"url": part.get("uri")}})
        elif kind == "reasoning":
            out["reasoning_content"] = part.get("content")
        elif kind == "tool_call":
            args = part.get("arguments")
            tool_calls.append(
                {
                    "id": part.get("id"),
                    "type": "function",
                    "name": part.get("name"),
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                }
            )
        elif kind == "tool_call_response":
            out["tool_call_id"] = part.get("id")
            response = part.get("response")
            texts.append(response if isinstance(response, str) else json.dumps(response, default=str))
    images = any(c["type"] == "image_url" for c in content)
    out["content"] = content if images else ("".join(texts) if texts else None)
    if tool_calls:
        out["tool_calls"] = tool_calls
    if "finish_reason" in message:
        out["finish_reason"] = message["finish_reason"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def openai_messages(attributes: Mapping[str, Any], key: str) -> list[dict[str, Any]] | None:
    """The messages under ``gen_ai.input.messages`` or ``gen_ai.output.messages`` (``key``) as
    OpenAI-style dicts (tool calls flattened as the ``gen_ai.prompt.{i}.tool_calls.{j}.*``
    attributes unflatten: ``id``, ``type``, ``name``, ``arguments``), or ``None`` when the attribute
    is absent or not the JSON the conventions describe."""
    raw = attributes.get(key)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, list):
        return None
    return [_openai_message(m) for m in raw if isinstance(m, Mapping)]
