"""Forwarding a chat completion to the backends and publishing its span (mixed into ``LLMProxy``)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from litellm.exceptions import ServiceUnavailableError as LiteLLMUnavailable
from litellm.router import Router

from eventlight.core.types import Span
from eventlight.llm_proxy.token_ids import normalize
from eventlight.llm_proxy.upstream import (
    build_router,
    retryable,
    upstream_error,
)

if TYPE_CHECKING:
    from eventlight.store.base import LightningStore

log = logging.getLogger(__name__)

_SPAN_WAIT_S = 5.0

_OWN_KEYS = frozenset({"model", "messages", "stream", "stream_options"})

CONNECTION_KEYS = frozenset(
    {"api_key", "api_base", "base_url", "api_version", "organization", "headers", "extra_headers"}
    | {"custom_llm_provider", "litellm_params", "model_list", "client", "deployment_id", "mock_response"}
)
"""Request-body keys a client may not set: LiteLLM would let them override the deployment's own
backend and credentials (a client's ``api_base`` would receive the configured ``api_key``)."""
CONNECTION_PREFIXES = ("aws_", "vertex_", "azure_", "litellm_", "watsonx_")


def backend_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling and tool parameters of a client's body to pass on to the backend: everything
    but the keys the proxy sets itself and those that choose a backend or carry credentials."""
    return {
        k: v
        for k, v in body.items()
        if k not in _OWN_KEYS and k not in CONNECTION_KEYS and not k.startswith(CONNECTION_PREFIXES)
    }


class Forwarding:
    """Forwarding one call to the backends (retrying what may be retried) and recording its span."""

    _model_list: list[dict[str, Any]]
    _return_token_ids: bool | None
    _request_timeout_s: float
    _router: Router | None
    _num_retries: int
    _pending: set[asyncio.Task[Any]]
    _forwarding: set[asyncio.Task[Any]]
    _cut: bool

    def _build_router(self) -> Router | None:
        return build_router(self._model_list, self._return_token_ids, self._request_timeout_s)

    def _system_of(self, model: Any) -> str | None:
        for entry in self._model_list:
            if entry["model_name"] == model:
                name = entry["litellm_params"]["model"]
                return name.split("/", 1)[0] if "/" in name else "openai"
        return None

    async def _forward(self, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """Call the backend without streaming; return the completion dict and the provider name.

        Raises:
            Exception: LiteLLM's error after the retries allowed for retryable failures.
        """
        router = self._router
        if router is None:
            raise LiteLLMUnavailable(
                message="the LLM proxy has no backend models; call update_model_list()",
                llm_provider="",
                model=str(body.get("model")),
            )
        kwargs = backend_kwargs(body)
        attempt = 0
        while True:
            try:
                resp = await router.acompletion(model=body["model"], messages=body["messages"], stream=False, **kwargs)
                break
            except Exception as exc:
                status, _, message = upstream_error(exc)
                if attempt >= self._num_retries or not retryable(status):
                    raise
                attempt += 1
                delay = min(0.5 * 2 ** (attempt - 1), 8.0)
                log.warning(
                    "upstream failed (%s: %s); retry %d/%d in %.1f s",
                    status,
                    message,
                    attempt,
                    self._num_retries,
                    delay,
                )
                await asyncio.sleep(delay)
        completion: dict[str, Any] = resp.model_dump(mode="json", warnings=False)  # type: ignore[no-untyped-call]
        normalize(completion)  # token ids where vLLM puts them, whichever placement the backend used
        hidden = getattr(resp, "_hidden_params", None) or {}
        return completion, hidden.get("custom_llm_provider")

    async def _forward_unless_cut(self, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """``_forward`` in a task of its own, which ``_cut_forwards`` cancels when the proxy stops.

        Raises:
            asyncio.CancelledError: The call was cut (or its request cancelled).
            Exception: As ``_forward``.
        """
        task = asyncio.ensure_future(self._forward(body))
        self._forwarding.add(task)
        try:
            return await task
        finally:
            self._forwarding.discard(task)

    def _cut_forwards(self) -> int:
        """Cancel every call still waiting for its backend, and refuse new ones; returns how many were cut."""
        self._cut = True
        waiting = [t for t in self._forwarding if not t.done()]
        for task in waiting:
            task.cancel()
        return len(waiting)

    # -- spans ----------------------------------------------------------------------------

    async def _publish(self, store: LightningStore, span: Span) -> None:
        try:
            await store.add_many_spans([span])
        except Exception:
            log.exception(
                "LLMProxy could not record span %s (rollout %s, attempt %s, sequence %d)",
                span.span_id,
                span.rollout_id,
                span.attempt_id,
                span.sequence_id,
            )

    def _record_soon(self, store: LightningStore, span: Span) -> asyncio.Task[None]:
        """Publish ``span`` in the background (``stop()`` waits for it)."""
        task = asyncio.create_task(self._publish(store, span), name=f"llm-proxy-span:{span.span_id}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _record(self, store: LightningStore, span: Span) -> None:
        """Publish ``span``; wait at most 5 s (publication continues in the background after that)."""
        task = self._record_soon(store, span)
        try:
            await asyncio.wait_for(asyncio.shield(task), _SPAN_WAIT_S)
        except TimeoutError:
            log.warning("recording span %s takes over %.0f s; answering the client first", span.span_id, _SPAN_WAIT_S)
