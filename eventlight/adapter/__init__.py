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

Nothing is lost without a mark: each adapter's ``stats`` (all calls) and ``last_stats`` (the last
one) are ``AdapterStats`` counting LLM calls skipped as errors or duplicates and calls with
missing or incomplete token ids (kept and marked in ``Triplet.metadata`` by
``TracerTraceToTriplet``, skipped by ``LlmProxyTraceToTriplet``). When several layers recorded one LLM
call (the LLM proxy and a framework's instrumentation), the copy with token ids is kept and the
others count as ``duplicates`` (``eventlight.adapter.dedup``).
"""

from eventlight.adapter.base import Adapter, OtelTraceAdapter, RewardMatchPolicy, TraceAdapter, TraceToTripletBase
from eventlight.adapter.messages import OpenAIMessages, TraceToMessages
from eventlight.adapter.stats import AdapterStats
from eventlight.adapter.tree import TraceTree
from eventlight.adapter.triplets import LlmProxyTraceToTriplet, TracerTraceToTriplet

__all__ = [
    "Adapter",
    "AdapterStats",
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
