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


#: Packages a runner process must not load by importing eventlight: each costs every runner process
#: memory and start-up time (the OpenAI SDK and httpx, whose CLI pulls rich and click, were about
#: 30 MB and 0.4 s a process when an APO module imported them at the top), and a user of only the
#: store or the runner need not have them working.
HEAVY = ("openai", "httpx", "rich", "click", "litellm", "fastapi", "uvicorn", "torch", "transformers", "pyarrow")


def test_importing_eventlight_and_its_runner_loads_no_heavy_package() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; import eventlight, eventlight.runner, eventlight.tracer, eventlight.store.jetstream; "
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == [], f"importing eventlight loaded {out.stdout.strip()}"
