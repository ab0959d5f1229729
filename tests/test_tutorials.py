"""The programs of Agent-lightning's seed tutorials run with only the import changed (issue 13).

Each program under ``examples/tutorials/`` is the tutorial's code with ``agentlightning`` replaced
by ``eventlight`` (elided helpers filled in, as each program's docstring says). Each runs here as
its own process, its OpenAI client pointed at the scripted stand-in (``OPENAI_BASE_URL``), its
trainer on a fresh namespace of the test session's NATS and Postgres (``EVENTLIGHT_*``); the test
checks the exit status, the program's last line and, where a trainer ran, the rollouts it left.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from llm_stub import Reply, ScriptedLLM, ToolCall

from eventlight.emitter import find_final_reward
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "examples" / "tutorials"


def reply(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
    text = str(messages[-1].get("content") or "")
    if request.get("tools") and not any(m.get("role") == "tool" for m in messages):
        return Reply(content=None, tool_calls=[ToolCall("get_rooms_and_availability", {"date": "2025-10-15"})])
    if messages[-1].get("role") == "tool":  # the room selector's second call, after its tool call
        return Reply(content="A103")
    if "Evaluate how well" in text:
        return Reply(content="0.9")
    if "critique" in text.lower() or "# Critique" in text:
        return Reply(content="- Ask for the room id only.")
    if "room" in text.lower() or "rooms" in text.lower():
        return Reply(content="A103")
    if "France" in text or "Paris" in text:
        return Reply(content="Paris")
    return Reply(content="The sky is blue because of Rayleigh scattering.")


async def run_program(namespace: Settings, url: str, *args: str, timeout_s: float = 240) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "EVENTLIGHT_", "OPENAI_"))}
    assert namespace.nats_url is not None and namespace.pg_dsn is not None
    env.update(
        OPENAI_BASE_URL=url,
        OPENAI_API_KEY="dummy",
        EVENTLIGHT_NATS_URL=namespace.nats_url,
        EVENTLIGHT_PG_DSN=namespace.pg_dsn,
        EVENTLIGHT_NAMESPACE=namespace.namespace,
        EVENTLIGHT_STATE_DIR=str(namespace.state_dir),
        PYTHONPATH=str(ROOT),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:  # timed out or cancelled: never leave the program running
            proc.kill()
            await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


async def rewards(namespace: Settings) -> list[tuple[str, float | None]]:
    async with JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        return [
            (r.status, find_final_reward(list(await store.query_spans(r.rollout_id))))
            for r in await store.query_rollouts()
        ]


async def test_write_agents(namespace: Settings) -> None:
    async with ScriptedLLM(responses=reply) as url:
        out = await run_program(namespace, url, str(TUTORIALS / "write_agents.py"))
    assert out.strip().endswith("write-agents: done")
    assert await rewards(namespace) == [("succeeded", 1.0)] * 5  # 2 + 2 rooms, 1 flight


async def test_emitter(namespace: Settings) -> None:
    out = await run_program(namespace, "http://127.0.0.1:9/v1", str(TUTORIALS / "emitter.py"))
    assert out.strip().endswith("emitter: final reward 1.0, 9 spans"), out[-2000:]
    assert "'server.port': 8080" in out and "custom-name" in out


async def test_debug(namespace: Settings) -> None:
    async with ScriptedLLM(responses=reply) as stub:
        out = await run_program(namespace, stub, str(TUTORIALS / "debug.py"))
    assert out.strip().endswith("debug: done")
    assert "Trace spans collected during the rollout:" in out and "status='succeeded'" in out
    assert await rewards(namespace) == [("succeeded", 0.9)] * 2


async def test_traces(namespace: Settings) -> None:
    async with ScriptedLLM(responses=reply) as url:
        out = await run_program(namespace, url, str(TUTORIALS / "traces.py"))
    assert "Final reward: 1.0" in out and "Paris" in out, out[-3000:]
    assert out.strip().endswith("spans, reward 1.0")


async def test_train_first_agent(namespace: Settings) -> None:
    async with ScriptedLLM(responses=reply) as url:
        out = await run_program(namespace, url, str(TUTORIALS / "train_first_agent.py"))
    assert out.strip().endswith("train-first-agent: done"), out[-3000:]
    done = await rewards(namespace)
    assert done and all(status == "succeeded" for status, _ in done), done
    assert any(reward == 1.0 for _, reward in done), done


async def test_write_first_algorithm(namespace: Settings) -> None:
    program = str(TUTORIALS / "write_first_algorithm.py")
    async with ScriptedLLM(responses=reply) as url:
        runner = asyncio.ensure_future(run_program(namespace, url, program, "runner", timeout_s=600))
        try:
            out = await run_program(namespace, url, program, "algo")
        finally:
            runner.cancel()  # the tutorial's runner polls forever; run_program kills its process
            await asyncio.gather(runner, return_exceptions=True)
    assert "[Algo] Best prompt found:" in out, out[-3000:]
    assert out.count("[Algo] Final reward: 0.") + out.count("[Algo] Final reward: 1.0") == 3, out[-3000:]
