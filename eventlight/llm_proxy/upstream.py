"""The backends behind the proxy: LiteLLM's Router from a ``model_list``, upstream errors as OpenAI-style
answers, and the start-up check that every model answers."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
from fastapi.responses import JSONResponse
from litellm.exceptions import Timeout as LiteLLMTimeout
from litellm.router import Router
from starlette.types import Scope

from eventlight.core.errors import LLMUnavailableError
from eventlight.server.openai_errors import SERVER_STOPPING, body_refusal, openai_error

log = logging.getLogger(__name__)

CHECK_HEADER = "x-eventlight-check"
"""Marks the start-up check's requests: they record no span and do not count towards health."""


def error_message(response: httpx.Response) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the start of the body."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return " ".join(str(message).split())[:300]


def error_response(status: int, message: str, err_type: str, *, param: str | None = None) -> JSONResponse:
    """OpenAI's error object with ``code`` = ``status`` (``eventlight.server.openai_errors``)."""
    return openai_error(status, message, err_type, param=param)


@dataclass(frozen=True)
class CallError:
    """Why a proxied call gets no completion: the HTTP status, an error type and a one-line message."""

    status: int
    type: str
    message: str
    param: str | None = None

    def openai_response(self) -> JSONResponse:
        """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""
        return error_response(self.status, self.message, self.type, param=self.param)

    def anthropic_response(self) -> JSONResponse:
        """Anthropic's error body ``{"type": "error", "error": {"type", "message"}}``."""
        kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
        kinds |= {429: "rate_limit_error", 529: "overloaded_error"}
        kind = kinds.get(self.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": self.message}}
        return JSONResponse(body, status_code=self.status)


def refuse_unauthorized(message: str, scope: Scope) -> JSONResponse:
    """The proxy's 401: OpenAI's own error object for a missing or wrong key (``BearerAuth``'s ``refuse``;
    the same on every route, so ``scope`` is not read)."""
    return openai_error(401, message, "invalid_request_error", code="invalid_api_key")


STOPPING_TYPE = SERVER_STOPPING
"""The ``type`` of the OpenAI error object of a call the stopping proxy did not take or cut (503)."""

refuse_body = body_refusal("the LLM proxy")
"""The proxy's answer to a request body ``BodyLimit`` refuses (its ``refuse``), as OpenAI's error
object on every route: 413 ``invalid_request_error`` over ``max_body_bytes``, 503 ``server_busy``
over ``max_buffered_bytes``, 408 ``request_timeout`` past ``body_timeout_s`` or behind
``body_min_bytes_per_s``, 503 ``server_stopping`` while the proxy stops (``openai_errors.body_refusal``)."""


def upstream_error(exc: BaseException) -> tuple[int, str, str]:
    """``(http_status, error_type, message)`` of an exception raised by LiteLLM.

    ``error_type`` is LiteLLM's exception class (e.g. ``ContextWindowExceededError``,
    ``BadRequestError``); ``message`` is the upstream's own error message when it sent one.
    """
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 16:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    if any(isinstance(e, (openai.APITimeoutError, LiteLLMTimeout, TimeoutError)) for e in chain):
        return 504, "Timeout", f"upstream timed out: {getattr(exc, 'message', exc)}"
    if any(isinstance(e, openai.APIConnectionError) for e in chain) and not any(
        isinstance(e, openai.APIStatusError) and e.response is not None and e.body is not None for e in chain
    ):
        return (
            502,
            "APIConnectionError",
            f"cannot reach the upstream model server: {getattr(exc, 'message', exc)}",
        )
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or not 400 <= status < 600:
        status = 502
    body = getattr(exc, "body", None)
    message = None
    if isinstance(body, Mapping):
        error = body.get("error")
        inner = error if isinstance(error, Mapping) else body
        message = inner.get("message")
    if not isinstance(message, str) or not message:
        message = str(getattr(exc, "message", None) or exc)
    return status, type(exc).__name__, message


def retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


def check_model_list(model_list: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, entry in enumerate(model_list):
        if not isinstance(entry, Mapping):
            raise ValueError(f"model_list[{i}] must be a dict, got {type(entry).__name__}")
        name = entry.get("model_name")
        params = entry.get("litellm_params")
        if not isinstance(name, str) or not name:
            raise ValueError(f"model_list[{i}] needs a non-empty str 'model_name'")
        if not isinstance(params, Mapping) or not isinstance(params.get("model"), str):
            raise ValueError(f"model_list[{i}] ({name!r}) needs 'litellm_params' with a str 'model'")
        out.append({**entry, "litellm_params": dict(params)})
    return out


def wants_token_ids(params: Mapping[str, Any]) -> bool:
    """Auto rule: vLLM deployments and OpenAI-compatible servers at an explicit, non-OpenAI ``api_base``."""
    model = str(params.get("model", ""))
    if model.startswith("hosted_vllm/"):
        return True
    api_base = params.get("api_base")
    if not model.startswith("openai/") or not isinstance(api_base, str) or not api_base:
        return False
    host = (urlparse(api_base).hostname or "").lower()
    return not (host.endswith("openai.com") or host.endswith("azure.com"))


def build_router(
    model_list: list[dict[str, Any]], return_token_ids: bool | None, timeout_s: float | None
) -> Router | None:
    """LiteLLM's Router over ``model_list`` (``None`` when empty), asking for token ids where wanted."""
    if not model_list:
        return None
    entries = []
    for entry in model_list:
        params = dict(entry["litellm_params"])
        want = return_token_ids if return_token_ids is not None else wants_token_ids(params)
        extra = dict(params.get("extra_body") or {})
        if want and "return_token_ids" not in extra:
            extra["return_token_ids"] = True
            params["extra_body"] = extra
        entries.append({**entry, "litellm_params": params})
    router: Router = Router(model_list=entries, num_retries=0, timeout=timeout_s)
    return router


async def check_models(
    url: str, endpoint: str, model_list: list[dict[str, Any]], timeout_s: float, *, token: str | None = None
) -> None:
    """One short chat completion per model name through the proxy at ``url`` (``LLMProxy.check``),
    sending ``token`` as the bearer token when the proxy asks for one.

    Raises:
        LLMUnavailableError: A model did not answer with a completion.
    """
    headers = {CHECK_HEADER: "1"} | ({"Authorization": f"Bearer {token}"} if token else {})
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for model in dict.fromkeys(e["model_name"] for e in model_list):
            backends = ", ".join(
                str(e["litellm_params"].get("api_base") or e["litellm_params"]["model"])
                for e in model_list
                if e["model_name"] == model
            )
            where = f"model {model!r} through the LLM proxy at {endpoint} (backend {backends})"
            body = {"model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1}
            try:
                r = await client.post(url, json=body, headers=headers)
            except httpx.HTTPError as exc:
                raise LLMUnavailableError(where, f"{type(exc).__name__}: {exc}") from exc
            if r.status_code != 200:
                raise LLMUnavailableError(where, f"HTTP {r.status_code}: {error_message(r)}")
            log.info("LLM check passed: %s", where)
