"""eventlight: train AI agents from their traces on an event-sourced store.

``import eventlight as agl`` gives Agent-lightning 0.3's public names on a store whose every fact
is an event on NATS JetStream, projected into Postgres (see DESIGN.md).
"""

from eventlight.adapter import (
    Adapter,
    LlmProxyTraceToTriplet,
    RewardMatchPolicy,
    TraceAdapter,
    TracerTraceToTriplet,
    TraceToMessages,
    TraceToTripletBase,
)
from eventlight.agent import FunctionalLitAgent, LitAgent, llm_rollout, prompt_rollout, rollout
from eventlight.algorithm import APO, Algorithm, Baseline, FastAlgorithm, algo
from eventlight.core.errors import (
    AttemptNotFoundError,
    ConcurrencyError,
    EventlightError,
    InvalidInputError,
    InvalidTransitionError,
    LLMUnavailableError,
    NotFoundError,
    ResourcesNotFoundError,
    RolloutNotFoundError,
    ServiceUnavailableError,
    WrongEventLoopError,
)
from eventlight.core.types import (
    LLM,
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    NamedResources,
    PaginatedResult,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    Triplet,
    Worker,
)
from eventlight.emitter import (
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    operation,
)
from eventlight.logreplay import replay
from eventlight.ops import Services, ensure_services, prepare_services, stop_services
from eventlight.rewards import (
    find_final_reward,
    find_reward_spans,
    get_message_value,
    get_object_value,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
)
from eventlight.runner import Hook, LitAgentRunner
from eventlight.settings import Settings
from eventlight.store import UNSET, InMemoryLightningStore, LightningStore, LightningStoreCapabilities
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.tracer import DummyTracer, OtelTracer, SpanCoreFields, Tracer, get_active_tracer
from eventlight.trainer import Trainer

__all__ = [
    "APO",
    "LLM",
    "UNSET",
    "Adapter",
    "Algorithm",
    "Attempt",
    "AttemptNotFoundError",
    "AttemptedRollout",
    "Baseline",
    "ConcurrencyError",
    "DummyTracer",
    "EnqueueRolloutRequest",
    "EventlightError",
    "FastAlgorithm",
    "FunctionalLitAgent",
    "Hook",
    "InMemoryLightningStore",
    "InvalidInputError",
    "InvalidTransitionError",
    "JetStreamLightningStore",
    "LLMProxy",
    "LLMUnavailableError",
    "LightningStore",
    "LightningStoreCapabilities",
    "LitAgent",
    "LitAgentRunner",
    "LlmProxyTraceToTriplet",
    "NamedResources",
    "NotFoundError",
    "OtelTracer",
    "RewardMatchPolicy",
    "get_message_value",
    "get_object_value",
    "get_rewards_from_span",
    "PaginatedResult",
    "PromptTemplate",
    "ProxyLLM",
    "ResourcesNotFoundError",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutNotFoundError",
    "ServiceUnavailableError",
    "Services",
    "Settings",
    "Span",
    "SpanCoreFields",
    "TraceAdapter",
    "TraceToMessages",
    "TraceToTripletBase",
    "Tracer",
    "TracerTraceToTriplet",
    "Trainer",
    "Triplet",
    "Worker",
    "WrongEventLoopError",
    "algo",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "ensure_services",
    "find_final_reward",
    "find_reward_spans",
    "get_active_tracer",
    "get_reward_value",
    "is_reward_span",
    "llm_rollout",
    "operation",
    "prepare_services",
    "prompt_rollout",
    "replay",
    "rollout",
    "stop_services",
]


def __getattr__(name: str) -> object:
    # LiteLLM takes seconds to import; runner processes never need the proxy, so load it on first use.
    if name == "LLMProxy":
        from eventlight.llm_proxy import LLMProxy

        return LLMProxy
    raise AttributeError(f"module 'eventlight' has no attribute {name!r}")
