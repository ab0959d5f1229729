"""VERL's data path on the CPU: spans → the real adapter → triplets → verl's ``DataProto``.

Multi-turn rollouts with tool outputs between turns, several tasks × several samples, an attempt
without token ids, an over-long prompt, an empty batch; the tensors are checked exactly, and verl's
own GRPO advantage runs on the batch. Also the config, the store side (``VerlDaemon``) on the
in-memory store, and ``VERL.run``'s refusal without a GPU.

Skipped without torch and verl (``make verl`` installs verl's CPU part).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the VERL data path needs torch (make rl)")
pytest.importorskip("verl", reason="verl is not installed (make verl installs its CPU part)")
pytest.importorskip("transformers", reason="the test tokenizer needs transformers (make rl)")

from rl_tiny import tiny_tokenizer  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402

import eventlight as agl  # noqa: E402
from eventlight.core.errors import InvalidInputError  # noqa: E402
from eventlight.core.types import Span  # noqa: E402
from eventlight.verl.batch import EmptyBatchError, Trajectory, build_batch  # noqa: E402
from eventlight.verl.config import VerlSettings, verl_config  # noqa: E402
from eventlight.verl.daemon import VerlDaemon  # noqa: E402
from eventlight.verl.requirements import VerlUnavailableError  # noqa: E402

P, R = 48, 40


@pytest.fixture(scope="module")
def tok() -> Any:
    t = tiny_tokenizer()
    t.add_special_tokens({"additional_special_tokens": ["<system>", "<user>", "<assistant>", "<tool>"]})
    return t


def _prompt(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _answer(tok: Any, text: str) -> list[int]:
    """What vLLM returns as the response ids: the text's tokens and the end-of-turn token."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def _spans(
    rid: str, calls: list[tuple[list[int] | None, list[int] | None]], reward: float | None, attempt_id: str = "at-1"
) -> list[Span]:
    def span(sid: str, name: str, parent: str | None, t: float, **attrs: Any) -> Span:
        return Span.from_attributes(
            attributes=attrs,
            rollout_id=rid,
            attempt_id=attempt_id,
            sequence_id=int(t),
            name=name,
            trace_id="t" * 32,
            span_id=sid,
            parent_id=parent,
            start_time=t,
            end_time=t + 0.5,
        )

    out = [span("root", "session", None, 0.0)]
    for i, (prompt, response) in enumerate(calls):
        ids = {} if prompt is None else {"prompt_token_ids": prompt, "response_token_ids": response}
        out.append(
            span(f"llm-{i}", "openai.chat.completion", "root", 1.0 + i, **{"gen_ai.response.id": f"{rid}-{i}"}, **ids)
        )
    if reward is not None:
        out.append(
            span(
                "reward",
                "agentlightning.annotation",
                "root",
                9.0,
                **{
                    "agentlightning.reward.0.name": "primary",
                    "agentlightning.reward.0.value": reward,
                },
            )
        )
    return out


def _tool_rollout(tok: Any, question: str, result: str, final: str) -> list[tuple[list[int], list[int]]]:
    """Two turns: a tool call, the tool's output, the answer; the second prompt extends the first."""
    messages = [{"role": "user", "content": question}]
    p1, r1 = _prompt(tok, messages), _answer(tok, "call add")
    messages += [{"role": "assistant", "content": "call add"}, {"role": "tool", "content": result}]
    p2, r2 = _prompt(tok, messages), _answer(tok, final)
    assert p2[: len(p1) + len(r1)] == p1 + r1  # the template re-renders the first answer as vLLM returned it
    return [(p1, r1), (p2, r2)]


