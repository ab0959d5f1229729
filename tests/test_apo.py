"""Algorithms against the in-memory store: base class, ``@algo``, ``Baseline`` and ``APO`` end to end.

The "runners" here are asyncio tasks that dequeue rollouts, read the published prompt, record an
LLM-call span and a reward span (the ``emit_reward`` format) and finish the attempt. The reward is
1.0 when the prompt contains "ONLY", else 0.2, so the optimizer's edit (which adds "ONLY") wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from llm_stub import ScriptedLLM
from openai import APIConnectionError, AsyncOpenAI, NotFoundError

from eventlight.adapter import TracerTraceToTriplet, TraceToMessages
from eventlight.algorithm import (
    APO,
    Algorithm,
    Baseline,
    FastAlgorithm,
    FunctionalAlgorithm,
    RolloutResultForAPO,
    VersionedPromptTemplate,
    algo,
    batch_iter_over_dataset,
)
from eventlight.algorithm.apo import APPLY_EDIT_VARIANTS, EVIDENCE_CHAR_BUDGET, GRADIENT_VARIANTS
from eventlight.algorithm.baseline import format_span
from eventlight.core.errors import LLMUnavailableError
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES, AttemptedRollout, PromptTemplate, ProxyLLM, Span
from eventlight.net import free_port
from eventlight.store.base import LightningStore
from eventlight.store.memory import InMemoryLightningStore

SEED = "Pick a meeting room for this request: {task}"
RESOURCES = {
    "llm": ProxyLLM(endpoint="http://127.0.0.1:9/v1", model="agent-model"),
    "prompt": PromptTemplate(template=SEED, engine="f-string"),
}
TRAIN = [f"train-{i}" for i in range(5)]
VAL = [f"val-{i}" for i in range(4)]


# ------------------------------------------------------------------------------------------
# A fake runner


def prompt_reward(template: str) -> float:
    return 1.0 if "ONLY" in template else 0.2


async def record_span(store: LightningStore, ar: AttemptedRollout, name: str, attrs: dict[str, Any]) -> None:
    seq = await store.get_next_span_sequence_id(ar.rollout_id, ar.attempt.attempt_id)
    await store.add_span(
        Span.from_attributes(
            attributes=attrs,
            name=name,
            rollout_id=ar.rollout_id,
            attempt_id=ar.attempt.attempt_id,
            sequence_id=seq,
            start_time=float(seq),
            end_time=float(seq) + 0.5,
        )
    )


class FakeRunners:
    """Runner tasks; ``outcome(task, template)`` gives ``(reward, status)``, or ``None`` to never finish."""

    def __init__(self, store: LightningStore, outcome: Callable[[Any, str], tuple[float | None, str] | None]):
        self.store = store
        self.outcome = outcome
        self.seen_resources: list[dict[str, Any]] = []
        self.max_unfinished = 0
        self.templates: list[str] = []

    async def _unfinished(self) -> int:
        rollouts = await self.store.query_rollouts()
        return sum(r.status not in TERMINAL_ROLLOUT_STATUSES for r in rollouts)

    async def run_one(self, ar: AttemptedRollout) -> None:
        self.max_unfinished = max(self.max_unfinished, await self._unfinished())
        assert ar.resources_id is not None
        snapshot = await self.store.get_resources_by_id(ar.resources_id)
        assert snapshot is not None
        self.seen_resources.append(snapshot.resources)
        template = snapshot.resources["prompt"]
        assert isinstance(template, PromptTemplate)
        self.templates.append(template.template)
        outcome = self.outcome(ar.input, template.template)
        if outcome is None:
            return  # never finishes
        reward, status = outcome
        user = template.format(task=ar.input)
        await record_span(
            self.store,
            ar,
            "openai.chat.completion",
            {
                "gen_ai.prompt.0.role": "user",
                "gen_ai.prompt.0.content": user,
                "gen_ai.completion.0.role": "assistant",
                "gen_ai.completion.0.content": "Room Orion",
            },
        )
        if reward is not None:
            attrs = {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": reward}
            await record_span(self.store, ar, "agentlightning.annotation", attrs)
        await asyncio.sleep(0.002)
        await self.store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status=status)

    async def loop(self, worker_id: str) -> None:
        while True:
            ar = await self.store.dequeue_rollout(worker_id=worker_id)
            if ar is None:
                await asyncio.sleep(0.002)  # the fake runner polls; the algorithm under test does not
                continue
            await self.run_one(ar)


@contextlib.asynccontextmanager
async def running(runners: FakeRunners, n: int = 3) -> AsyncIterator[FakeRunners]:
    tasks = [asyncio.create_task(runners.loop(f"w{i}")) for i in range(n)]
    try:
        yield runners
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


def by_prompt(task: Any, template: str) -> tuple[float | None, str]:
    return prompt_reward(template), "succeeded"


# ------------------------------------------------------------------------------------------
# Fake optimizer clients


class _Choice:
    def __init__(self, content: str | None):
        self.message = type("Message", (), {"content": content})()


class FakeClient:
    """An AsyncOpenAI look-alike: ``reply(model, messages)`` returns the content or raises."""

    def __init__(self, reply: Callable[[str, list[dict[str, str]]], str | None]):
        self.calls: list[dict[str, Any]] = []
        self._reply = reply
        self.chat = type("Chat", (), {"completions": self})()

    async def create(self, *, model: str, messages: list[dict[str, str]], temperature: float) -> Any:
        self.calls.append({"model": model, "messages": messages, "temperature": temperature})
        return type("Completion", (), {"choices": [_Choice(self._reply(model, messages))]})()


def parent_template(messages: list[dict[str, str]]) -> str:
    """The template an apply-edit prompt shows (both rewrite variants)."""
    user = messages[-1]["content"]
    found = re.search(r"(?:# Prompt Template|### PROMPT)\n\n(.*)\n\n(?:# Critique|### CRITIQUE)", user, re.DOTALL)
    assert found, user
    return found.group(1)


def scripted(model: str, messages: list[dict[str, str]]) -> str:
    if model == "critic":
        return "- The answer format is loose: demand ONLY the room name."
    return parent_template(messages) + " Answer ONLY with the room name."


def make_apo(client: Any, **kwargs: Any) -> APO[str]:
    settings: dict[str, Any] = dict(
        gradient_model="critic",
        apply_edit_model="editor",
        gradient_batch_size=2,
        val_batch_size=3,
        beam_width=2,
        branch_factor=2,
        beam_rounds=2,
        rollout_batch_timeout=30.0,
    )
    settings.update(kwargs)
    apo: APO[str] = APO(client, **settings)
    apo.set_initial_resources(RESOURCES)
    apo.set_adapter(TraceToMessages())
    return apo


async def count_modes(store: LightningStore) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in await store.query_rollouts():
        counts[r.mode or ""] = counts.get(r.mode or "", 0) + 1
    return counts


# ------------------------------------------------------------------------------------------
# APO end to end


async def test_apo_finds_the_better_prompt_through_a_real_openai_client() -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses=lambda messages, body: scripted(body["model"], messages))
    events: list[dict[str, Any]] = []
    async with stub as url, running(FakeRunners(store, by_prompt)) as runners:
        client = AsyncOpenAI(base_url=url, api_key="test")
        try:
            apo = make_apo(client, progress=events.append)
            apo.set_store(store)
            await apo.run(train_dataset=TRAIN, val_dataset=VAL)
        finally:
            await client.close()

    best = apo.get_best_prompt()
    assert "ONLY" in best.template and best.template.startswith(SEED)
    assert best.engine == "f-string"
    assert apo.seed_score == pytest.approx(0.2)
    assert apo.best_score == pytest.approx(1.0) and apo.best_score > apo.seed_score
    # round 1: beam [v0] + children v1..v4 all 1.0 -> beam [v1, v2]; the leader v1 becomes best.
    # round 2: v1 stays leader with an equal score, and only a strictly better one would replace it.
    assert apo.best_version == "v1"

    # cost model (seed_algorithms.md 2.6): 2 rounds x beam_width 2 x branch_factor 2 = 8 critiques + 8 edits
    models = [body["model"] for body in stub.requests]
    assert models.count("critic") == 8 and models.count("editor") == 8
    assert all(body["temperature"] == 1.0 for body in stub.requests)
    # rollouts: |val| up front; per round 4 children x 2 train tasks, (|beam|+4) x 3 val, |val| for the leader
    assert await count_modes(store) == {"train": 8 + 8, "val": 4 + (5 * 3 + 4) + (6 * 3 + 4)}
    assert len(apo.history) == 1 + (4 + 5 + 1) + (4 + 6 + 1)
    assert apo.history[0] == ("v0", "val", pytest.approx(0.2), 4)

    # every rollout saw ALL initial resources, with the tuned template in place of the seed
    assert all(set(r) == {"llm", "prompt"} and r["llm"] == RESOURCES["llm"] for r in runners.seen_resources)
    v0 = await store.get_resources_by_id("v0")
    assert v0 is not None and v0.resources["prompt"] == RESOURCES["prompt"]

    # the critique prompt carries the parent template, rewards and the chat messages of the runs
    critique_prompts = [b["messages"] for b in stub.requests if b["model"] == "critic"]
    text = "\n".join(m["content"] for msgs in critique_prompts for m in msgs)
    assert SEED in text and "Room Orion" in text

    kinds = [e["event"] for e in events]
    assert kinds.count("candidate") == 8 and kinds.count("round") == 4
    assert [(e["round"], e["rounds"], e["phase"]) for e in events if e["event"] == "round"] == [
        (1, 2, "start"),
        (1, 2, "ranked"),
        (2, 2, "start"),
        (2, 2, "ranked"),
    ]
    rounds = [e["beam"] for e in events if e["event"] == "round" and e["phase"] == "ranked"]
    assert rounds == [[["v1", 1.0], ["v2", 1.0]]] * 2  # stable ranking: on ties the old beam stays first
    assert [(e["version"], e["score"]) for e in events if e["event"] == "best"] == [
        ("v0", pytest.approx(0.2)),
        ("v1", pytest.approx(1.0)),
    ]
    assert {
        "event": "eval",
        "version": "v0",
        "mode": "val",
        "score": pytest.approx(0.2),
        "n": 4,
        "requested": 4,
    } in events


async def test_apo_on_every_store_backend(store: Any) -> None:
    """One small round on the in-memory and the JetStream + Postgres stores (``conftest.store``)."""
    apo = make_apo(FakeClient(scripted), beam_width=1, branch_factor=1, beam_rounds=1, val_batch_size=2)
    apo.set_store(store)
    async with running(FakeRunners(store, by_prompt), n=2):
        await asyncio.wait_for(apo.run(train_dataset=TRAIN[:3], val_dataset=VAL[:2]), 120)
    assert "ONLY" in apo.get_best_prompt().template
    assert (apo.seed_score, apo.best_score) == (pytest.approx(0.2), pytest.approx(1.0))
    assert await count_modes(store) == {"train": 2, "val": 2 + 2 * 2 + 2}


async def test_two_runs_with_their_own_version_prefix_keep_each_others_prompts() -> None:
    """Runs do not mix: a second APO run in the same store publishes new resources, never over the first's."""
    store = InMemoryLightningStore()
    tuned: dict[str, str] = {}
    for run, edit in (("run-a-", " Answer ONLY with the room name."), ("run-b-", " Say ONLY the room.")):
        client = FakeClient(
            lambda model, messages, edit=edit: "critique" if model == "critic" else (parent_template(messages) + edit)
        )
        apo = make_apo(client, beam_width=1, branch_factor=1, beam_rounds=1, val_batch_size=2, version_prefix=run)
        apo.set_store(store)
        async with running(FakeRunners(store, by_prompt), n=2):
            await asyncio.wait_for(apo.run(train_dataset=TRAIN[:2], val_dataset=VAL[:2]), 60)
        assert apo.best_version is not None and apo.best_version.startswith(run)
        tuned[run] = apo.get_best_prompt().template
    ids = {r.resources_id for r in (await store.query_resources()).items}
    assert {"run-a-v0", "run-a-v1", "run-b-v0", "run-b-v1"} <= ids and "v0" not in ids
    first = await store.get_resources_by_id("run-a-v1")
    assert first is not None and first.resources["prompt"].template == tuned["run-a-"]
    assert tuned["run-a-"] != tuned["run-b-"]
    per_run = {r.resources_id.split("-v")[0] for r in (await store.query_rollouts()).items}
    assert per_run == {"run-a", "run-b"}


