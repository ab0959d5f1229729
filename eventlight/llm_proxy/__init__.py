"""``LLMProxy``: an OpenAI-compatible endpoint that forwards to backends and records every call as a span.

Agent-lightning's ``agentlightning.llm_proxy.LLMProxy`` with the same public names, served in-process
(FastAPI app, ``uvicorn.Server.serve()`` as an asyncio task on the caller's event loop) and forwarding
with a ``Router`` built from an Agent-lightning ``model_list``::

    proxy = LLMProxy(model_list=[{"model_name": "m", "litellm_params": {
        "model": "hosted_vllm/Qwen3-4B", "api_base": "http://127.0.0.1:8000/v1"}}], store=store)
    await proxy.start()
    await store.add_resources({"main_llm": proxy.as_resource()})
    # a runner calls  llm.get_base_url(rollout_id, attempt_id) + "/chat/completions"

Routes:

* ``POST /rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions`` (also without ``/v1``):
  allocates one span sequence id from the store (unknown ids answer 404 and record nothing),
  forwards with ``stream`` forced off upstream, and publishes exactly ONE span named
  ``openai.chat.completion`` per call, successful or not (an upstream error gives status ``ERROR``
  with ``error.type``, ``http.status_code`` and ``error.message``; the client gets the upstream
  status and an OpenAI-style error body). A body that is not strict JSON (``NaN``, ``Infinity``, a
  lone ``\\ud800`` escape), not an object with a ``messages`` list of objects, or whose ``model`` /
  ``stream`` / ``stream_options`` has the wrong type answers 400 and is neither forwarded, recorded
  nor counted towards ``health``.
* ``POST /rollout/{rollout_id}/attempt/{attempt_id}/v1/messages``: Anthropic's Messages API,
  translated by LiteLLM's adapter to a chat completion and recorded the same way, with
  ``eventlight.llm_proxy.route = "anthropic.messages"`` (``anthropic_messages``); ``POST /v1/messages``
  forwards without recording.
* ``POST /v1/chat/completions`` (also without ``/v1``): forwards and records nothing (warns once).
* ``GET /v1/models``, ``GET /health``.

A request body over ``max_body_bytes`` (32 MiB by default) answers 413 with an OpenAI error body on
every route (as the 401 does), counted while it arrives: it is never buffered whole, forwarded nor
recorded. A body that would take the bytes held by all calls at once past ``max_buffered_bytes``
answers 503 ``server_busy`` with ``Retry-After`` (a call's bytes count until it is parsed, not while
its model answers); one that goes ``body_timeout_s`` without a byte, or falls that far behind
``body_min_bytes_per_s``, 408 ``request_timeout`` (``eventlight.server.limits.BodyLimit``).

A client asking for ``stream: true`` gets a synthetic SSE stream built from the complete upstream
answer (Agent-lightning's ``StreamConversionMiddleware``, peer failure C12), so token ids are never
lost to streaming; the span is the one of the non-stream call.

Span attributes follow the OpenTelemetry GenAI conventions flattened as Agent-lightning's tracer
writes them (``gen_ai.prompt.{i}.role``, ``gen_ai.completion.{i}.content``, ...), plus
``prompt_token_ids`` / ``response_token_ids`` when the backend returns them (vLLM
``return_token_ids``, wherever LiteLLM placed them: ``token_ids``), ``eventlight.token_ids.missing``
naming those a successful answer lacked, and ``token_ids_incomplete=True`` when the ids do not
match ``usage`` (peer failure C14). A span too large for one event (a prompt with big images) is
recorded without its largest texts, named in ``eventlight.llm_proxy.omitted_attributes``. Resource
attributes: ``agentlightning.rollout_id``, ``agentlightning.attempt_id``, ``agentlightning.span_sequence_id``.

Differences from Agent-lightning 0.3: one launch mode (asyncio, in-process; the event loop must stay
responsive — a blocking algorithm stalls the proxy); ``update_model_list`` takes effect at once on a
running proxy (``restart()`` still works); a 4xx is never retried; ``as_resource()`` endpoints end in
``/v1``.
"""

from __future__ import annotations

import os
import warnings

if "LITELLM_LOCAL_MODEL_COST_MAP" not in os.environ:  # offline: never fetch the cost map at import
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

import litellm  # noqa: E402

litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" banners on stdout
# LiteLLM's lazily imported modules (Router internals, GitHub Copilot auth types, thinking blocks) make
# pydantic warn "... using the `ReadOnly` qualifier" at the first calls, some on every call; harmless.
warnings.filterwarnings("ignore", message=r".*`ReadOnly` qualifier", category=UserWarning, module=r"pydantic\.")

from eventlight.llm_proxy.server import LLMProxy  # noqa: E402
from eventlight.llm_proxy.span_attributes import SPAN_NAME, build_chat_span_attributes  # noqa: E402
from eventlight.llm_proxy.sse import chat_completion_to_sse  # noqa: E402

__all__ = ["SPAN_NAME", "LLMProxy", "build_chat_span_attributes", "chat_completion_to_sse"]
