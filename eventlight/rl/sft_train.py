"""Supervised fine-tuning of a causal LM on encoded conversations with TRL's ``SFTTrainer`` (the ``sft`` extra).

The rows come pre-tokenized (``input_ids`` + ``labels``, see ``eventlight.rl.sft_data``), so TRL
skips its own tokenization and takes the labels as they are: the loss is the mean negative
log-likelihood of the assistant's tokens only. The Hugging Face trainer writes a full checkpoint
(weights, optimizer, scheduler, RNG, step) every ``save_every`` steps under ``<out>/trainer``;
``train_sft(..., resume=True)`` continues from the last one, skipping the batches it already saw.

Unsloth (GPUs only: 4-bit base model + LoRA) patches the same ``SFTTrainer``; see the README.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eventlight.rl.sft_data import IGNORE, Example

log = logging.getLogger(__name__)

__all__ = ["mean_assistant_nll", "peak_rss_mb", "train_sft"]


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (``getrusage``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _pad(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(e.labels, dtype=torch.long)
        attn[row, :n] = 1
    return ids, labels, attn


def mean_assistant_nll(model: Any, examples: Sequence[Example], *, pad_id: int, batch_size: int = 8) -> float:
    """Mean negative log-likelihood per assistant token of ``examples`` under ``model`` (no gradient).

    Raises:
        ValueError: No example has a loss token.
    """
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(examples), batch_size):
                ids, labels, attn = _pad(examples[i : i + batch_size], pad_id)
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                target = labels[:, 1:]
                nll = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="sum"
                )
                total += float(nll)
                count += int((target != IGNORE).sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no assistant token to score")
    return total / count


def _step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        """Wall time of each optimizer step (forward, backward, step), without checkpoint writes."""

        def __init__(self) -> None:
            self.step_s: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_s.append(time.perf_counter() - self._t0)

    return StepTimer()


def train_sft(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    out_dir: Path,
    steps: int,
    batch_size: int,
    lr: float,
    save_every: int,
    keep_checkpoints: int,
    seed: int,
    resume: bool,
    activation_checkpointing: bool = False,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of TRL's ``SFTTrainer`` on ``examples`` (on the CPU).

    Returns:
        ``{"steps_run", "global_step", "resumed_from", "train_losses", "step_s", "loss_before",
        "loss_after", "peak_rss_mb"}``; losses are mean assistant-token NLL over all ``examples``
        before and after (``loss_before`` is taken after a resume's weights load).

    Raises:
        ValueError: ``examples`` is empty or one has no loss token (no zero-size batch may reach the
            optimizer).
    """
    from datasets import Dataset
    from transformers import PrinterCallback
    from transformers.trainer_utils import get_last_checkpoint
    from trl import SFTConfig as TRLSFTConfig
    from trl import SFTTrainer

    if not examples or any(e.n_loss_tokens == 0 for e in examples):
        raise ValueError("train_sft needs examples that each have at least one assistant token")
    trainer_dir = out_dir / "trainer"
    last = get_last_checkpoint(str(trainer_dir)) if resume and trainer_dir.is_dir() else None
    args = TRLSFTConfig(
        output_dir=str(trainer_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_every,
        save_total_limit=keep_checkpoints,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=seed,
        data_seed=seed,
        max_length=None,  # too long conversations were skipped, never truncated
        packing=False,
        dataloader_num_workers=0,
        dataloader_drop_last=False,
        disable_tqdm=True,
        activation_checkpointing=activation_checkpointing,  # TRL's default is on
    )
    timer = _step_timer()
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([e.as_row() for e in examples]),
        processing_class=tokenizer,
        callbacks=[timer, *callbacks],
    )
    trainer.remove_callback(PrinterCallback)  # the per-step numbers go to the caller, not stdout
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    if last is not None:
        log.info("SFT resumes from %s", last)
        trainer._load_from_checkpoint(last)  # weights now, so loss_before is the resumed model's
    before = mean_assistant_nll(model, examples, pad_id=pad_id, batch_size=batch_size)
    start_step = int(Path(last).name.split("-")[-1]) if last is not None else 0
    trainer.train(resume_from_checkpoint=last)
    after = mean_assistant_nll(model, examples, pad_id=pad_id, batch_size=batch_size)
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h and math.isfinite(h["loss"])]
    return {
        "steps_run": int(trainer.state.global_step) - start_step,
        "global_step": int(trainer.state.global_step),
        "resumed_from": start_step,
        "train_losses": losses,
        "step_s": timer.step_s,
        "loss_before": before,
        "loss_after": after,
        "peak_rss_mb": peak_rss_mb(),
    }