@pytest.mark.parametrize("bad", ["has space", "dot.ted", "wild*"])
def test_apo_refuses_a_version_prefix_that_is_not_an_id(bad: str) -> None:
    with pytest.raises(ValueError, match="version_prefix"):
        APO(FakeClient(scripted), version_prefix=bad)


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(lambda model, messages: (_ for _ in ()).throw(RuntimeError("optimizer down")), id="raises"),
        pytest.param(lambda model, messages: None, id="no-content"),
        pytest.param(lambda model, messages: "   ", id="blank"),
        pytest.param(
            lambda model, messages: "critique" if model == "critic" else "ONLY rooms for {request}",
            id="bad-placeholder",
        ),
        pytest.param(lambda model, messages: "critique" if model == "critic" else "ONLY {} rooms", id="positional"),
        pytest.param(lambda model, messages: "critique" if model == "critic" else "ONLY {task", id="unbalanced"),
        pytest.param(
            lambda model, messages: "critique" if model == "critic" else parent_template(messages),
            id="identical",
        ),
    ],
)
async def test_apo_survives_a_misbehaving_optimizer(
    reply: Callable[[str, list[dict[str, str]]], str | None],
) -> None:
    store = InMemoryLightningStore()
    client = FakeClient(reply)
    events: list[dict[str, Any]] = []
    apo = make_apo(client, progress=events.append)
    apo.set_store(store)
    async with running(FakeRunners(store, by_prompt)) as runners:
        await apo.run(train_dataset=TRAIN, val_dataset=VAL)

    assert apo.get_best_prompt() == RESOURCES["prompt"]
    assert apo.best_version == "v0" and apo.best_score == pytest.approx(0.2) == apo.seed_score
    assert set(runners.templates) == {SEED}
    assert [e["event"] for e in events].count("skip") == 8
    assert "candidate" not in [e["event"] for e in events]
    # the beam stays [v0], replicated into 2 parents x 2 branches: 4 gradient batches per round
    assert await count_modes(store) == {"train": 16, "val": 4 + 2 * (3 + 4)}
    assert len([c for c in client.calls if c["model"] == "critic"]) == 8


