"""A scripted OpenAI-compatible chat-completions server for tests (no model, no network).

It answers ``POST /v1/chat/completions`` (and ``/chat/completions``) the way vLLM does with
``return_token_ids``: the body carries a top-level ``prompt_token_ids`` and a per-choice
``token_ids``, and ``usage`` counts them. Token ids come from a toy word tokenizer (``toy_tokenize``),
so equal text gives equal ids. Usage::

    stub = ScriptedLLM(responses=lambda messages, request: Reply(content="4"))
    async with stub as url:            # url == "http://127.0.0.1:<port>/v1"
        ...                            # point a client or the LLM proxy at ``url``
    assert stub.requests[0]["messages"][-1]["content"] == "2+2?"

``responses`` may be:

* ``None`` — echo: the content is ``"echo: <last user message>"``;
* a ``str`` / ``Reply`` / ``dict`` — the same answer to every request;
* a list of those — answered in order; the last one repeats once the list is used up;
* a callable ``f(messages, request)`` (sync or async) returning one of those, where ``messages`` is
  the request's message list and ``request`` the whole JSON body.

A ``dict`` is sent verbatim as the JSON body (status 200). A ``Reply`` with ``status >= 400`` is
sent as an OpenAI-style error ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eventlight.net import tcp_listener

__all__ = ["TOKEN_ID_PLACEMENTS", "Reply", "ScriptedLLM", "ToolCall", "toy_tokenize"]


def toy_tokenize(text: str) -> list[int]:
    """Deterministic word-level token ids in ``[1000, 51000)`` (one id per whitespace-separated piece)."""
    return [1000 + zlib.crc32(piece.encode()) % 50000 for piece in text.split()]


def _prompt_text(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, sort_keys=True)
        parts.append(f"<{m.get('role', 'user')}> {content}")
    return " ".join(parts) + " <assistant>"


@dataclass
class ToolCall:
    """One function call the scripted assistant makes (``arguments`` is a JSON string or a dict)."""

    name: str
    arguments: str | dict[str, Any] = "{}"
    id: str | None = None


@dataclass
class Reply:
    """One scripted answer.

    Attributes:
        content: Assistant text (``None`` for a pure tool call).
        tool_calls: Function calls; they make ``finish_reason`` default to ``"tool_calls"``.
        finish_reason: Overrides the finish reason (default ``"stop"``).
        status: HTTP status; ``>= 400`` sends an error body with ``error_message`` instead.
        error_message: The error's message.
        error_type: The error's ``type`` (default ``"BadRequestError"``).
        token_ids: Completion token ids to report (default: ``toy_tokenize`` of the text).
        prompt_token_ids: Prompt token ids to report (default: ``toy_tokenize`` of the messages).
        completion_tokens: ``usage.completion_tokens`` (default ``len(token_ids)``); set it
            differently to simulate truncated ids (C14).
        return_token_ids: ``False`` omits both id lists, as a non-vLLM backend does.
        placement: Where the ids go (``TOKEN_ID_PLACEMENTS``): ``"vllm"`` (vLLM >= 0.10.2: top-level
            ``prompt_token_ids``, ``choices[i].token_ids``), ``"choice"`` (both on the choice, the
            completions-API shape), ``"provider_fields"`` (``provider_specific_fields`` of the
            response and of the choice), ``"message"`` (top-level prompt ids, completion ids in
            ``choices[i].message.provider_specific_fields``), ``"legacy"`` (top-level
            ``prompt_token_ids`` and ``response_token_ids`` as a list of lists).
        delay_s: Seconds to wait before answering.
        model: ``model`` of the response (default: the request's model).
    """

    content: str | None = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    status: int = 200
    error_message: str = "scripted error"
    error_type: str = "BadRequestError"
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    completion_tokens: int | None = None
    return_token_ids: bool = True
    placement: str = "vllm"
    delay_s: float = 0.0
    model: str | None = None


TOKEN_ID_PLACEMENTS = ("vllm", "choice", "provider_fields", "message", "legacy")


def _place_token_ids(
    out: dict[str, Any], choice: dict[str, Any], prompt_ids: list[int], token_ids: list[int], placement: str
) -> None:
    if placement == "vllm":
        out["prompt_token_ids"], choice["token_ids"] = prompt_ids, token_ids
    elif placement == "choice":
        choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, token_ids
    elif placement == "provider_fields":
        out["provider_specific_fields"] = {"prompt_token_ids": prompt_ids}
        choice["provider_specific_fields"] = {"token_ids": token_ids}
    elif placement == "message":
        out["prompt_token_ids"] = prompt_ids
        choice["message"]["provider_specific_fields"] = {"token_ids": token_ids}
    elif placement == "legacy":
        out["prompt_token_ids"], out["response_token_ids"] = prompt_ids, [token_ids]
    else:
        raise ValueError(f"ScriptedLLM: unknown token id placement {placement!r}; one of {TOKEN_ID_PLACEMENTS}")


Script = Callable[[list[dict[str, Any]], dict[str, Any]], Any]


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves the host's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class ScriptedLLM:
    """An in-process OpenAI-compatible stub server; see the module docstring.

    Args:
        responses: The script (see module docstring).
        host: Interface to bind.
        port: Port to bind; ``None`` picks a free one.

    Attributes:
        requests: JSON bodies of every chat-completion request received, in order.
        url: ``http://host:port/v1`` once started.
    """

    def __init__(self, responses: Any = None, *, host: str = "127.0.0.1", port: int | None = None):
        self._script = responses
        self._host = host
        self._port = port
        self._next = 0
        self.requests: list[dict[str, Any]] = []
        self.url: str | None = None
        self._server: _QuietServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.app = self._build_app()

    # -- scripting --------------------------------------------------------------------------

    async def _pick(self, body: dict[str, Any]) -> Any:
        script = self._script
        messages = list(body.get("messages") or [])
        if script is None:
            last_user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
            return Reply(content=f"echo: {last_user}")
        if callable(script):
            out = script(messages, body)
            return await out if inspect.isawaitable(out) else out
        if isinstance(script, list):
            if not script:
                raise ValueError("ScriptedLLM: empty response list")
            item = script[min(self._next, len(script) - 1)]
            self._next += 1
            return item
        return script

    @staticmethod
    def _completion(reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        text = reply.content or ""
        tool_calls = [
            {
                "id": tc.id or f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {
                    "name": tc.name,
                    "arguments": tc.arguments if isinstance(tc.arguments, str) else json.dumps(tc.arguments),
                },
            }
            for tc in reply.tool_calls
        ]
        generated = text + "".join(
            f" <tool_call> {tc['function']['name']} {tc['function']['arguments']} </tool_call>" for tc in tool_calls
        )
        token_ids = reply.token_ids if reply.token_ids is not None else toy_tokenize(generated)
        prompt_ids = (
            reply.prompt_token_ids
            if reply.prompt_token_ids is not None
            else toy_tokenize(_prompt_text(body.get("messages") or []))
        )
        completion_tokens = reply.completion_tokens if reply.completion_tokens is not None else len(token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": reply.finish_reason or ("tool_calls" if tool_calls else "stop"),
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": reply.model or body.get("model") or "stub-model",
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }
        if body.get("logprobs"):  # OpenAI's shape, one entry per generated piece
            pieces = generated.split() or [""]
            top = int(body.get("top_logprobs") or 0)
            choice["logprobs"] = {
                "content": [
                    {
                        "token": piece,
                        "logprob": -0.5 * (i + 1),
                        "bytes": list(piece.encode()),
                        "top_logprobs": [{"token": piece, "logprob": -0.5 * (i + 1), "bytes": None}] * top,
                    }
                    for i, piece in enumerate(pieces)
                ]
            }
        if reply.return_token_ids:
            _place_token_ids(out, choice, prompt_ids, token_ids, reply.placement)
        return out

    @staticmethod
    def _sse(completion: dict[str, Any]) -> AsyncIterator[bytes]:
        async def gen() -> AsyncIterator[bytes]:
            base = {k: completion[k] for k in ("id", "created", "model")}
            base["object"] = "chat.completion.chunk"
            choice = completion["choices"][0]
            msg = choice["message"]
            delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(msg["tool_calls"])]
            first = dict(
                base,
                choices=[{"index": 0, "delta": delta, "finish_reason": None, "token_ids": choice.get("token_ids")}],
            )
            if completion.get("prompt_token_ids") is not None:  # vLLM sends them with the first chunk
                first["prompt_token_ids"] = completion["prompt_token_ids"]
            yield f"data: {json.dumps(first)}\n\n".encode()
            last = dict(
                base,
                choices=[{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                usage=completion["usage"],
            )
            yield f"data: {json.dumps(last)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return gen()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            item = await self._pick(body)
            if isinstance(item, str):
                item = Reply(content=item)
            if isinstance(item, dict):
                return JSONResponse(item)
            if not isinstance(item, Reply):
                raise TypeError(f"ScriptedLLM: a script returned {type(item).__name__}, not str/Reply/dict")
            if item.delay_s:
                await asyncio.sleep(item.delay_s)
            if item.status >= 400:
                error = {
                    "message": item.error_message,
                    "type": item.error_type,
                    "param": None,
                    "code": item.status,
                }
                return JSONResponse({"error": error}, status_code=item.status)
            completion = self._completion(item, body)
            if body.get("stream"):
                return StreamingResponse(self._sse(completion), media_type="text/event-stream")
            return JSONResponse(completion, status_code=item.status)

        app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
        app.add_api_route("/chat/completions", chat, methods=["POST"])

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": "stub"}]}

        return app

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve; return the base URL ``http://host:port/v1``."""
        sock = tcp_listener(self._host)  # Nagle off, as a real server has it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port or 0))
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=2
        )
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="scripted-llm")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("ScriptedLLM server exited during startup")
            await asyncio.sleep(0.01)
        self.url = f"http://{self._host}:{self._port}/v1"
        return self.url

    async def stop(self) -> None:
        """Shut the server down (idempotent)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 5)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server = None
        self._task = None

    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