def _trajectories(tok: Any) -> tuple[list[Trajectory], dict[str, list[tuple[list[int], list[int]]]]]:
    """2 tasks × 3 samples, multi-turn, rewards differing inside each group; plus two bad attempts."""
    adapter = agl.TracerTraceToTriplet()
    out, calls_of = [], {}
    for task, (a, b) in enumerate([(2, 3), (4, 4)]):
        for k, (final, reward) in enumerate([(str(a + b), 1.0), ("9", 0.0), (str(a + b) + " ok", 0.5)]):
            rid = f"ro-{task}-{k}"
            calls = _tool_rollout(tok, f"{a} + {b}?", str(a + b), final)
            calls_of[rid] = calls
            triplets = adapter.adapt(_spans(rid, calls, reward))
            out.append(Trajectory(rid, f"task-{task}", triplets, triplets[-1].reward))
    no_ids = adapter.adapt(_spans("ro-noids", [(None, None)], 1.0))
    out.append(Trajectory("ro-noids", "task-0", no_ids, 1.0))
    long_prompt = _prompt(tok, [{"role": "user", "content": "1 + 1? " * 10}])
    assert len(long_prompt) > P
    long = adapter.adapt(_spans("ro-long", [(long_prompt, _answer(tok, "2"))], 1.0))
    out.append(Trajectory("ro-long", "task-1", long, 1.0))
    return out, calls_of


def test_transition_batch_is_exact(tok: Any) -> None:
    trajectories, calls_of = _trajectories(tok)
    counters: Counter[str] = Counter()
    batch = build_batch(
        trajectories, max_prompt_length=P, max_response_length=R, pad_token_id=tok.pad_token_id, counters=counters
    )
    assert isinstance(batch, DataProto)
    assert counters == {"rollouts": 8, "no_token_ids": 1, "prompt_too_long": 1, "no_triplets": 2}
    assert batch.meta_info["counters"] == dict(counters)
    b, nt = batch.batch, batch.non_tensor_batch
    assert len(batch) == 12  # 6 rollouts × 2 turns; the two bad attempts left nothing
    assert b["prompts"].shape == (12, P) and b["responses"].shape == (12, R) and b["input_ids"].shape == (12, P + R)
    rewards = {"0": 1.0, "1": 0.0, "2": 0.5}
    for row in range(12):
        rid, turn = nt["rollout_id"][row], int(nt["turn_index"][row])
        prompt, response = calls_of[rid][turn]
        n_p, n_r = len(prompt), len(response)
        assert nt["uid"][row] == "task-" + rid.split("-")[1]
        assert b["prompts"][row].tolist() == [tok.pad_token_id] * (P - n_p) + prompt  # left-padded
        assert b["responses"][row].tolist() == response + [tok.pad_token_id] * (R - n_r)  # right-padded
        assert b["attention_mask"][row].tolist() == [0] * (P - n_p) + [1] * (n_p + n_r) + [0] * (R - n_r)
        assert b["response_mask"][row].tolist() == [1] * n_r + [0] * (R - n_r)
        assert b["position_ids"][row, P - n_p :].tolist()[: n_p + n_r] == list(range(n_p + n_r))
        expected = torch.zeros(R)
        expected[n_r - 1] = rewards[rid.split("-")[2]]  # on the last response token only
        assert torch.equal(b["token_level_scores"][row], expected) and torch.equal(b["rm_scores"][row], expected)
    # verl's own GRPO groups by uid: within a task, reward 1.0 > 0.5 > 0.0 and the means cancel
    adv, _ = compute_grpo_outcome_advantage(b["token_level_scores"], b["response_mask"], nt["uid"])
    per_row = (adv * b["response_mask"]).sum(-1) / b["response_mask"].sum(-1)
    for task in ("task-0", "task-1"):
        rows = [i for i in range(12) if nt["uid"][i] == task]
        by_reward = {float(b["token_level_scores"][i].sum()): float(per_row[i]) for i in rows}
        assert by_reward[1.0] > by_reward[0.5] > by_reward[0.0]
        assert sum(float(per_row[i]) for i in rows) == pytest.approx(0.0, abs=1e-4)