async def test_apo_stops_before_any_rollout_when_its_optimizer_takes_no_connection() -> None:
    """The README's trainer with nothing on its optimizer's port ran 45 s, logged 32 failed
    critiques and ended as if it had trained (a fresh-user run); it now stops before a rollout."""
    store = InMemoryLightningStore()
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    client = AsyncOpenAI(base_url=url, api_key="test", max_retries=0)
    apo = make_apo(client, gradient_model="gpt-5-mini")  # APO's default
    apo.set_store(store)
    try:
        with pytest.raises(LLMUnavailableError) as got:
            await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    finally:
        await client.close()
    message = str(got.value)
    assert f"APO's optimizer at {url}/ (models 'gpt-5-mini' and 'editor')" in message, message
    assert "APIConnectionError" in message and "APO's default gradient_model" in message, message
    assert "apply_edit_model" in message and "'editor' is" not in message, message
    assert await store.query_rollouts() == []


def _no_connection(model: str, messages: list[dict[str, str]]) -> str:
    raise APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions"))


def _unknown_model(model: str, messages: list[dict[str, str]]) -> str:
    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    raise NotFoundError("model not found", response=httpx.Response(404, request=request), body=None)


@pytest.mark.parametrize("reply", [_no_connection, _unknown_model], ids=["no-connection", "unknown-model"])
async def test_apo_stops_at_its_first_optimizer_call_when_that_cannot_succeed(
    reply: Callable[[str, list[dict[str, str]]], str],
) -> None:
    store = InMemoryLightningStore()
    client = FakeClient(reply)
    apo = make_apo(client)
    apo.set_store(store)
    async with running(FakeRunners(store, by_prompt)):
        with pytest.raises(LLMUnavailableError) as got:
            await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    message = str(got.value)
    assert "APO's optimizer at the optimizer client FakeClient (model 'critic'): critique call:" in message, message
    assert type(got.value.__cause__).__name__ in message and "default" not in message, message
    assert len(client.calls) == 1
    assert await count_modes(store) == {"val": 4, "train": 2}  # the seed's validation, one gradient batch


