"""What the ported Agent-lightning 0.3.0 names do (issue 13): real behaviour, or a clear error on use."""

from __future__ import annotations

import asyncio
import threading

import pytest

import eventlight as agl


@pytest.mark.parametrize(
    ("make", "instead"),
    [
        (lambda: agl.AgentOpsTracer(), "OtelTracer"),
        (lambda: agl.DevTaskLoader([], {}), "Trainer.dev"),
        (lambda: agl.CollectionBasedLightningStore(), "EventStore"),
        (lambda: agl.SharedMemoryExecutionStrategy(n_runners=2, main_thread="algorithm").execute(), "Trainer(strategy"),
    ],
)
def test_names_that_cannot_apply_raise_naming_what_to_use(make: object, instead: str) -> None:
    with pytest.raises(NotImplementedError, match="eventlight") as info:
        make()  # type: ignore[operator]
    assert instead in str(info.value)


def test_status_aliases_span_names_and_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(agl.RolloutStatus.__args__) >= {"queuing", "requeuing", "cancelled"}  # type: ignore[attr-defined]
    assert agl.SpanNames.REWARD == "agentlightning.reward" and agl.semconv.AGL_ANNOTATION == "agentlightning.annotation"
    monkeypatch.setenv("AGL_MANAGED_STORE", "false")
    monkeypatch.setenv("AGL_SERVER_PORT", "4747")
    assert agl.resolve_bool_env_var(agl.LightningEnvVar.AGL_MANAGED_STORE, fallback=True) is False
    assert agl.resolve_int_env_var(agl.LightningEnvVar.AGL_SERVER_PORT) == 4747
    assert agl.resolve_str_env_var(agl.LightningEnvVar.AGL_CURRENT_ROLE, fallback="both") == "both"


def test_set_and_clear_active_tracer() -> None:
    tracer = agl.DummyTracer()
    agl.set_active_tracer(tracer)
    assert agl.get_active_tracer() is tracer
    agl.clear_active_tracer()
    assert agl.get_active_tracer() is None


def test_build_component() -> None:
    assert isinstance(
        agl.build_component(agl.Baseline, expected_type=agl.Algorithm, spec_name="algorithm"), agl.Baseline
    )
    built = agl.build_component({"type": "eventlight.Baseline"}, expected_type=agl.Algorithm, spec_name="algorithm")
    assert isinstance(built, agl.Baseline)
    with pytest.raises(TypeError, match="algorithm must be a Algorithm"):
        agl.build_component(agl.DummyTracer, expected_type=agl.Algorithm, spec_name="algorithm")


def test_lightning_store_threaded_serves_any_thread_and_loop() -> None:
    threaded = agl.LightningStoreThreaded(agl.InMemoryLightningStore())
    assert threaded.capabilities.get("thread_safe") is True
    ids: list[str] = []

    def worker() -> None:
        ids.append(asyncio.run(threaded.enqueue_rollout("x")).rollout_id)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)

    async def check() -> int:
        n = len(await threaded.query_rollouts(rollout_id_in=ids))
        await threaded.close()
        return n

    assert asyncio.run(check()) == 4


def test_types_have_pydantic_model_dump() -> None:
    rollout = agl.Rollout(rollout_id="ro-1", input={"q": 1}, start_time=1.0)
    assert rollout.model_dump()["input"] == {"q": 1}
    assert '"rollout_id": "ro-1"' in rollout.model_dump_json(indent=None)
    assert agl.LitAgentRunner[str] is agl.LitAgentRunner  # 0.3.0's runner is generic in the task type


async def test_a_closed_lightning_store_threaded_says_it_is_closing() -> None:
    """``closing`` means what it means for the other stores: the wrapper refuses calls from then on,
    whether it opened and closed its store, never opened it, or wraps an open store it leaves open."""
    used = agl.LightningStoreThreaded(agl.InMemoryLightningStore())
    await used.enqueue_rollout("x")
    never_used = agl.LightningStoreThreaded(agl.InMemoryLightningStore())
    async with agl.InMemoryLightningStore() as inner:
        over_open = agl.LightningStoreThreaded(inner)
        for wrapper in (used, never_used, over_open):
            assert wrapper.closing is False
            await wrapper.close()
            assert wrapper.closing is True
            with pytest.raises(agl.InvalidInputError, match="closed"):
                await wrapper.enqueue_rollout("y")
        assert inner.closing is False  # left open: its opener closes it
        assert (await inner.enqueue_rollout("z")).rollout_id


async def test_lightning_store_threaded_says_its_store_is_closing() -> None:
    """Before its own close, the wrapper answers for the store it wraps (``closing`` of an open
    JetStream-like store that began to close)."""

    class Closing(agl.InMemoryLightningStore):
        @property
        def closing(self) -> bool:
            return True

    async with Closing() as inner:
        wrapper = agl.LightningStoreThreaded(inner)
        assert wrapper.closing is True
        await wrapper.close()