def test_trajectory_merge_masks_exactly_the_model_tokens(tok: Any) -> None:
    trajectories, calls_of = _trajectories(tok)
    # a rollout whose second prompt was rewritten (not an extension) stays two samples
    (p1, r1), (p2, r2) = calls_of["ro-0-0"]
    broken = agl.TracerTraceToTriplet().adapt(_spans("ro-broken", [(p1, r1), (p1[:-1] + p2[len(p1) :], r2)], 0.2))
    counters: Counter[str] = Counter()
    batch = build_batch(
        trajectories + [Trajectory("ro-broken", "task-0", broken, 0.2)],
        max_prompt_length=P,
        max_response_length=R,
        pad_token_id=tok.pad_token_id,
        level="trajectory",
        counters=counters,
    )
    assert counters["unmerged_turns"] == 1 and counters["prompt_too_long"] == 1
    b, nt = batch.batch, batch.non_tensor_batch
    assert len(batch) == 6 + 2 and set(nt["turn_index"].tolist()) == {-1}
    for row in range(6):
        (p1, r1), (p2, r2) = calls_of[nt["rollout_id"][row]]
        between = p2[len(p1) + len(r1) :]
        assert re.fullmatch(r"<tool>\d+<eos><assistant>", tok.decode(between))  # tool output + template
        response = r1 + between + r2
        n = len(response)
        assert b["prompts"][row].tolist() == [tok.pad_token_id] * (P - len(p1)) + p1
        assert b["responses"][row].tolist() == response + [tok.pad_token_id] * (R - n)
        assert b["response_mask"][row].tolist() == [1] * len(r1) + [0] * len(between) + [1] * len(r2) + [0] * (R - n)
        assert b["attention_mask"][row, P:].tolist() == [1] * n + [0] * (R - n)
        assert float(b["token_level_scores"][row, n - 1]) == float(b["token_level_scores"][row].sum())
    assert sorted(nt["rollout_id"][6:].tolist()) == ["ro-broken", "ro-broken"]


def test_bad_input_is_skipped_counted_or_refused(tok: Any) -> None:
    kw: dict[str, Any] = {"max_prompt_length": 8, "max_response_length": 3, "pad_token_id": 0}
    with pytest.raises(EmptyBatchError, match="no trainable sample in 0 finished attempts"):
        build_batch([], **kw)
    empty = Trajectory("r", "u", [agl.Triplet(prompt={"token_ids": []}, response={"token_ids": [5]})], 1.0)
    failed = Trajectory("f", "u", [], None)
    counters: Counter[str] = Counter()
    with pytest.raises(EmptyBatchError, match="no_token_ids"):
        build_batch([empty, failed], counters=counters, **kw)
    assert counters == {"rollouts": 2, "no_token_ids": 1, "no_triplets": 2, "no_reward": 1}
    long = Trajectory(
        "l", "u", [agl.Triplet(prompt={"token_ids": [7, 8]}, response={"token_ids": [1, 2, 3, 4, 5]})], None
    )
    batch = build_batch([long], counters=counters, reward_fillna_value=-1.0, **kw)
    assert batch.batch["responses"].tolist() == [[1, 2, 3]] and counters["response_truncated"] == 1
    assert batch.batch["token_level_scores"].tolist() == [[0.0, 0.0, -1.0]]
    with pytest.raises(ValueError, match="transition"):
        build_batch([long], level="turn", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be >= 1"):
        build_batch([long], max_prompt_length=0, max_response_length=3, pad_token_id=0)


CONFIG: dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo"},
    "data": {"train_batch_size": 4, "max_prompt_length": 64, "max_response_length": 32},
    "actor_rollout_ref": {"model": {"path": "/models/tiny"}, "rollout": {"n": 3, "temperature": 0.7}},
    "trainer": {"total_training_steps": 2},
}