async def test_apo_stops_when_every_optimizer_call_of_a_round_fails(caplog: pytest.LogCaptureFixture) -> None:
    """Once the optimizer has answered, a call that cannot reach it skips its child; a round in
    which every call failed so ends the run."""
    answered: list[str] = []

    def first_then_gone(model: str, messages: list[dict[str, str]]) -> str:
        if answered:
            _no_connection(model, messages)
        answered.append(model)
        return "- demand ONLY the room name."

    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(first_then_gone))
    apo.set_store(store)
    async with running(FakeRunners(store, by_prompt)):
        with caplog.at_level(logging.ERROR, logger="eventlight.algorithm.apo.critic"):
            with pytest.raises(LLMUnavailableError, match="all 4 optimizer call.s. of round 2 failed"):
                await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    # round 1: a critique answered, its rewrite and the 3 other critiques failed and were skipped
    assert [r.getMessage().split("] ")[1].split(" call")[0] for r in caplog.records][:4] == [
        "rewrite",
        "critique",
        "critique",
        "critique",
    ]
    assert apo.best_version == "v0"


def _optimizer(answer: Callable[[dict[str, Any]], httpx.Response], max_retries: int) -> AsyncOpenAI:
    """A real OpenAI client whose ``POST /chat/completions`` gets ``answer(body)`` (``GET /models``: 200)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": []})
        return answer(json.loads(request.content))

    http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return AsyncOpenAI(base_url="http://optimizer.test/v1", api_key="test", max_retries=max_retries, http_client=http)


def _bad_gateway(body: dict[str, Any]) -> httpx.Response:
    error = {"error": {"message": "upstream connect error", "type": "proxy_error"}}
    return httpx.Response(502, json=error, headers={"retry-after-ms": "1"})  # the SDK's retry waits 1 ms


def _completion(body: dict[str, Any]) -> httpx.Response:
    message = {"role": "assistant", "content": scripted(body["model"], body["messages"])}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return httpx.Response(
        200,
        json={"id": "c", "object": "chat.completion", "created": 0, "model": body["model"], "choices": [choice]},
    )


async def test_apo_stops_when_its_optimizer_answers_5xx_a_whole_round() -> None:
    """A proxy whose backend is down answers 502 to every call. A 5xx was no "unusable" failure, so
    such a run went on to its end, one logged failure per child; a round of nothing but 5xx answers
    (each after the SDK's own retries) now stops it, naming the status, the endpoint and the model."""
    tries: list[str] = []

    def bad_gateway(body: dict[str, Any]) -> httpx.Response:
        tries.append(body["model"])
        return _bad_gateway(body)

    store = InMemoryLightningStore()
    client = _optimizer(bad_gateway, max_retries=1)
    apo = make_apo(client)
    apo.set_store(store)
    try:
        async with running(FakeRunners(store, by_prompt)):
            with pytest.raises(LLMUnavailableError) as got:
                await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    finally:
        await client.close()
    message = str(got.value)
    assert "APO's optimizer at http://optimizer.test/v1/ (models 'critic' and 'editor')" in message, message
    assert (
        "all 4 optimizer call(s) of round 1 failed, the last: critique call to 'critic': HTTP 502, "
        "InternalServerError: Error code: 502" in message
    ), message
    assert tries == ["critic"] * 4 * 2  # 4 critiques (no rewrite follows a failed one), each tried twice
    assert await count_modes(store) == {"val": 4, "train": 8}  # the seed's validation, round 1's batches


async def test_one_5xx_of_the_optimizer_stops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A 5xx may pass: one at the run's very first optimizer call, the next answered, skips a child only."""
    answered: list[str] = []

    def once_bad(body: dict[str, Any]) -> httpx.Response:
        answered.append(body["model"])
        return _bad_gateway(body) if len(answered) == 1 else _completion(body)

    store = InMemoryLightningStore()
    client = _optimizer(once_bad, max_retries=0)
    apo = make_apo(client)
    apo.set_store(store)
    try:
        async with running(FakeRunners(store, by_prompt)):
            with caplog.at_level(logging.ERROR, logger="eventlight.algorithm.apo.critic"):
                await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    finally:
        await client.close()
    assert "ONLY" in apo.get_best_prompt().template and apo.best_score == pytest.approx(1.0)
    failed = [r.getMessage() for r in caplog.records]
    assert len(failed) == 1 and "critique call to critic failed: InternalServerError: Error code: 502" in failed[0]
    assert len(answered) == 8 + 7  # 8 critiques, 7 rewrites: the first critique's child was skipped


async def test_a_short_gradient_batch_is_warned_once_per_round(caplog: pytest.LogCaptureFixture) -> None:
    """A train set smaller than ``gradient_batch_size`` makes every batch short: the warning came once
    per child (4 a round here); it comes once per round."""
    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(scripted))  # gradient_batch_size=2; 2 rounds of 2 parents x 2 children
    apo.set_store(store)
    async with running(FakeRunners(store, by_prompt)):
        with caplog.at_level(logging.WARNING, logger="eventlight.algorithm.apo.critic"):
            await apo.run(train_dataset=TRAIN[:1], val_dataset=VAL)
    warned = [r.getMessage() for r in caplog.records if "for a gradient batch" in r.getMessage()]
    assert [w.split(" | ")[0] for w in warned] == ["[Round 01", "[Round 02"], warned
    assert all(w.endswith("] only 1 results for a gradient batch of 2 (warned once per round)") for w in warned)


