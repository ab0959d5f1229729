"""Anthropic's Messages API (``POST /v1/messages``) on the proxy: LiteLLM translates, the call is the same.

A Messages request is translated to an OpenAI chat completion by LiteLLM's own adapter
(``LiteLLMAnthropicMessagesAdapter.translate_anthropic_to_openai``: ``system`` becomes a system
message, ``tool_use`` / ``tool_result`` blocks become tool calls and tool messages, ``tools`` become
functions), forwarded and recorded exactly like a chat completion (one ``openai.chat.completion``
span with token ids, marked ``eventlight.llm_proxy.route = "anthropic.messages"``), and the answer
is translated back by the same adapter (``translate_openai_response_to_anthropic``). A client asking
for ``stream: true`` gets Anthropic's event stream built from the complete answer, as the chat
route does (``message_start``, one ``content_block_*`` triple per text or ``tool_use`` block,
``message_delta`` with ``stop_reason`` and usage, ``message_stop``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from litellm import ModelResponse
from litellm.llms.anthropic.messages.adapters.transformation import LiteLLMAnthropicMessagesAdapter

from eventlight.llm_proxy.upstream import CallError

ROUTE = "anthropic.messages"
_TEXT_PIECE = 28
_JSON_PIECE = 40


def to_openai(body: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]] | CallError:
    """An Anthropic Messages request as an OpenAI chat request, and LiteLLM's tool-name mapping.

    Returns:
        ``(chat_request, tool_name_mapping)``, or a 400 ``CallError`` naming what is wrong
        (``max_tokens`` missing or not a positive int, a message LiteLLM cannot translate).
    """
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return CallError(400, "invalid_request_error", f"max_tokens must be a positive int, got {max_tokens!r}")
    try:
        request, tool_names = LiteLLMAnthropicMessagesAdapter().translate_anthropic_to_openai(dict(body))  # type: ignore[arg-type]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return CallError(400, "invalid_request_error", f"cannot translate the Messages request: {exc}")
    chat = dict(request)
    chat.pop("stream", None)
    return chat, dict(tool_names or {})


def to_anthropic(completion: Mapping[str, Any], tool_names: Mapping[str, str]) -> dict[str, Any]:
    """The chat completion the backend gave, as an Anthropic ``message`` object."""
    response = ModelResponse(**dict(completion))
    message = LiteLLMAnthropicMessagesAdapter().translate_openai_response_to_anthropic(
        response=response, tool_name_mapping=dict(tool_names) or None
    )
    return json.loads(json.dumps(message, default=str))  # type: ignore[no-any-return]


def _pieces(text: str, size: int) -> Iterator[str]:
    for start in range(0, len(text), size):
        yield text[start : start + size]


def message_to_sse(message: Mapping[str, Any]) -> Iterator[bytes]:
    """Anthropic's server-sent events for a complete ``message`` (what its SDK's stream reads)."""

    def event(name: str, data: Mapping[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    usage = dict(message.get("usage") or {})
    head = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    head["usage"] = {**usage, "output_tokens": 0}
    yield event("message_start", {"type": "message_start", "message": head})
    for index, block in enumerate(message.get("content") or []):
        start: dict[str, Any]
        deltas: list[dict[str, Any]]
        if block.get("type") == "tool_use":
            start = {"type": "tool_use", "id": block.get("id"), "name": block.get("name"), "input": {}}
            deltas = [
                {"type": "input_json_delta", "partial_json": p}
                for p in _pieces(json.dumps(block.get("input") or {}), _JSON_PIECE)
            ]
        elif block.get("type") == "thinking":
            start = {"type": "thinking", "thinking": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": p} for p in _pieces(block.get("thinking") or "", _TEXT_PIECE)
            ]
        else:
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in _pieces(block.get("text") or "", _TEXT_PIECE)]
        yield event("content_block_start", {"type": "content_block_start", "index": index, "content_block": start})
        for delta in deltas:
            yield event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield event("content_block_stop", {"type": "content_block_stop", "index": index})
    end = {"stop_reason": message.get("stop_reason"), "stop_sequence": message.get("stop_sequence")}
    yield event("message_delta", {"type": "message_delta", "delta": end, "usage": usage})
    yield event("message_stop", {"type": "message_stop"})
