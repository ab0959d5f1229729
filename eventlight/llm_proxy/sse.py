"""A synthetic SSE stream built from a complete chat completion (Agent-lightning's
``StreamConversionMiddleware``): a client asking for ``stream: true`` gets chunks, token ids are kept."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from eventlight.llm_proxy.token_ids import choice_token_ids, prompt_token_ids

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

_CONTENT_PIECE = 28
_ARGUMENTS_PIECE = 40


def _pieces(text: str, size: int, *, at_spaces: bool) -> Iterator[str]:
    """Split ``text`` into pieces of at most ``size`` characters (broken after a space when possible)."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if at_spaces and end < len(text):
            cut = text.rfind(" ", start, end)
            if cut > start:
                end = cut + 1
        yield text[start:end]
        start = end


def chat_completion_to_sse(completion: Mapping[str, Any], *, include_usage: bool = False) -> Iterator[bytes]:
    """Render a complete chat completion as an OpenAI server-sent-event stream.

    Per choice: a role chunk, reasoning and content in ~28-character pieces broken at spaces, each
    tool call announced (id, type, name) and then its arguments in 40-character pieces, and a
    final chunk with ``finish_reason`` (default ``tool_calls`` if there are tool calls, else
    ``stop``) that also carries the choice's ``token_ids`` when known (vLLM's stream shape; the
    first chunk carries ``prompt_token_ids``). A usage chunk follows when ``include_usage``, then
    ``data: [DONE]``.

    Args:
        completion: The non-streaming completion as a JSON dict.
        include_usage: Emit the usage chunk (``stream_options.include_usage``).

    Yields:
        Encoded ``data: ...\\n\\n`` events.
    """
    base: dict[str, Any] = {
        "id": completion.get("id") or f"chatcmpl-{int(time.time())}",
        "object": "chat.completion.chunk",
        "created": completion.get("created") or int(time.time()),
        "model": completion.get("model") or "",
    }
    if completion.get("system_fingerprint"):
        base["system_fingerprint"] = completion["system_fingerprint"]
    prompt_ids = prompt_token_ids(completion)

    def event(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        chunk = dict(base, choices=[choice] if choice is not None else [], **extra)
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    first = True
    for n, choice in enumerate(completion.get("choices") or []):
        index = choice.get("index", n)
        message = choice.get("message") or {}

        def delta(d: dict[str, Any], *, index: int = index) -> dict[str, Any]:
            return {"index": index, "delta": d, "logprobs": None, "finish_reason": None}

        if first and prompt_ids is not None:
            yield event(delta({"role": "assistant", "content": ""}), prompt_token_ids=prompt_ids)
        else:
            yield event(delta({"role": "assistant", "content": ""}))
        first = False
        for piece in _pieces(message.get("reasoning_content") or "", _CONTENT_PIECE, at_spaces=True):
            yield event(delta({"reasoning_content": piece}))
        for piece in _pieces(message.get("content") or "", _CONTENT_PIECE, at_spaces=True):
            yield event(delta({"content": piece}))
        tool_calls = message.get("tool_calls") or []
        for j, call in enumerate(tool_calls):
            function = call.get("function") or {}
            head = {
                "index": j,
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {"name": function.get("name"), "arguments": ""},
            }
            yield event(delta({"tool_calls": [head]}))
            for piece in _pieces(function.get("arguments") or "", _ARGUMENTS_PIECE, at_spaces=False):
                yield event(delta({"tool_calls": [{"index": j, "function": {"arguments": piece}}]}))
        last: dict[str, Any] = {
            "index": index,
            "delta": {},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason") or ("tool_calls" if tool_calls else "stop"),
        }
        ids = choice_token_ids(choice)
        if ids is not None:
            last["token_ids"] = ids
        yield event(last)
    if include_usage and completion.get("usage") is not None:
        yield event(None, usage=completion["usage"])
    yield b"data: [DONE]\n\n"


async def aiter_chunks(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