async def test_apo_strips_a_code_fence_and_keeps_valid_children() -> None:
    def fenced(model: str, messages: list[dict[str, str]]) -> str:
        return "critique" if model == "critic" else "```text\nAnswer ONLY with a room for {task}\n```"

    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(fenced), beam_rounds=1, run_initial_validation=False)
    apo.set_store(store)
    async with running(FakeRunners(store, by_prompt)):
        await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    assert apo.get_best_prompt().template == "Answer ONLY with a room for {task}"
    assert apo.seed_score is None and apo.best_score == pytest.approx(1.0)


async def test_apo_with_nothing_to_gain_keeps_the_seed_on_ties() -> None:
    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(scripted), beam_rounds=1)
    apo.set_store(store)
    async with running(FakeRunners(store, lambda task, template: (0.5, "succeeded"))):
        await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    assert apo.best_version == "v0" and apo.get_best_prompt().template == SEED  # strict > only


async def test_apo_score_counts_none_as_zero_and_includes_failed_rollouts() -> None:
    outcomes = {
        "a": (1.0, "succeeded"),
        "b": (None, "succeeded"),
        "c": (None, "failed"),
        "d": (0.5, "succeeded"),
    }
    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(scripted))
    apo.set_store(store)
    seed = apo._new_version(RESOURCES["prompt"])  # noqa: SLF001 - exercise one evaluation directly
    async with running(FakeRunners(store, lambda task, template: outcomes[task])):
        results, score = await apo.evaluate_prompt_on_batch(seed, "prompt", ["a", "b", "c", "d"], "val")
    assert score == pytest.approx((1.0 + 0 + 0 + 0.5) / 4)
    assert [(r["status"], r["final_reward"]) for r in results] == [
        ("succeeded", 1.0),
        ("succeeded", None),
        ("failed", None),
        ("succeeded", 0.5),
    ]
    assert results[0]["messages"][0]["messages"][-1] == {"role": "assistant", "content": "Room Orion"}
    assert [s["name"] for s in results[0]["spans"]] == ["openai.chat.completion", "agentlightning.annotation"]


async def test_apo_drops_and_cancels_rollouts_that_miss_the_batch_timeout() -> None:
    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(scripted), rollout_batch_timeout=1.0)
    apo.set_store(store)
    seed = apo._new_version(RESOURCES["prompt"])  # noqa: SLF001
    outcome = lambda task, template: None if task == "stuck" else (1.0, "succeeded")  # noqa: E731
    async with running(FakeRunners(store, outcome), n=1):
        results, score = await apo.evaluate_prompt_on_batch(seed, "prompt", ["ok", "stuck", "ok"], "train")
    assert len(results) == 2 and score == pytest.approx(1.0)
    rollouts = await store.query_rollouts()
    assert sorted(r.status for r in rollouts) == ["cancelled", "succeeded", "succeeded"]
    [cancelled] = [r for r in rollouts if r.status == "cancelled"]
    # who cancelled it and why, as GRPO's give-up cancel says, its own metadata kept
    assert cancelled.metadata["cancelled_by"] == {
        "pid": os.getpid(),
        "reason": "APO evaluation: not finished within rollout_batch_timeout=1 s",
    }


async def test_apo_batches_run_concurrently_on_the_runners() -> None:
    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(scripted))
    apo.set_store(store)
    seed = apo._new_version(RESOURCES["prompt"])  # noqa: SLF001
    runners = FakeRunners(store, by_prompt)
    async with running(runners, n=4):
        await apo.evaluate_prompt_on_batch(seed, "prompt", ["a", "b", "c", "d", "e", "f"], "val")
    assert runners.max_unfinished >= 4  # the whole batch was enqueued before any finished