def test_config_is_validated_with_one_line_errors() -> None:
    s = VerlSettings.from_config(CONFIG)
    assert (s.n, s.train_batch_size, s.max_prompt_length, s.max_response_length, s.level) == (
        3,
        4,
        64,
        32,
        "transition",
    )
    traj = VerlSettings.from_config({**CONFIG, "agentlightning": {"trace_aggregator": {"level": "trajectory"}}})
    assert (traj.max_prompt_length, traj.max_response_length) == (2048, 8192)
    bad = [
        ({**CONFIG, "actor_rollout_ref": {"rollout": {"n": 3}}}, "model.path"),
        ({**CONFIG, "data": {**CONFIG["data"], "train_batch_size": 0}}, "data.train_batch_size"),
        ({**CONFIG, "agentlightning": {"trace_aggregator": {"level": "turn"}}}, "level"),
        ({**CONFIG, "actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"name": "sglang"}}}, "'vllm'"),
        (  # found by a fresh user: a raw ValueError, and a negative timeout taken
            {**CONFIG, "actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"temperature": "hot"}}},
            "temperature must be a number >= 0, got 'hot'",
        ),
        ({**CONFIG, "agentlightning": {"rollout_timeout_s": -5}}, "rollout_timeout_s must be a number > 0"),
    ]
    for config, key in bad:
        with pytest.raises(InvalidInputError, match=key):
            agl.VERL(config)
    with pytest.raises(InvalidInputError, match="dict"):
        VerlSettings.from_config([1])  # type: ignore[arg-type]


def test_verl_config_merges_over_verls_defaults() -> None:
    cfg = verl_config(CONFIG)
    assert cfg.actor_rollout_ref.rollout.n == 3 and cfg.actor_rollout_ref.rollout.name == "vllm"
    assert cfg.data.max_prompt_length == 64 and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.agentlightning.trace_aggregator.level == "transition"
    assert "ppo_mini_batch_size" in cfg.actor_rollout_ref.actor  # VERL's own default is there


async def test_verl_run_refuses_without_a_gpu() -> None:
    algo = agl.VERL(CONFIG)
    with pytest.raises(VerlUnavailableError, match="VERL"):
        await algo.run(train_dataset=[{"q": "1 + 1?"}])


class _Proxy:
    endpoint = "http://127.0.0.1:1/v1"

    def __init__(self) -> None:
        self.model_list: list[dict[str, Any]] = []

    def update_model_list(self, model_list: list[dict[str, Any]]) -> None:
        self.model_list = model_list


async def test_daemon_enqueues_groups_and_builds_the_batch(tok: Any) -> None:
    store = agl.InMemoryLightningStore()
    proxy = _Proxy()  # the real proxy's model-list handling is tested in test_llm_proxy.py
    daemon = VerlDaemon(VerlSettings.from_config(CONFIG), store, proxy, agl.TracerTraceToTriplet())
    with pytest.raises(RuntimeError, match="register_backends"):
        await daemon.enqueue([{"q": "x"}], train=True)
    with pytest.raises(ValueError, match="no vLLM server"):
        await daemon.register_backends([])
    resources_id = await daemon.register_backends(["127.0.0.1:18000", "127.0.0.1:18001"])
    assert [m["litellm_params"]["api_base"] for m in proxy.model_list] == [
        "http://127.0.0.1:18000/v1",
        "http://127.0.0.1:18001/v1",
    ]
    assert {m["litellm_params"]["model"] for m in proxy.model_list} == {"hosted_vllm//models/tiny"}
    llm = (await store.get_resources_by_id(resources_id)).resources["main_llm"]
    assert llm.model == "/models/tiny" and llm.sampling_parameters == {"temperature": 0.7}
    ids = await daemon.enqueue([{"a": 2, "b": 3}, {"a": 4, "b": 4}], train=True)
    ids += await daemon.enqueue([{"a": 1, "b": 1}], train=False)
    assert len(ids) == 2 * 3 + 1
    served = 0
    while (attempt := await store.dequeue_rollout(worker_id="w")) is not None:
        task = attempt.input
        calls = _tool_rollout(tok, f"{task['a']} + {task['b']}?", "5", str(served % 3))
        await store.add_many_spans(_spans(attempt.rollout_id, calls, float(served % 3), attempt.attempt.attempt_id))
        status = "failed" if served == 6 else "succeeded"
        await store.update_attempt(attempt.rollout_id, attempt.attempt.attempt_id, status=status)
        served += 1
    trajectories = await daemon.collect(ids, timeout_s=10)
    assert len(trajectories) == 6 and daemon.counters["failed_rollouts"] == 1
    uids = Counter(t.uid for t in trajectories)
    assert sorted(uids.values()) == [3, 3]  # GRPO groups: the n rollouts of one task share its data_id
    batch = daemon.train_batch(trajectories, pad_token_id=tok.pad_token_id)
    assert len(batch) == 12 and Counter(batch.non_tensor_batch["uid"].tolist()) == {u: 6 for u in uids}


def test_bench_verl_gpu_parses_builds_its_config_and_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import verl_gpu

    args = verl_gpu.parse_args(["--steps", "2", "--tasks", "3", "--n", "5"])
    config = verl_gpu.build_config(args, "/models/x")
    s = VerlSettings.from_config(config)
    assert (s.n, s.train_batch_size, s.total_training_steps, s.model_path) == (5, 3, 2, "/models/x")
    cfg = verl_config(config)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 15 and cfg.trainer.n_gpus_per_node == 1
    for bad in (["--n", "1"], ["--steps", "0"], ["--gpu-memory", "1.5"]):
        with pytest.raises(SystemExit):
            verl_gpu.parse_args(bad)
    assert verl_gpu.main(["--steps", "1"]) == 2  # no GPU / no vLLM here: one line, nothing started
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: VERL") and ("missing: " in err or "sees none" in err)


# -- peer failures: what the daemon leaves out, and why --------------------------------------

PROMPT = {"prompt": agl.PromptTemplate(template="{q}")}


@agl.rollout
async def three_sub_agents(task: dict, prompt_template: agl.PromptTemplate, rollout: agl.AttemptedRollout) -> Any:
    """Three sub-agents in a row, each one LLM call; the second raises ``ConnectionError`` in the
    first ``task["fail_attempts"]`` attempts, after the first one's call was recorded."""
    from eventlight.tracer import get_active_tracer

    if task.get("nothing"):
        return None
    tracer = get_active_tracer()
    assert tracer is not None
    seq = rollout.attempt.sequence_id
    for k in range(3):
        if k == 1 and seq <= task["fail_attempts"]:
            raise ConnectionError(f"sub-agent 2 lost its backend in attempt {seq}")
        ids = {"prompt_token_ids": [10 * seq + k], "response_token_ids": [100 * seq + k]}
        tracer.create_span("openai.chat.completion", attributes={**ids, "gen_ai.response.id": f"a{seq}-call{k}"})
    return 1.0


async def test_daemon_trains_on_the_last_attempt_of_a_succeeded_rollout_only(store: Any, runner_store: Any) -> None:
    """peer_failures C16: sub-agent 2 of 3 raises after sub-agent 1's call was recorded. (a) With
    one attempt the rollout fails with the exception on it, and its partial spans, kept in the
    store, are not trained on; (b) retried, only attempt 2's calls are; (c) an agent that returns
    ``None`` without spans succeeds with nothing to train on, counted apart from failures."""
    await store.add_resources(PROMPT)
    once = await store.enqueue_rollout({"fail_attempts": 1}, config=agl.RolloutConfig(max_attempts=1))
    retry = agl.RolloutConfig(max_attempts=2, retry_condition=["failed"])
    twice = await store.enqueue_rollout({"fail_attempts": 1}, config=retry)
    nothing = await store.enqueue_rollout({"nothing": True})
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=4, poll_interval=0.05, heartbeat_interval=0)
    with runner.run_context(agent=three_sub_agents, store=runner_store):
        assert await asyncio.wait_for(runner.iter(), 60) == 4
    ids = [once.rollout_id, twice.rollout_id, nothing.rollout_id]
    daemon = VerlDaemon(VerlSettings.from_config(CONFIG), store, _Proxy(), agl.TracerTraceToTriplet())
    [trajectory] = await daemon.collect(ids, timeout_s=10)
    assert trajectory.rollout_id == twice.rollout_id and trajectory.reward == 1.0
    assert [t.response["token_ids"] for t in trajectory.triplets] == [[200], [201], [202]]
    assert (daemon.counters["failed_rollouts"], daemon.counters["no_spans"]) == (1, 1)
    failed = await store.get_rollout_by_id(once.rollout_id)
    assert failed.status == "failed"
    assert failed.status_reason == "ConnectionError: sub-agent 2 lost its backend in attempt 1"
    partial = [s.name for s in await store.query_spans(once.rollout_id)]
    assert partial.count("openai.chat.completion") == 1 and "agentlightning.exception" in partial
    assert (await store.get_rollout_by_id(nothing.rollout_id)).status == "succeeded"


def _context_length_error(rid: str, aid: str, prompt_tokens: int) -> Span:
    """The LLM proxy's span of a call vLLM refused with 400: the prompt does not fit the context."""
    from eventlight.llm_proxy.span_attributes import make_span

    asked = prompt_tokens + 512
    message = f"This model's maximum context length is 4608 tokens. However, you requested {asked} tokens."
    return make_span(
        {"model": "m", "messages": [{"role": "user", "content": "x " * prompt_tokens}], "max_tokens": 512},
        None,
        {"type": "ContextWindowExceededError", "status_code": 400, "message": message},
        system="hosted_vllm",
        streaming=False,
        rollout_id=rid,
        attempt_id=aid,
        sequence_id=1,
        start_time=1.0,
    )


async def test_a_batch_leaves_out_calls_the_llm_refused_and_says_so(tok: Any, store: Any) -> None:
    """peer_failures C15: one rollout of four sent a prompt longer than the context and got a 400
    (its agent caught it and returned no reward). The batch trains on the three others and counts
    the refused call (``llm_errors``); a batch of such rollouts only stops with ``EmptyBatchError``
    naming that count, never a tensor-shape error."""
    daemon = VerlDaemon(VerlSettings.from_config(CONFIG), store, _Proxy(), agl.TracerTraceToTriplet())
    await daemon.register_backends(["127.0.0.1:18000"])

    async def run_batch(refused: int) -> list[Trajectory]:
        ids = await daemon.enqueue([{"q": i} for i in range(4)], train=False)
        for i in range(4):
            attempt = await store.dequeue_rollout(worker_id="w")
            rid, aid = attempt.rollout_id, attempt.attempt.attempt_id
            if i < refused:
                await store.add_many_spans([_context_length_error(rid, aid, 6347)])
            else:
                calls = _tool_rollout(tok, f"{i} + 1?", str(i + 1), str(i + 1))
                await store.add_many_spans(_spans(rid, calls, 1.0, aid))
            await store.update_attempt(rid, aid, status="succeeded")
        return await daemon.collect(ids, timeout_s=10)

    batch = daemon.train_batch(await run_batch(refused=1), pad_token_id=tok.pad_token_id)
    assert len(batch) == 6  # three rollouts of two calls each
    assert (daemon.counters["llm_errors"], daemon.counters["no_triplets"]) == (1, 1)
    with pytest.raises(EmptyBatchError, match=r"no trainable sample in 4 finished attempts .*'llm_errors': 4"):
        daemon.train_batch(await run_batch(refused=4), pad_token_id=tok.pad_token_id)
