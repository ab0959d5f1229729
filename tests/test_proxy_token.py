"""The LLM proxy's bearer token (issue 16 item 6): refused without it, never recorded, handed to agents.

With a token the proxy answers every request that lacks ``Authorization: Bearer <token>`` with 401
and OpenAI's error object, so the OpenAI SDK raises ``AuthenticationError``; the token given as the
client's ``api_key`` works. A runner fills the ``api_key`` of each ``ProxyLLM`` it hands an agent,
so an agent under a ``Trainer`` keeps working, and the token is never stored with the resources.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from llm_stub import Reply, ScriptedLLM

import eventlight as agl
from eventlight.core.errors import InvalidInputError
from eventlight.core.types import ProxyLLM
from eventlight.llm_proxy import LLMProxy
from eventlight.runner import LitAgentRunner
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.memory import InMemoryLightningStore

pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")

TOKEN = "tok-3f9a1c0e-proxy-secret"
MODEL = "stub"


def model_list(url: str) -> list[dict[str, Any]]:
    return [{"model_name": MODEL, "litellm_params": {"model": "openai/backend", "api_base": url, "api_key": "sk-up"}}]


def client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)


async def test_token_is_required_on_every_route_and_works_as_the_openai_api_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses=Reply(content="fine")) as url:
        async with LLMProxy(model_list=model_list(url), store=store, token=TOKEN) as proxy:
            root = proxy.endpoint.removesuffix("/v1")
            rollout = await store.start_rollout(input={})
            base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
            async with httpx.AsyncClient(timeout=30) as http:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                missing = await http.post(f"{base}/chat/completions", json=body)
                wrong = await http.post(f"{base}/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
                unguarded = {
                    p: (await http.get(f"{root}{p}")).status_code for p in ("/health", "/metrics", "/v1/models")
                }
                metrics = await http.get(f"{root}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            with pytest.raises(openai.AuthenticationError):
                await client(base, "sk-wrong").chat.completions.create(model=MODEL, messages=body["messages"])
            good = client(base, TOKEN)
            answer = await good.chat.completions.create(model=MODEL, messages=body["messages"])
            await good.close()
            await proxy.check()  # the start-up check sends the token too
    assert missing.status_code == 401 and wrong.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    error = missing.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "missing bearer token" in error["message"] and "api_key" in error["message"]
    assert wrong.json()["error"]["message"] == "wrong bearer token"
    assert unguarded == {"/health": 401, "/metrics": 401, "/v1/models": 401}
    assert answer.choices[0].message.content == "fine"
    spans = await store.query_spans(rollout.rollout_id)
    assert len(spans) == 1  # the refused calls recorded nothing, the good one its span
    assert metrics.status_code == 200 and "eventlight_llm_proxy_calls_total" in metrics.text
    for where, text in {
        "spans": msgspec.json.encode(list(spans)).decode(),
        "metrics": metrics.text,
        "logs": "\n".join(r.getMessage() for r in caplog.records),
    }.items():
        assert TOKEN not in text, where


async def test_the_anthropic_client_sends_the_token_as_its_api_key() -> None:
    """Anthropic's SDK sends ``api_key`` in ``x-api-key``: the proxy takes the token there too."""
    import anthropic

    store = InMemoryLightningStore()
    async with ScriptedLLM(responses=Reply(content="fine")) as url:
        async with LLMProxy(model_list=model_list(url), store=store, token=TOKEN) as proxy:
            rollout = await store.start_rollout(input={})
            base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
            messages: Any = [{"role": "user", "content": "hi"}]
            for key in ("sk-wrong", TOKEN[:-1]):
                wrong = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=key, max_retries=0)
                with pytest.raises(anthropic.AuthenticationError):
                    await wrong.messages.create(model=MODEL, max_tokens=16, messages=messages)
                await wrong.close()
            good = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=TOKEN, max_retries=0)
            answer = await good.messages.create(model=MODEL, max_tokens=16, messages=messages)
            await good.close()
    assert answer.content[0].type == "text" and answer.content[0].text == "fine"
    spans = await store.query_spans(rollout.rollout_id)
    assert len(spans) == 1 and TOKEN not in msgspec.json.encode(list(spans)).decode()


async def test_token_from_the_environment_or_a_file_and_none_by_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "proxy_token"
    secret.write_text(TOKEN + "\n")
    monkeypatch.setenv("EVENTLIGHT_PROXY_TOKEN_FILE", str(secret))
    assert LLMProxy().token == TOKEN  # the trailing newline stripped
    assert LLMProxy(token="").token is None  # "" turns it off whatever the environment says
    async with LLMProxy() as proxy, httpx.AsyncClient() as http:
        health = proxy.endpoint.removesuffix("/v1") + "/health"
        refused = await http.get(health)
        allowed = await http.get(health, headers={"Authorization": f"Bearer {TOKEN}"})
    assert (refused.status_code, allowed.status_code) == (401, 200)
    monkeypatch.delenv("EVENTLIGHT_PROXY_TOKEN_FILE")
    monkeypatch.setenv("EVENTLIGHT_PROXY_TOKEN", "from-env")
    assert LLMProxy().token == "from-env"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot read the file (No such file or directory)"),
        ("", "the file is empty"),
        ("\n", "the file is empty"),
    ],
)
def test_a_token_file_that_cannot_be_used_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None, why: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("EVENTLIGHT_PROXY_TOKEN_FILE", str(path))
    for build in (LLMProxy, LitAgentRunner):
        with pytest.raises(InvalidInputError) as info:
            build()
        assert str(info.value) == f"EVENTLIGHT_PROXY_TOKEN_FILE={path}: {why}"
    monkeypatch.setenv("EVENTLIGHT_PROXY_TOKEN", "x")
    with pytest.raises(InvalidInputError, match="set EVENTLIGHT_PROXY_TOKEN or EVENTLIGHT_PROXY_TOKEN_FILE, not both"):
        LLMProxy()


