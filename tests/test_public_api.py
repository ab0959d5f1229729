"""Pins the public API: Agent-lightning's names, importable from ``eventlight``."""

import eventlight as agl

EXPECTED = {
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
    "LightningStore",
    "LightningStoreCapabilities",
    "LitAgent",
    "LitAgentRunner",
    "LlmProxyTraceToTriplet",
    "NamedResources",
    "NotFoundError",
    "OtelTracer",
    "PaginatedResult",
    "PromptTemplate",
    "ProxyLLM",
    "ResourcesNotFoundError",
    "ResourcesUpdate",
    "RewardMatchPolicy",
    "Rollout",
    "RolloutConfig",
    "RolloutNotFoundError",
    "ServiceUnavailableError",
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
    "algo",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "get_active_tracer",
    "get_message_value",
    "get_object_value",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "llm_rollout",
    "operation",
    "prompt_rollout",
    "replay",
    "rollout",
    "LLMUnavailableError",
    "NoRunnersError",
    "Services",
    "ensure_services",
    "prepare_services",
    "stop_services",
    "use_services",
    "WrongEventLoopError",
}


PORTED = set(
    """AgentLightningClient AgentLightningServer AgentOpsTracer AttemptStatus AttributeValue Attributes
    ClientServerExecutionStrategy CollectionBasedLightningStore Dataset DevTaskLoader Event ExecutionEvent
    ExecutionStrategy FilterField FilterOptions GenericResponse LegacyAgentRunner LightningEnvVar
    LightningStoreClient LightningStoreServer LightningStoreStatistics LightningStoreThreaded Link
    MultiprocessingEvent OtelResource OtelTraceAdapter ParallelWorkerBase Resource ResourceUnion RolloutLegacy
    RolloutMode RolloutRawResult RolloutRawResultLegacy RolloutStatus Runner SharedMemoryExecutionStrategy
    SortOptions SpanAttributeNames SpanContext SpanLike SpanNames SpanRecordingContext StatusCode Task TaskIfAny
    TaskInput ThreadingEvent TraceState TraceStatus VERL WorkerStatus build_component clear_active_tracer client
    config configure_logger env_var execution instrumentation lightning_cli litagent logging resolve_bool_env_var
    resolve_int_env_var resolve_str_env_var resources reward semconv server set_active_tracer setup_logging
    setup_module_logging types utils""".split()
)
"""Agent-lightning 0.3.0's other public names (tests/test_port_names.py checks them against 0.3.0 itself)."""


def test_public_names_are_pinned() -> None:
    assert set(agl.__all__) == EXPECTED | PORTED


def test_every_public_name_resolves() -> None:
    for name in agl.__all__:
        assert getattr(agl, name) is not None, name