async def test_apo_rejects_bad_setups() -> None:
    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(scripted))
    apo.set_store(store)
    with pytest.raises(ValueError):
        await apo.run(train_dataset=TRAIN, val_dataset=None)
    with pytest.raises(ValueError):
        await apo.run(train_dataset=[], val_dataset=VAL)
    apo.set_adapter(TracerTraceToTriplet())
    with pytest.raises(ValueError, match="TraceToMessages"):
        await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    apo.set_adapter(TraceToMessages())
    apo.set_initial_resources({"llm": RESOURCES["llm"]})
    with pytest.raises(ValueError, match="No prompt template"):
        await apo.run(train_dataset=TRAIN, val_dataset=VAL)
    with pytest.raises(ValueError, match="No best prompt"):
        APO(FakeClient(scripted)).get_best_prompt()
    with pytest.raises(ValueError):
        APO(FakeClient(scripted), beam_width=0)
    assert len(await store.query_rollouts()) == 0
    assert apo.is_async()


# ------------------------------------------------------------------------------------------
# Optimizer prompts


@pytest.mark.parametrize("variant", GRADIENT_VARIANTS, ids=["variant01", "variant02", "variant03"])
def test_critique_prompts_stay_small_and_keep_the_template_verbatim(variant: Any) -> None:
    big = "x" * 20_000
    spans = [{"name": f"span-{i}", "attributes": {"gen_ai.prompt.0.content": big}} for i in range(10)]
    messages: list[Any] = [{"messages": [{"role": "user", "content": big}], "tools": None}]
    run = RolloutResultForAPO(status="failed", final_reward=None, spans=spans, messages=messages)
    template = 'Room for {task}; reply as {{"room": "..."}}'
    rendered = variant(template, [run] * 4, EVIDENCE_CHAR_BUDGET)
    text = "\n".join(m["content"] for m in rendered)
    assert template in text
    assert len(text) < EVIDENCE_CHAR_BUDGET + 2_500
    assert [m["role"] for m in rendered][-1] == "user"
    if variant is GRADIENT_VARIANTS[1]:
        assert text.count('"name":"span-') == 4 * 4  # at most 4 spans per run
        assert '"name":"span-9"' in text and '"name":"span-5"' not in text  # the last ones


@pytest.mark.parametrize("variant", APPLY_EDIT_VARIANTS, ids=["variant01", "variant02"])
def test_rewrite_prompts_have_system_and_user_messages(variant: Any) -> None:
    rendered = variant("Room for {task}", "- be terse")
    assert [m["role"] for m in rendered] == ["system", "user"]
    assert "Room for {task}" in rendered[1]["content"] and "- be terse" in rendered[1]["content"]
    assert parent_template(rendered) == "Room for {task}"


CRITIQUE_FILE = """MY CRITIC. Template:
{prompt_template}
Runs with messages:
{experiments}
Runs with spans (at most {max_spans} a run, {max_chars} chars each):
{runs}
Reply as JSON: {{"critique": "..."}}"""
EDIT_FILE = "MY EDITOR.\n\n# Prompt Template\n\n{prompt_template}\n\n# Critique\n\n{critique}"


async def test_apo_sends_the_prompts_of_its_prompt_files(tmp_path: Any) -> None:
    """``gradient_prompt_files`` / ``apply_edit_prompt_files`` (Agent-lightning's documented
    arguments) were refused with a TypeError; their templates now replace the built-in variants,
    each rendered as one user message with every placeholder filled."""
    (tmp_path / "critic.txt").write_text(CRITIQUE_FILE, encoding="utf-8")
    (tmp_path / "edit.md").write_text(EDIT_FILE, encoding="utf-8")
    store = InMemoryLightningStore()
    client = FakeClient(scripted)
    apo = make_apo(
        client,
        gradient_prompt_files=[str(tmp_path / "critic.txt")],
        apply_edit_prompt_files=(tmp_path / "edit.md",),
    )
    apo.set_store(store)
    async with running(FakeRunners(store, by_prompt)):
        await asyncio.wait_for(apo.run(train_dataset=TRAIN, val_dataset=VAL), 60)
    assert "ONLY" in apo.get_best_prompt().template  # the run still optimizes

    critiques = [c["messages"] for c in client.calls if c["model"] == "critic"]
    edits = [c["messages"] for c in client.calls if c["model"] == "editor"]
    assert len(critiques) == len(edits) == 8
    assert all([m["role"] for m in msgs] == ["user"] for msgs in critiques + edits)  # no built-in system prompt
    for msgs in critiques:
        text = msgs[0]["content"]
        assert text.startswith("MY CRITIC. Template:\n")
        assert "## Experiment 1" in text and "## Sample Run #1 Diagnostics" in text and "Room Orion" in text
        assert "(at most 4 a run, " in text and text.endswith('Reply as JSON: {"critique": "..."}')
    assert SEED in critiques[0][0]["content"]
    for msgs in edits:
        text = msgs[0]["content"]
        assert text.startswith("MY EDITOR.\n\n# Prompt Template\n\n")
        assert text.endswith("# Critique\n\n- The answer format is loose: demand ONLY the room name.")