@pytest.mark.parametrize("bad", ["two words", "tok\u00a0en", "tok\u00e9", " \t"])
def test_a_token_no_client_can_send_is_refused_where_it_is_set(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token with a space or a character outside visible ASCII cannot travel in an Authorization
    header: refused when the proxy or a runner is made, not as a UnicodeEncodeError inside the agent's
    first LLM call; the message never shows it."""
    for make in (lambda: LLMProxy(token=bad), lambda: LitAgentRunner(proxy_token=bad)):
        with pytest.raises(InvalidInputError, match="visible ASCII") as info:
            make()
        assert bad not in str(info.value)
    monkeypatch.setenv("EVENTLIGHT_PROXY_TOKEN", bad)
    for make in (LLMProxy, LitAgentRunner):
        with pytest.raises(InvalidInputError, match="EVENTLIGHT_PROXY_TOKEN must be visible ASCII"):
            make()
    assert LitAgentRunner(proxy_token="").proxy_token is None  # "" is "no token", as for the proxy


async def test_the_proxy_binds_loopback_unless_told_otherwise() -> None:
    async with LLMProxy(token=TOKEN) as proxy:
        assert proxy.host == "127.0.0.1"
        assert proxy._server is not None
        bound = {s.getsockname()[0] for srv in proxy._server.servers for s in srv.sockets}
    assert bound == {"127.0.0.1"}


async def test_the_runner_hands_agents_proxy_llms_with_its_token_and_stores_none() -> None:
    store = InMemoryLightningStore()
    proxy = LLMProxy(model_list=model_list("http://127.0.0.1:9/v1"), token=TOKEN)
    stored = await store.add_resources(
        {"main_llm": proxy.as_resource(), "other": agl.LLM(endpoint="http://x", model="m")}
    )
    assert isinstance(stored.resources["main_llm"], ProxyLLM) and stored.resources["main_llm"].api_key is None
    rollout = await store.start_rollout(input={}, resources_id=stored.resources_id)
    runner = LitAgentRunner(proxy_token=TOKEN)
    runner.init_worker(0, store)
    handed = await runner._resources(rollout)
    assert handed["main_llm"].api_key == TOKEN and handed["other"].api_key is None
    assert (await store.get_resources_by_id(stored.resources_id)).resources["main_llm"].api_key is None  # type: ignore[union-attr]
    without = LitAgentRunner(proxy_token=None)
    without.init_worker(0, store)
    assert (await without._resources(rollout))["main_llm"].api_key is None


@agl.rollout
async def ask_the_proxy(task: str, llm: agl.LLM) -> float:
    """An agent as users write them: the OpenAI client gets ``llm.api_key``."""
    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=0) as c:
        reply = await c.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task}])
    return 1.0 if reply.choices[0].message.content == f"echo: {task}" else 0.0


async def test_agents_under_a_trainer_reach_a_proxy_with_a_token(namespace: Settings) -> None:
    """Runner processes (``spawn``) get the proxy's token from the Trainer; every rollout succeeds
    with reward 1, and neither the resources nor the spans in the store hold the token."""
    tasks = ["one", "two", "three"]
    async with ScriptedLLM() as url:
        proxy = LLMProxy(model_list=model_list(url), token=TOKEN)
        trainer = agl.Trainer(
            algorithm=agl.Baseline(),
            n_runners=1,
            llm_proxy=proxy,
            settings=namespace,
            initial_resources={"main_llm": proxy.as_resource()},
        )
        assert trainer.runner.proxy_token == TOKEN
        await asyncio.wait_for(trainer.fit_async(ask_the_proxy, tasks), 120)
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.sync_all(timeout_s=30)
        rollouts = await store.query_rollouts()
        assert sorted(r.input for r in rollouts) == sorted(tasks)
        spans = [s for r in rollouts for s in await store.query_spans(r.rollout_id)]
        assert {r.status for r in rollouts} == {"succeeded"}
        assert [agl.find_final_reward(list(await store.query_spans(r.rollout_id))) for r in rollouts] == [1.0] * 3
        assert sum(s.name == "openai.chat.completion" for s in spans) == 3
        resources = await store.get_latest_resources()
        assert resources is not None
        dumped = msgspec.json.encode([resources, spans]).decode()
    assert TOKEN not in dumped
