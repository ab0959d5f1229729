"""The whole loop on real NATS and Postgres: Trainer + APO + LLM proxy + runner processes.

The LLM is a scripted OpenAI-compatible stand-in (``tests/llm_stub.py``) so the test is fast and
deterministic; ``make demo`` runs the same code with the real local model. The stand-in answers a
booking request correctly only when the prompt asks for "ONLY the room name", and APO's edit step
adds that sentence, so a working loop must find a better prompt than the seed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from llm_stub import ScriptedLLM

import eventlight as agl
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from examples.room_booking.agent import INITIAL_PROMPT, load_tasks, render_rooms, room_booker, split

pytestmark = pytest.mark.e2e

HINT = "Answer with ONLY the room name."


def make_llm(tasks: list[dict]) -> Any:
    expected = {render_rooms(t): t["expected_choice"] for t in tasks}

    def reply(messages: list[dict], request: dict) -> str:
        text = "\n".join(str(m.get("content") or "") for m in messages)
        if "# Critique" in text or "### CRITIQUE" in text:  # APO's edit step
            return INITIAL_PROMPT + "\n" + HINT
        if "critique" in text.lower():  # APO's critique step
            return "- The prompt never says how to answer; ask for the room name only."
        rooms = next((r for r in expected if r in text), None)  # the agent
        if rooms is None:
            return "I am not sure."
        if "ONLY" in text:
            return expected[rooms]
        first = re.search(r"- (\w+):", rooms)
        return f"{first.group(1) if first else 'none'} looks fine."

    return reply


async def test_apo_improves_the_prompt_through_the_whole_loop(namespace: Settings) -> None:
    tasks = load_tasks()[:12]
    train, val = split(tasks)
    async with ScriptedLLM(responses=make_llm(tasks)) as url:
        proxy = agl.LLMProxy(
            model_list=[
                {
                    "model_name": "stub",
                    "litellm_params": {"model": "openai/stub", "api_base": url, "api_key": "x"},
                }
            ]
        )
        from openai import AsyncOpenAI

        optimizer = AsyncOpenAI(base_url=url, api_key="x")
        events: list[dict] = []
        apo = agl.APO(
            optimizer,
            gradient_model="stub",
            apply_edit_model="stub",
            gradient_batch_size=2,
            val_batch_size=4,
            beam_width=1,
            branch_factor=1,
            beam_rounds=1,
            rollout_batch_timeout=120,
            progress=events.append,
        )
        trainer = agl.Trainer(
            algorithm=apo,
            n_runners=2,
            adapter=agl.TraceToMessages(),
            llm_proxy=proxy,
            settings=namespace,
            initial_resources={
                "prompt_template": agl.PromptTemplate(template=INITIAL_PROMPT),
                "main_llm": proxy.as_resource(model="stub"),
            },
        )
        await trainer.fit_async(room_booker, train, val_dataset=val)
        await optimizer.close()

    assert HINT in apo.get_best_prompt().template
    assert apo.seed_score < 1.0 and apo.best_score == pytest.approx(1.0)
    assert any(e.get("event") == "eval" for e in events)

    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.sync_all(timeout_s=30)
        rollouts = await store.query_rollouts()
        assert len(rollouts) >= len(val) + len(train) // 2
        assert {r.status for r in rollouts} == {"succeeded"}
        workers = {r.attempt.worker_id.partition("@")[0] for r in rollouts}
        assert workers == {"Worker-0", "Worker-1"}, "both runner processes should have claimed work"
        spans = await store.query_spans(rollouts[0].rollout_id)
        names = [s.name for s in spans]
        assert "openai.chat.completion" in names and "agentlightning.annotation" in names
        llm = next(s for s in spans if s.name == "openai.chat.completion")
        assert llm.attributes["gen_ai.request.model"] == "stub" and "gen_ai.completion.0.content" in llm.attributes
        assert [s.sequence_id for s in spans] == sorted(s.sequence_id for s in spans)
        assert agl.find_final_reward(spans) in (0.0, 1.0)