async def test_prompt_files_are_picked_at_random_per_call(tmp_path: Any) -> None:
    """As the built-in variants: one file drawn uniformly per critique call."""
    paths = []
    for name in ("a", "b", "c"):
        paths.append(tmp_path / f"{name}.txt")
        paths[-1].write_text(name.upper() + " {prompt_template}\n{experiments}", encoding="utf-8")
    client = FakeClient(lambda model, messages: "critique")
    apo = APO(client, gradient_batch_size=1, gradient_prompt_files=paths)
    run = RolloutResultForAPO(status="succeeded", final_reward=1.0, spans=[], messages=[])
    parent = VersionedPromptTemplate(version="v0", prompt_template=PromptTemplate(template="T", engine="f-string"))
    for _ in range(60):
        assert await apo.compute_textual_gradient(parent, [run]) == "critique"
    firsts = {c["messages"][0]["content"].split("\n")[0] for c in client.calls}
    assert firsts == {"A T", "B T", "C T"}  # 3 * (2/3)**60: ~1e-10
    assert apo.apply_edit_variants == APPLY_EDIT_VARIANTS  # the other kind keeps the built-ins
    assert APO(client, gradient_prompt_files=[]).gradient_variants == GRADIENT_VARIANTS
    assert APO(client, apply_edit_prompt_files=None).apply_edit_variants == APPLY_EDIT_VARIANTS


# ------------------------------------------------------------------------------------------
# Baseline


async def test_baseline_runs_every_item_with_a_bounded_queue(caplog: pytest.LogCaptureFixture) -> None:
    store = InMemoryLightningStore()
    baseline = Baseline(n_epochs=2, max_queue_length=2, span_verbosity="key_values")
    baseline.set_store(store)
    baseline.set_initial_resources(RESOURCES)
    baseline.set_adapter(TracerTraceToTriplet())
    runners = FakeRunners(store, by_prompt)
    with caplog.at_level(logging.INFO, logger="eventlight.algorithm.baseline"):
        async with running(runners, n=3):
            await asyncio.wait_for(baseline.run(train_dataset=TRAIN[:3], val_dataset=VAL[:2]), 60)

    rollouts = await store.query_rollouts()
    assert [r.mode for r in rollouts] == ["train"] * 3 + ["val"] * 2 + ["train"] * 3 + ["val"] * 2
    assert [r.input for r in rollouts[:5]] == TRAIN[:3] + VAL[:2]
    assert all(r.status == "succeeded" and r.resources_id == "default" for r in rollouts)
    assert 1 <= runners.max_unfinished <= 2
    default = await store.get_resources_by_id("default")
    assert default is not None and default.resources == RESOURCES
    assert caplog.text.count("Adapted data: [Triplet(") == 10
    assert caplog.text.count("(agentlightning.annotation) From ") == 10
    assert "'agentlightning.reward.0.value': 0.2" in caplog.text
    assert isinstance(baseline, FastAlgorithm)


async def test_baseline_without_resources_or_data(caplog: pytest.LogCaptureFixture) -> None:
    store = InMemoryLightningStore()
    baseline = Baseline()
    baseline.set_store(store)
    with caplog.at_level(logging.INFO):
        await baseline.run()
        assert "empty" in caplog.text
        async with running(FakeRunners(store, lambda task, template: (1.0, "succeeded"))):
            await store.update_resources("other", RESOURCES)
            await asyncio.wait_for(baseline.run(train_dataset=["x"]), 30)
    assert "no initial resources" in caplog.text
    (rollout,) = await store.query_rollouts()
    assert rollout.resources_id == "other"  # the store's latest resources at enqueue time
    with pytest.raises(ValueError):
        Baseline(train_split=1.0)


