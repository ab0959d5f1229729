"""A run stops on a dead LLM: the proxy's start-up check, its failure window, and the demo's exit code."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from demo_runs import run_script
from llm_stub import Reply, ScriptedLLM

from eventlight.core.errors import LLMUnavailableError, ServiceUnavailableError
from eventlight.llm_health import LLMCallHealth
from eventlight.llm_proxy import LLMProxy
from eventlight.net import free_port
from eventlight.trainer_guards import stop_when_llm_fails

ROOT = Path(__file__).resolve().parents[1]
MODEL = "stub-model"
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")


def proxy_for(url: str) -> LLMProxy:
    params = {"model": "openai/backend-model", "api_base": url, "api_key": "sk-test"}
    return LLMProxy(model_list=[{"model_name": MODEL, "litellm_params": params}])


def test_health_trips_on_most_server_failures_only() -> None:
    health = LLMCallHealth(window=10, min_calls=4, max_failure_fraction=0.5)
    for _ in range(3):
        health.record(ok=False, status=502, detail="bad gateway", model="m")
    assert health.failing() is None  # fewer than min_calls
    health.record(ok=False, status=503, detail="overloaded", model="m")
    reason = health.failing()
    assert reason is not None and "4 of the last 4" in reason and "503" in reason and "overloaded" in reason


def test_client_errors_say_nothing_about_the_model() -> None:
    health = LLMCallHealth(window=10, min_calls=2)
    for _ in range(10):
        health.record(ok=False, status=400, detail="prompt too long", model="m")
    assert health.failing() is None
    assert health.calls == 10 and health.failures == 0


def test_half_failed_is_not_most() -> None:
    health = LLMCallHealth(window=4, min_calls=4, max_failure_fraction=0.5)
    for ok in (True, False, True, False):
        health.record(ok=ok, status=200 if ok else 500)
    assert health.failing() is None
    health.record(ok=False, status=500)  # window now F T F F
    assert health.failing() is not None
    health.reset()
    assert health.failing() is None


@pytest.mark.parametrize("bad", [{"window": 0}, {"window": 5, "min_calls": 6}, {"max_failure_fraction": 1.0}])
def test_health_refuses_bad_settings(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LLMCallHealth(**bad)


async def test_check_passes_on_a_live_backend_and_counts_nothing() -> None:
    stub = ScriptedLLM(responses=Reply(content="OK"))
    async with stub as url:
        async with proxy_for(url) as proxy:
            await proxy.check(timeout_s=10)
        assert len(stub.requests) == 1 and stub.requests[0]["max_tokens"] == 1
        assert proxy.health.calls == 0


async def test_check_names_proxy_backend_and_cause_when_the_backend_is_down() -> None:
    backend = f"http://127.0.0.1:{free_port()}/v1"
    async with proxy_for(backend) as proxy:
        with pytest.raises(LLMUnavailableError) as info:
            await proxy.check(timeout_s=10)
    message = str(info.value)
    assert "\n" not in message
    assert proxy.endpoint in message and backend in message and MODEL in message
    assert isinstance(info.value, ServiceUnavailableError)


async def test_check_reports_the_backends_error_message() -> None:
    stub = ScriptedLLM(responses=Reply(status=500, error_message="model crashed", error_type="InternalServerError"))
    async with stub as url, proxy_for(url) as proxy:
        with pytest.raises(LLMUnavailableError, match="model crashed"):
            await proxy.check(timeout_s=10)


async def test_check_needs_a_running_proxy() -> None:
    with pytest.raises(RuntimeError, match="start"):
        await proxy_for("http://127.0.0.1:9/v1").check()


async def test_a_run_is_cancelled_once_most_calls_through_the_proxy_fail() -> None:
    """The model dies after 3 answers; the 'algorithm' keeps calling and must be stopped."""
    answers = [Reply(content="fine")] * 3 + [Reply(status=503, error_message="server died", error_type="x")]
    stub = ScriptedLLM(responses=answers)
    cancelled = asyncio.Event()

    async def algorithm(base: str) -> None:
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(200):
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                    await client.post(f"{base}/chat/completions", json=body)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with stub as url, proxy_for(url) as proxy:
        with pytest.raises(LLMUnavailableError, match="of the last .* LLM calls failed") as info:
            await asyncio.wait_for(stop_when_llm_fails(algorithm(proxy.endpoint), proxy), 60)
    assert cancelled.is_set()
    assert "server died" in str(info.value) and "stopped" in str(info.value)
    assert 10 <= len(stub.requests) < 200


async def test_a_run_that_ends_normally_is_not_touched() -> None:
    async with ScriptedLLM(responses=Reply(content="ok")) as url, proxy_for(url) as proxy:

        async def algorithm() -> str:
            return "done"

        await stop_when_llm_fails(algorithm(), proxy)
        assert proxy.health.failing() is None


def run_demo(services: Any, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the APO demo script in a namespace of its own on the session's servers."""
    return run_script(services, ROOT / "examples/room_booking/train_apo.py", *args, timeout=timeout)


@pytest.mark.e2e
def test_demo_with_a_dead_llm_exits_1_with_one_line_and_no_rewards(services: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    done = run_demo(services, "--base-url", dead, "--model", "m", "--tasks", "4")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "LLM unavailable" in errors[0] and dead in errors[0], done.stderr
    assert "val reward, initial prompt" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.e2e
async def test_demo_whose_llm_dies_mid_run_stops_with_exit_1(services: Any) -> None:
    """The check and the first answers pass, then every call fails: no summary, exit code 1."""
    answers = [Reply(content="Room A")] * 4 + [Reply(status=502, error_message="llama died", error_type="x")]
    async with ScriptedLLM(responses=answers) as url:
        args = ("--base-url", url, "--model", "m", "--tasks", "8", "--rounds", "1", "--val-batch-size", "4")
        done = await asyncio.to_thread(run_demo, services, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "LLM calls failed" in errors[0] and "llama died" in errors[0], done.stderr
    assert f"backend {url}" in errors[0], errors[0]  # the dead backend is named, not only the proxy
    assert "val reward, initial prompt" not in done.stdout
    with_traceback = [line for line in done.stderr.splitlines() if line.endswith("agent raised")]
    assert len(with_traceback) <= 2, done.stderr  # one traceback per kind of failure, not one per rollout
