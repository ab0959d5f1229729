"""Adapters: turn the spans of one attempt into training data (Agent-lightning ``agentlightning.adapter``).

::

    Adapter[T_from, T_to]                 __call__(source) -> adapt(source)
    └── TraceAdapter[T_to]                source = Sequence[Span]
        ├── TraceToTripletBase            -> list[Triplet]
        │   ├── TracerTraceToTriplet      span tree + time-based reward matching (tracer spans)
        │   └── LlmProxyTraceToTriplet    sequence-id ordering only (LLM proxy spans)
        └── TraceToMessages               -> list[{"messages": [...], "tools": [...] | None}]

Span attributes follow the OpenTelemetry GenAI conventions as AgentOps/OpenLLMetry write them
(``gen_ai.prompt.{i}.role``, ``gen_ai.completion.{i}.content``, ``gen_ai.response.id``) plus the
token-id attributes that Agent-lightning patches in (``prompt_token_ids``, ``response_token_ids``).
When several layers recorded one LLM call (the LLM proxy and a framework's instrumentation), the
adapters keep the copy with token ids and count the others in ``adapter.stats``
(``eventlight.adapter.dedup``).
"""

from eventlight.adapter.base import Adapter, OtelTraceAdapter, RewardMatchPolicy, TraceAdapter, TraceToTripletBase
from eventlight.adapter.messages import OpenAIMessages, TraceToMessages
from eventlight.adapter.tree import TraceTree
from eventlight.adapter.triplets import LlmProxyTraceToTriplet, TracerTraceToTriplet

__all__ = [
    "Adapter",
    "LlmProxyTraceToTriplet",
    "OpenAIMessages",
    "OtelTraceAdapter",
    "RewardMatchPolicy",
    "TraceAdapter",
    "TraceToMessages",
    "TraceToTripletBase",
    "TraceTree",
    "TracerTraceToTriplet",
]