async def test_baseline_stops_with_a_harvest_error_instead_of_losing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished rollout whose logging failed (here a store read) was dropped with its error when
    its harvest ended while the queue was full (``asyncio.wait``'s finished set went unread), and
    the run went on as if all was logged. Now the run stops with the error, a note naming the
    rollout, as Agent-lightning's ``Baseline`` (``asyncio.gather`` of the harvests) does."""
    store = InMemoryLightningStore()
    baseline = Baseline(max_queue_length=1)
    baseline.set_store(store)
    baseline.set_initial_resources(RESOURCES)
    query_attempts = store.query_attempts
    failed: list[str] = []

    async def first_read_fails(rollout_id: str, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(rollout_id)
            raise RuntimeError("the store broke")
        return await query_attempts(rollout_id, *args, **kwargs)

    monkeypatch.setattr(store, "query_attempts", first_read_fails)
    async with running(FakeRunners(store, by_prompt), n=1):
        with pytest.raises(RuntimeError, match="the store broke") as got:
            await asyncio.wait_for(baseline.run(train_dataset=TRAIN[:3]), 30)
    assert got.value.__notes__ == [f"(Baseline was logging rollout {failed[0]})"]


def test_baseline_logs_a_span_time_that_is_no_time_in_seconds_as_it_is() -> None:
    """A span timed in nanoseconds (a common slip) made ``format_span`` raise (``datetime`` has no
    year 55,000), so its rollout's remaining spans and adapted data were never logged."""
    span = Span.from_attributes(
        attributes={"k": 1}, name="n", rollout_id="r", attempt_id="a", sequence_id=1, start_time=1.7e18, end_time=1.7e18
    )
    line = format_span(span, "keys")
    assert "From 1.7e+18, to 1.7e+18, 0.000 seconds. Attribute keys: ['k']" in line
    span.start_time = 0.0
    assert "From 1970-01-01T00:00:00+00:00, to 1.7e+18" in format_span(span, "keys")


# ------------------------------------------------------------------------------------------
# Algorithm base and @algo


def test_algorithm_getters_and_references() -> None:
    alg = Algorithm()
    with pytest.raises(ValueError):
        alg.get_store()
    with pytest.raises(ValueError):
        alg.get_adapter()
    with pytest.raises(ValueError):
        alg.get_trainer()
    assert alg.get_llm_proxy() is None and alg.get_initial_resources() is None

    class Trainer:
        pass

    trainer = Trainer()
    alg.set_trainer(trainer)
    assert alg.get_trainer() is trainer
    del trainer
    gc.collect()
    with pytest.raises(ValueError):
        alg.get_trainer()  # held weakly
    alg.set_adapter(TraceToMessages())  # a temporary: held strongly on purpose
    gc.collect()
    assert isinstance(alg.get_adapter(), TraceToMessages)
    with pytest.raises(NotImplementedError):
        alg.run()
    assert not alg.is_async()


async def test_algo_injects_by_parameter_name() -> None:
    store = InMemoryLightningStore()
    seen: dict[str, Any] = {}

    @algo
    async def my_algorithm(*, store: Any, initial_resources: Any, llm_proxy: Any, train_dataset: Any = None) -> None:
        seen.update(store=store, initial_resources=initial_resources, llm_proxy=llm_proxy, train=train_dataset)
        await store.enqueue_rollout(input=train_dataset[0], mode="train")

    assert isinstance(my_algorithm, FunctionalAlgorithm) and my_algorithm.is_async()
    assert my_algorithm.__name__ == "my_algorithm"
    my_algorithm.set_store(store)
    await my_algorithm.run(train_dataset=["t"])
    assert seen == {"store": store, "initial_resources": None, "llm_proxy": None, "train": ["t"]}
    assert len(await store.query_rollouts()) == 1
    with pytest.raises(TypeError):
        my_algorithm.run(train_dataset=["t"], val_dataset=["v"])

    @algo
    def sync_algorithm(adapter: Any) -> str:
        return type(adapter).__name__

    assert not sync_algorithm.is_async()
    with pytest.raises(ValueError):
        sync_algorithm.run()  # adapter unset
    sync_algorithm.set_adapter(TraceToMessages())
    assert sync_algorithm.run() == "TraceToMessages"
    assert sync_algorithm("raw") == "str"  # calling the object calls the function itself


def test_batch_iter_over_dataset() -> None:
    import random

    rng = random.Random(0)
    whole = batch_iter_over_dataset([1, 2, 3], 5, rng)
    for _ in range(3):
        assert sorted(next(whole)) == [1, 2, 3]
    batches = batch_iter_over_dataset(list(range(5)), 2, rng)
    seen = [next(batches) for _ in range(10)]
    assert all(len(b) == 2 and len(set(b)) == 2 for b in seen)
    assert {x for b in seen[:3] for x in b} == set(range(5))  # the first epoch is used up before repeats
    with pytest.raises(ValueError):
        next(batch_iter_over_dataset([], 2))


async def test_append_mode_adds_one_sentence_and_keeps_placeholders() -> None:
    from eventlight.algorithm.apo.prompts import _appended

    assert _appended("Q: {q}", '"Answer with {one} word."\nextra') == "Q: {q}\nAnswer with {{one}} word."
    assert _appended("Q: {q}", "  \n") is None
    with pytest.raises(ValueError, match="edit_mode"):
        APO(object(), edit_mode="shuffle")  # type: ignore[arg-type]


async def test_apo_does_not_cancel_again_rollouts_cancelled_before_any_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rollout cancelled in the queue (another run's cleanup) ends the batch's wait with no
    record (the subscription's ``unattempted``); ``finished`` left it out, so the batch warned it was
    unfinished and cancelled it a second time. It is counted ended now: no warning, no second
    cancel, and no result."""
    store = InMemoryLightningStore()
    apo = make_apo(FakeClient(scripted), rollout_batch_timeout=30.0)
    apo.set_store(store)
    seed = apo._new_version(RESOURCES["prompt"])  # noqa: SLF001
    cancels: list[str] = []
    update_rollout = store.update_rollout

    async def spy(rollout_id: str, **kwargs: Any) -> Any:
        if kwargs.get("status") == "cancelled":
            cancels.append(rollout_id)
        return await update_rollout(rollout_id, **kwargs)

    store.update_rollout = spy  # type: ignore[method-assign]

    enqueue_many = store.enqueue_many_rollouts

    async def enqueue_then_cancel(requests: Any) -> Any:  # cancelled in the queue, before any runner took it
        made = await enqueue_many(requests)
        await store.update_rollout(made[0].rollout_id, status="cancelled")
        return made

    store.enqueue_many_rollouts = enqueue_then_cancel  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        results, _ = await asyncio.wait_for(apo.evaluate_prompt_on_batch(seed, "prompt", ["gone"], "train"), 20)
    assert results == [] and len(cancels) == 1  # the outside cancel only
    assert "unfinished" not in caplog.text
