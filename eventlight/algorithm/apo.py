"""APO: Automatic Prompt Optimization by textual gradients and beam search (Agent-lightning ``APO``).

Ideas from ProTeGi (https://aclanthology.org/2023.emnlp-main.494.pdf) and TextGrad. Each round
samples parents from the beam, rolls each parent out on a training batch, asks an optimizer LLM
for a critique of the parent (the "textual gradient"), asks it again to rewrite the parent using
the critique, scores all candidates on one validation mini-batch, keeps the best ``beam_width``,
and re-scores the leader on the whole validation set.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import string
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypedDict, TypeVar

import msgspec

from eventlight.adapter import OpenAIMessages, TraceToMessages
from eventlight.algorithm.base import Algorithm, Dataset, batch_iter_over_dataset
from eventlight.core.errors import EventlightError
from eventlight.core.types import (
    EnqueueRolloutRequest,
    NamedResources,
    PromptTemplate,
    Rollout,
    RolloutConfig,
    Span,
)
from eventlight.rewards import find_final_reward
from eventlight.store.validate import is_token

log = logging.getLogger(__name__)

__all__ = ["APO", "RolloutResultForAPO", "VersionedPromptTemplate"]

T_task = TypeVar("T_task")
ProgressCallback = Callable[[dict[str, Any]], None]
ChatMessages = list[dict[str, str]]

MAX_SPANS_PER_RUN = 4
"""Spans shown per run in gradient variant 02 (small local models have a 2k-token context)."""
MAX_CHARS_PER_ITEM = 1500
"""Characters kept of each span dump and of each run's messages JSON in the critique prompts."""
EVIDENCE_CHAR_BUDGET = 4000
"""Characters of run evidence (messages JSON or span dumps) in one critique prompt, split evenly
over the items shown (each still at most ``MAX_CHARS_PER_ITEM``, at least ``MIN_CHARS_PER_ITEM``)."""
MIN_CHARS_PER_ITEM = 200
MAX_CRITIQUE_CHARS = 2000
"""Characters of the critique passed on to the rewrite call."""


class VersionedPromptTemplate(msgspec.Struct, kw_only=True):
    """A candidate prompt. ``version`` ("v0", "v1", ...) is also its resources id in the store.

    Attributes:
        version: Per-instance counter; the seed is ``v0`` on the first run.
        prompt_template: The template.
        score: Its latest validation score (mean final reward on a mini-batch), if evaluated.
    """

    version: str
    prompt_template: PromptTemplate
    score: float | None = None


class RolloutResultForAPO(TypedDict):
    """One finished rollout as the critic sees it (JSON-serialisable).

    Attributes:
        status: The rollout status (``succeeded``, ``failed``, ``cancelled``).
        final_reward: ``find_final_reward`` of its latest attempt's spans, or ``None``.
        spans: The spans as builtins dicts.
        messages: ``TraceToMessages.adapt`` of the spans.
    """

    status: str
    final_reward: float | None
    spans: list[dict[str, Any]]
    messages: list[OpenAIMessages]


# ------------------------------------------------------------------------------------------
# Optimizer prompts: the three critique and two rewrite variants of Agent-lightning's POML files,
# rendered natively. User-message templates are filled with ``str.format`` (values are inserted
# verbatim, so braces inside the prompt template are safe); system messages are used as is.

_GRADIENT_01_USER = """You optimize a prompt template.

# Original Prompt Template

{prompt_template}

# Experiments with Original Prompt Template

{experiments}

# Your Task

Write a brief critique of the prompt template as a bullet list: the likely causes of the errors and \
low rewards above, and ways to raise the reward. Each bullet must propose a concrete, testable change \
(output format, constraints, ordering of instructions, definitions of terms)."""

_GRADIENT_01_EXPERIMENT = """## Experiment {index}

Run status: {status}. Final reward: {reward}

### Rollout Traces (Chat Messages, Grader Requests included)

{messages}"""

_GRADIENT_02_USER = """# Role

You are a prompt engineer.

# Task

Analyse where the prompt template below failed to elicit the mechanism the task needs.

# Current Prompt Template

{prompt_template}

# Sample Runs with the Current Prompt Template

Each run lists OpenTelemetry spans recorded while the agent worked; they hold the prompts sent to the \
model, its responses and the rewards given (at most {max_spans} spans per run, each cut to \
{max_chars} characters).

{runs}

# Output Format

Reply with 3-5 short bullets under the title "Critique:", on missing constraints, ordering and formatting."""

_GRADIENT_02_RUN = """## Sample Run #{index} Diagnostics

Status: {status}. Final reward: {reward}

{spans}"""

_GRADIENT_03_SYSTEM = """You are an expert in prompt design. Review the prompt the user gives you, using \
its sample runs as evidence, against this checklist:
1. Structure: clear sections, logical order, no contradictions or duplication.
2. Instruction quality: specific, unambiguous, actionable; key terms defined.
3. Control of behaviour: what to do in edge cases, what never to do, how to handle uncertainty.
4. Input/output specification: the expected input described, the output format and limits explicit.
5. Scope and safety: the task bounded; no instructions the model cannot follow.
6. Efficiency and maintainability: no filler; placeholders used consistently.
7. Testing: which sample runs fail and which instruction would have prevented each failure.
Answer with a prioritised list of concrete problems and fixes, under 350 words."""

_GRADIENT_03_USER = """# Prompt

{prompt_template}

# Sample Runs of the Prompts (Historical Messages and Rewards)

{runs}"""

_GRADIENT_03_RUN = """## Run {index}

Status: {status}
Final score: {reward}
Messages:
{messages}"""

_EDIT_01_SYSTEM = """You revise prompt templates. Rewrite the template the user gives you so that it \
addresses the critique. Rules:
- Restructure the template if the critique implies it.
- Include any output format or limits the critique asks for.
- Phrase instructions mechanism-first: how to solve the task before what to output.
- Keep every placeholder in curly braces, such as {name}, exactly as written; add no new ones.
- Output only the improved template: no explanations, no headers, no code fences."""

_EDIT_01_USER = """# Prompt Template

{prompt_template}

# Critique

{critique}"""

_EDIT_02_SYSTEM = """You make conservative edits to prompts. From the critique, address only the \
single most critical point. Keep the prompt's tone, length and structure otherwise unchanged. \
Preserve every variable in curly brackets, such as {name}, exactly. Output only the revised prompt."""

_EDIT_02_USER = """### PROMPT

{prompt_template}

### CRITIQUE

{critique}"""


def _truncate(text: str, limit: int = MAX_CHARS_PER_ITEM) -> str:
    return text if len(text) <= limit else text[:limit] + " ...[truncated]"


def _item_limit(budget_chars: int, n_items: int) -> int:
    share = budget_chars // max(1, n_items)
    return max(MIN_CHARS_PER_ITEM, min(MAX_CHARS_PER_ITEM, share))


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str)


def _reward_text(reward: float | None) -> str:
    return "" if reward is None else f"{reward:g}"


def _pick_spans(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last ``MAX_SPANS_PER_RUN`` spans, preferring LLM calls and rewards."""

    def telling(span: dict[str, Any]) -> bool:
        keys = span.get("attributes") or {}
        return any(k.startswith(("gen_ai.", "agentlightning.reward")) or k == "reward" for k in keys)

    preferred = [s for s in spans if telling(s)] or spans
    return preferred[-MAX_SPANS_PER_RUN:]


def _gradient_01(template: str, runs: Sequence[RolloutResultForAPO], budget_chars: int) -> ChatMessages:
    limit = _item_limit(budget_chars, len(runs))
    experiments = "\n\n".join(
        _GRADIENT_01_EXPERIMENT.format(
            index=i,
            status=r["status"],
            reward=_reward_text(r["final_reward"]),
            messages=_truncate(_json(r["messages"]), limit),
        )
        for i, r in enumerate(runs, 1)
    )
    return [
        {
            "role": "user",
            "content": _GRADIENT_01_USER.format(prompt_template=template, experiments=experiments),
        }
    ]


def _gradient_02(template: str, runs: Sequence[RolloutResultForAPO], budget_chars: int) -> ChatMessages:
    limit = _item_limit(budget_chars, len(runs) * MAX_SPANS_PER_RUN)
    blocks = "\n\n".join(
        _GRADIENT_02_RUN.format(
            index=i,
            status=r["status"],
            reward=_reward_text(r["final_reward"]),
            spans="\n".join(_truncate(_json(s), limit) for s in _pick_spans(r["spans"])),
        )
        for i, r in enumerate(runs, 1)
    )
    content = _GRADIENT_02_USER.format(
        prompt_template=template, runs=blocks, max_spans=MAX_SPANS_PER_RUN, max_chars=limit
    )
    return [{"role": "user", "content": content}]


def _gradient_03(template: str, runs: Sequence[RolloutResultForAPO], budget_chars: int) -> ChatMessages:
    limit = _item_limit(budget_chars, len(runs))
    blocks = "\n\n".join(
        _GRADIENT_03_RUN.format(
            index=i,
            status=r["status"],
            reward=_reward_text(r["final_reward"]),
            messages=_truncate(_json(r["messages"]), limit),
        )
        for i, r in enumerate(runs, 1)
    )
    return [
        {"role": "system", "content": _GRADIENT_03_SYSTEM},
        {"role": "user", "content": _GRADIENT_03_USER.format(prompt_template=template, runs=blocks)},
    ]


def _edit_01(template: str, critique: str) -> ChatMessages:
    return [
        {"role": "system", "content": _EDIT_01_SYSTEM},
        {"role": "user", "content": _EDIT_01_USER.format(prompt_template=template, critique=critique)},
    ]


def _edit_02(template: str, critique: str) -> ChatMessages:
    return [
        {"role": "system", "content": _EDIT_02_SYSTEM},
        {"role": "user", "content": _EDIT_02_USER.format(prompt_template=template, critique=critique)},
    ]


_EDIT_APPEND_SYSTEM = (
    "You improve prompts by adding one instruction. From the critique, write ONE short sentence to add at the "
    "end of the prompt that fixes its most important problem. Output only that sentence."
)


def _edit_append(template: str, critique: str) -> ChatMessages:
    """The ``edit_mode="append"`` variant: ask for one instruction sentence (small models manage this)."""
    return [
        {"role": "system", "content": _EDIT_APPEND_SYSTEM},
        {"role": "user", "content": f"### PROMPT\n\n{template}\n\n### CRITIQUE\n\n{critique}"},
    ]


def _appended(template: str, sentence: str | None) -> str | None:
    """``template`` plus the first line of ``sentence`` (quotes stripped, braces escaped, at most 200 chars)."""
    line = next((ln.strip() for ln in (sentence or "").splitlines() if ln.strip()), "")
    line = line.strip("\"'`*- ").replace("{", "{{").replace("}", "}}")[:200]
    return f"{template.rstrip()}\n{line}" if line else None


GRADIENT_VARIANTS: tuple[Callable[[str, Sequence[RolloutResultForAPO], int], ChatMessages], ...] = (
    _gradient_01,
    _gradient_02,
    _gradient_03,
)
APPLY_EDIT_VARIANTS: tuple[Callable[[str, str], ChatMessages], ...] = (_edit_01, _edit_02)


# ------------------------------------------------------------------------------------------
# Checking rewritten templates


class _Blank:
    """Stands in for any placeholder value: every attribute, item and format spec works."""

    def __getattr__(self, name: str) -> _Blank:
        return self

    def __getitem__(self, key: Any) -> _Blank:
        return self

    def __format__(self, spec: str) -> str:
        return ""


def _field_names(template: str) -> set[str] | None:
    """Top-level placeholder names of an f-string template; ``None`` if it does not parse."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError:
        return None
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for name in fields}


def _format_error(template: str, names: set[str]) -> str | None:
    """Why ``template.format(**{name: ...})`` fails, or ``None`` if it formats."""
    try:
        template.format(**{name: _Blank() for name in names})
    except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _prefix(round_no: int, beam_no: int, branch_no: int, version: str) -> str:
    return f"[Round {round_no:02d} | Beam {beam_no:02d} | Branch {branch_no:02d} | Prompt {version}]"


def _clean_edit(text: str) -> str:
    """Strip whitespace and one enclosing Markdown code fence from an optimizer's rewrite."""
    text = text.strip()
    fenced = re.fullmatch(r"```[\w-]*\n(.*)\n```", text, flags=re.DOTALL)
    return fenced.group(1).strip() if fenced else text


# ------------------------------------------------------------------------------------------


class APO(Algorithm, Generic[T_task]):
    """Automatic Prompt Optimization (Agent-lightning 0.3 ``APO``, ``seed_algorithms.md`` §2.4).

    Tunes the first ``PromptTemplate`` of the initial resources. Needs ``train_dataset`` (rolled
    out to compute critiques), ``val_dataset`` (to rank candidates) and a ``TraceToMessages``
    adapter. Per round: every beam member becomes a parent (cyclically replicated while the beam
    is smaller than ``beam_width``); each parent gets ``branch_factor`` children, sequentially,
    each from a fresh training batch; old beam and children are all scored on ONE validation
    mini-batch; the top ``beam_width`` (stable sort, old beam first on ties) form the new beam; the
    leader is re-scored on the full validation set and becomes the best prompt only if strictly
    better. Score = mean final reward over finished rollouts, ``None`` counted as 0, failed
    rollouts included, timed-out ones excluded.

    Cost per round (``seed_algorithms.md`` §2.6): ``beam_width * branch_factor`` critique calls
    and as many rewrite calls; ``beam_width * branch_factor * min(gradient_batch_size, |train|)``
    train rollouts; ``(|beam| + #children) * min(val_batch_size, |val|) + |val|`` val rollouts;
    plus ``|val|`` up front when ``run_initial_validation``.

    Deliberate differences from Agent-lightning:

    (a) The optimizer prompts are plain Python string templates reproducing the three critique
        variants and two rewrite variants of the POML files (no POML, no Node.js). So that prompts
        fit small local models (2k-token context), variant 02 shows at most ``MAX_SPANS_PER_RUN``
        spans per run; every span dump or run's messages JSON is cut to its share of
        ``evidence_char_budget`` (default ``EVIDENCE_CHAR_BUDGET`` = 4,000 characters; each share
        between 200 and ``MAX_CHARS_PER_ITEM`` = 1,500); the critique given to the rewrite call is
        cut to ``MAX_CRITIQUE_CHARS``. Raise the attribute ``evidence_char_budget`` for larger models.
    (b) The published resources are ALL initial resources with the tuned template replaced, so an
        agent that also needs its LLM (e.g. a ``ProxyLLM``) still gets it. They are published with
        ``store.put_resources(version, ...)``; the resources id is the version ("v0", "v1", ...),
        after ``version_prefix`` when one is given (``"run-0412-v0"``), so that a second run in the
        same store does not overwrite the first run's prompts.
    (c) Each batch is enqueued at once with ``enqueue_many_rollouts`` (so runners work on it
        concurrently) and awaited once with ``wait_for_rollouts(timeout=rollout_batch_timeout)``,
        event-driven, not polled. Rollouts still unfinished at the timeout are cancelled so they do
        not hold up the next batch, and are left out of the score.
    (d) ``progress`` (optional) receives events: ``{"event": "eval", "version", "mode", "score",
        "n", "requested"}``, ``{"event": "candidate", "round", "parent", "version", "template"}``,
        ``{"event": "skip", "round", "parent", "reason"}``, ``{"event": "round", "round", "rounds",
        "phase": "start"}``, ``{"event": "round", "round", "rounds", "phase": "ranked",
        "beam": [[version, score], ...]}`` and ``{"event": "best", "version", "score",
        "template"}``. A failing callback is logged and ignored.
    (e) Besides ``get_best_prompt()``: ``best_score`` (full-validation score of the best prompt;
        ``-inf`` until one was scored), ``best_version``, ``seed_score`` (initial validation score,
        ``None`` if skipped) and ``history`` (``(version, mode, score, n)`` per evaluation, ``n`` =
        finished rollouts).
    (f) The run never fails because the optimizer LLM misbehaves: a critique or rewrite that
        raises or comes back empty is logged and that child skipped (Agent-lightning keeps the
        parent's text as a duplicate child when the critique fails). A child that is empty or
        identical to its parent is skipped. A child that is not a valid ``str.format`` template for
        the seed's placeholders, or that drops one of its parent's placeholders (the rewrite
        prompts forbid it; the task would lose its input), falls back to the parent, i.e. is
        skipped too (logged).
    (j) ``edit_mode="append"`` (default ``"rewrite"``) asks the edit model for one instruction
        sentence (at most 48 tokens) and appends it to the parent, instead of a whole rewrite: small
        local models can write a sentence but rarely a template that keeps its placeholders.
        ``optimizer_max_tokens`` (default: no limit) caps the critique and rewrite calls.
    (h) Spans are read from each rollout's latest attempt (``attempt_id="latest"``), so a retried
        rollout is judged by its final attempt only.
    (i) The adapter and LLM proxy are plain references (see ``eventlight.algorithm.base``); APO
        does not start or stop an LLM proxy (Agent-lightning's ``@with_llm_proxy``): the trainer
        owns it.

    Args:
        async_openai_client: An ``openai.AsyncOpenAI`` (or anything with an async
            ``chat.completions.create(model=, messages=, temperature=)``) used for both calls.
        gradient_model: Model for critiques.
        apply_edit_model: Model for rewrites.
        diversity_temperature: ``temperature`` of both optimizer calls.
        gradient_batch_size: Training tasks rolled out per child, and runs shown to the critic.
        val_batch_size: Size of each round's validation mini-batch.
        beam_width: Beam size, and parents per round.
        branch_factor: Children per parent per round.
        beam_rounds: Rounds.
        rollout_batch_timeout: Seconds to wait for one batch of rollouts.
        run_initial_validation: Score the seed on the full validation set first.
        rollout_config: ``RolloutConfig`` of every rollout (retries, timeouts); store default if None.
        progress: Callback for progress events, see (d).
        version_prefix: Put before every version (and so resources id), e.g. a run id ``"run-0412-"``;
            letters, digits and ``_-:@+=`` only (resources ids are subject tokens).

    Raises:
        ValueError: A size or count is below 1 (``beam_rounds`` below 0), or the timeout is not positive.
    """

    def __init__(
        self,
        async_openai_client: Any,
        *,
        gradient_model: str = "gpt-5-mini",
        apply_edit_model: str = "gpt-4.1-mini",
        diversity_temperature: float = 1.0,
        gradient_batch_size: int = 4,
        val_batch_size: int = 16,
        beam_width: int = 4,
        branch_factor: int = 4,
        beam_rounds: int = 3,
        rollout_batch_timeout: float = 3600.0,
        run_initial_validation: bool = True,
        rollout_config: RolloutConfig | None = None,
        progress: ProgressCallback | None = None,
        edit_mode: Literal["rewrite", "append"] = "rewrite",
        optimizer_max_tokens: int | None = None,
        version_prefix: str = "",
    ):
        if version_prefix and not is_token(version_prefix):
            raise ValueError(f"version_prefix {version_prefix!r} may hold only letters, digits and '_-:@+='")
        if edit_mode not in ("rewrite", "append"):
            raise ValueError(f"edit_mode must be 'rewrite' or 'append', got {edit_mode!r}")
        if min(gradient_batch_size, val_batch_size, beam_width, branch_factor) < 1 or beam_rounds < 0:
            raise ValueError("batch sizes, beam_width and branch_factor must be >= 1, beam_rounds >= 0")
        if rollout_batch_timeout <= 0:
            raise ValueError(f"rollout_batch_timeout must be positive, got {rollout_batch_timeout}")
        self.async_openai_client = async_openai_client
        self.gradient_model = gradient_model
        self.apply_edit_model = apply_edit_model
        self.diversity_temperature = diversity_temperature
        self.gradient_batch_size = gradient_batch_size
        self.val_batch_size = val_batch_size
        self.beam_width = beam_width
        self.branch_factor = branch_factor
        self.beam_rounds = beam_rounds
        self.rollout_batch_timeout = rollout_batch_timeout
        self.run_initial_validation = run_initial_validation
        self.rollout_config = rollout_config
        self.progress = progress
        self.edit_mode = edit_mode
        self.optimizer_max_tokens = optimizer_max_tokens
        self.version_prefix = version_prefix
        self.evidence_char_budget = EVIDENCE_CHAR_BUDGET
        self._rng = random.Random()
        self._version_counter = 0
        self._best_prompt: PromptTemplate | None = None
        self._seed_names: set[str] | None = None
        self.best_version: str | None = None
        self.best_score: float = -math.inf
        self.seed_score: float | None = None
        self.history: list[tuple[str, str, float, int]] = []

    # -- collaborators and outputs ------------------------------------------------------------

    def get_adapter(self) -> TraceToMessages:
        """The adapter, which must turn spans into chat messages.

        Raises:
            ValueError: Unset, or not a ``TraceToMessages`` (pass ``adapter=TraceToMessages()`` to
                the trainer; its default is ``TracerTraceToTriplet``).
        """
        adapter = super().get_adapter()
        if not isinstance(adapter, TraceToMessages):
            raise ValueError(f"APO needs a TraceToMessages adapter, got {type(adapter).__name__}")
        return adapter

    def get_seed_prompt_template(self) -> tuple[str, PromptTemplate]:
        """The resource name and template of the first ``PromptTemplate`` in the initial resources.

        Raises:
            ValueError: Initial resources are unset, or hold no ``PromptTemplate``.
        """
        resources = self.get_initial_resources()
        if resources is None:
            raise ValueError("initial_resources are not set; APO needs a PromptTemplate to start from")
        for name, resource in resources.items():
            if isinstance(resource, PromptTemplate):
                return name, resource
        raise ValueError("No prompt template resource found in initial_resources")

    def get_best_prompt(self) -> PromptTemplate:
        """The best template found (the seed until a leader beats it).

        Raises:
            ValueError: ``run`` has not started.
        """
        if self._best_prompt is None:
            raise ValueError("No best prompt found")
        return self._best_prompt

    # -- the search ---------------------------------------------------------------------------

    async def run(
        self, train_dataset: Dataset[T_task] | None = None, val_dataset: Dataset[T_task] | None = None
    ) -> None:
        """Optimize the seed prompt; read the result with ``get_best_prompt()``.

        Raises:
            ValueError: A dataset is missing or empty, the adapter is not ``TraceToMessages``, the
                store is unset, or there is no seed ``PromptTemplate``.
        """
        if not train_dataset or not val_dataset:
            raise ValueError("APO needs a non-empty train_dataset and val_dataset")
        self.get_adapter()  # fail before any rollout
        self.get_store()
        name, seed = self.get_seed_prompt_template()
        self._start(seed)
        grad_iter = batch_iter_over_dataset(train_dataset, self.gradient_batch_size, self._rng)
        val_iter = batch_iter_over_dataset(val_dataset, self.val_batch_size, self._rng)
        val_all = [val_dataset[i] for i in range(len(val_dataset))]
        beam = [self._new_version(seed)]
        self.best_version = beam[0].version
        if self.run_initial_validation:
            _, score = await self.evaluate_prompt_on_batch(beam[0], name, val_all, "val", prefix="[Seed]")
            beam[0].score = self.seed_score = score
            self._set_best(beam[0], score)
            log.info("Seed prompt baseline score: %.3f", score)
        for round_no in range(1, self.beam_rounds + 1):
            self._emit({"event": "round", "round": round_no, "rounds": self.beam_rounds, "phase": "start"})
            children = await self._expand(round_no, beam, name, grad_iter)
            beam = await self._select(round_no, beam + children, name, next(val_iter))
            await self._judge_leader(round_no, beam[0], name, val_all)

    def _start(self, seed: PromptTemplate) -> None:
        self._best_prompt = seed
        self.best_score = -math.inf
        self.seed_score = None
        self.history = []
        names = _field_names(seed.template) if seed.engine == "f-string" else None
        valid = names is not None and _format_error(seed.template, names) is None
        self._seed_names = names if valid else None

    def _new_version(self, template: PromptTemplate) -> VersionedPromptTemplate:
        version = f"{self.version_prefix}v{self._version_counter}"
        self._version_counter += 1
        return VersionedPromptTemplate(version=version, prompt_template=template)

    def _sample_parents(self, beam: list[VersionedPromptTemplate]) -> list[VersionedPromptTemplate]:
        if len(beam) < self.beam_width:
            log.info("Beam has %d < beam_width=%d prompts; parents repeat", len(beam), self.beam_width)
            return [beam[i % len(beam)] for i in range(self.beam_width)]
        return [beam[i] for i in self._rng.sample(range(len(beam)), self.beam_width)]

    async def _expand(
        self, round_no: int, beam: list[VersionedPromptTemplate], name: str, grad_iter: Any
    ) -> list[VersionedPromptTemplate]:
        children: list[VersionedPromptTemplate] = []
        for beam_no, parent in enumerate(self._sample_parents(beam), 1):
            for branch_no in range(1, self.branch_factor + 1):
                prefix = _prefix(round_no, beam_no, branch_no, parent.version)
                results, _ = await self.evaluate_prompt_on_batch(parent, name, next(grad_iter), "train", prefix=prefix)
                text = await self.textual_gradient_and_apply_edit(parent, results, prefix=prefix)
                child = self._accept_child(round_no, parent, text, prefix)
                if child is not None:
                    children.append(child)
        return children

    def _accept_child(
        self, round_no: int, parent: VersionedPromptTemplate, text: str | None, prefix: str
    ) -> VersionedPromptTemplate | None:
        cleaned = _clean_edit(text or "")
        reason = self._reject_reason(parent, cleaned)
        if reason is not None:
            log.info("%s Child skipped: %s", prefix, reason)
            self._emit({"event": "skip", "round": round_no, "parent": parent.version, "reason": reason})
            return None
        child = self._new_version(PromptTemplate(template=cleaned, engine="f-string"))
        log.info("%s New candidate %s", prefix, child.version)
        self._emit(
            {
                "event": "candidate",
                "round": round_no,
                "parent": parent.version,
                "version": child.version,
                "template": child.prompt_template.template,
            }
        )
        return child

    def _reject_reason(self, parent: VersionedPromptTemplate, text: str) -> str | None:
        if not text:
            return "the optimizer returned no prompt"
        if text == parent.prompt_template.template.strip():
            return "the rewrite is identical to its parent"
        error = None if self._seed_names is None else _format_error(text, self._seed_names)
        if error is not None:
            return f"not a valid template for the seed's placeholders ({error}); falling back to the parent"
        dropped = sorted((_field_names(parent.prompt_template.template) or set()) - (_field_names(text) or set()))
        if dropped:
            return f"the rewrite drops the placeholders {dropped}; falling back to the parent"
        return None

    async def _select(
        self, round_no: int, candidates: list[VersionedPromptTemplate], name: str, val_batch: list[Any]
    ) -> list[VersionedPromptTemplate]:
        for candidate in candidates:
            prefix = f"[Round {round_no:02d} | Prompt {candidate.version}]"
            _, candidate.score = await self.evaluate_prompt_on_batch(candidate, name, val_batch, "val", prefix=prefix)
            log.info("%s Candidate score: %.3f", prefix, candidate.score)
        beam = sorted(candidates, key=lambda c: c.score or 0.0, reverse=True)[: self.beam_width]
        log.info(
            "[Round %02d] Top %d candidates on validation dataset: %s",
            round_no,
            len(beam),
            [f"{c.version}:{c.score:.3f}" for c in beam],
        )
        ranked = [[c.version, c.score] for c in beam]
        self._emit(
            {
                "event": "round",
                "round": round_no,
                "rounds": self.beam_rounds,
                "phase": "ranked",
                "beam": ranked,
            }
        )
        return beam

    async def _judge_leader(
        self, round_no: int, leader: VersionedPromptTemplate, name: str, val_all: list[Any]
    ) -> None:
        prefix = f"[Round {round_no:02d} | Leader {leader.version}]"
        _, score = await self.evaluate_prompt_on_batch(leader, name, val_all, "val", prefix=prefix)
        log.info("%s Beam leader score: %.3f", prefix, score)
        if score > self.best_score:
            log.info("%s Best prompt updated. New best score: %.3f (prev: %.3f)", prefix, score, self.best_score)
            self._set_best(leader, score)

    def _set_best(self, prompt: VersionedPromptTemplate, score: float) -> None:
        self._best_prompt = prompt.prompt_template
        self.best_score = score
        self.best_version = prompt.version
        self._emit(
            {
                "event": "best",
                "version": prompt.version,
                "score": score,
                "template": prompt.prompt_template.template,
            }
        )

    def _emit(self, event: dict[str, Any]) -> None:
        if self.progress is None:
            return
        try:
            self.progress(event)
        except Exception:
            log.exception("APO progress callback failed on %s", event.get("event"))

    # -- evaluation ---------------------------------------------------------------------------

    def _resources_for(self, name: str, template: PromptTemplate) -> NamedResources:
        return {**(self.get_initial_resources() or {}), name: template}

    async def evaluate_prompt_on_batch(
        self,
        prompt: VersionedPromptTemplate,
        resource_name: str,
        dataset: Sequence[T_task],
        mode: str,
        *,
        prefix: str | None = None,
    ) -> tuple[list[RolloutResultForAPO], float]:
        """Publish ``prompt`` as resources ``prompt.version``, roll out ``dataset``, and score it.

        Args:
            prompt: The candidate.
            resource_name: The name the agent reads the template under.
            dataset: Tasks, one rollout each, all enqueued at once.
            mode: ``"train"`` or ``"val"``.
            prefix: Log prefix.

        Returns:
            ``(results, score)``: a result per rollout that finished within
            ``rollout_batch_timeout`` (in task order) and their mean final reward (``None`` = 0;
            0.0 when none finished).
        """
        store = self.get_store()
        await store.put_resources(prompt.version, self._resources_for(resource_name, prompt.prompt_template))
        requests = [
            EnqueueRolloutRequest(input=task, mode=mode, resources_id=prompt.version, config=self.rollout_config)
            for task in dataset
        ]
        ids = [r.rollout_id for r in await store.enqueue_many_rollouts(requests)]
        finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=self.rollout_batch_timeout)
        if len(finished) < len(ids):
            await self._cancel_unfinished(ids, finished, prefix or "")
        results = await self.get_rollout_results(finished, prefix=prefix)
        score = sum(r["final_reward"] or 0.0 for r in results) / max(1, len(results))
        self.history.append((prompt.version, mode, score, len(results)))
        self._emit(
            {
                "event": "eval",
                "version": prompt.version,
                "mode": mode,
                "score": score,
                "n": len(results),
                "requested": len(ids),
            }
        )
        return results, score

    async def _cancel_unfinished(self, ids: list[str], finished: list[Rollout], prefix: str) -> None:
        done = {r.rollout_id for r in finished}
        late = [rid for rid in ids if rid not in done]
        log.warning(
            "%s %d/%d rollouts unfinished after %.0f s; cancelling them",
            prefix,
            len(late),
            len(ids),
            self.rollout_batch_timeout,
        )
        for rid in late:
            try:
                await self.get_store().update_rollout(rid, status="cancelled")
            except EventlightError as e:  # finished meanwhile
                log.debug("%s could not cancel %s: %s", prefix, rid, e)

    async def get_rollout_results(
        self, rollouts: Sequence[Rollout], *, prefix: str | None = None
    ) -> list[RolloutResultForAPO]:
        """Spans (latest attempt), messages, final reward and status of finished rollouts.

        Raises:
            ValueError: A reward span is malformed (see ``eventlight.rewards``).
        """
        store = self.get_store()
        results: list[RolloutResultForAPO] = []
        for rollout in rollouts:
            spans = list(await store.query_spans(rollout.rollout_id, attempt_id="latest"))
            results.append(
                RolloutResultForAPO(
                    status=rollout.status,
                    final_reward=find_final_reward(spans),
                    spans=[msgspec.to_builtins(s) for s in spans],
                    messages=self._messages(spans, rollout.rollout_id, prefix),
                )
            )
        return results

    def _messages(self, spans: list[Span], rollout_id: str, prefix: str | None) -> list[OpenAIMessages]:
        try:
            return self.get_adapter().adapt(spans)
        except ValueError as e:
            log.warning("%s could not turn the spans of %s into messages: %s", prefix or "", rollout_id, e)
            return []

    # -- the optimizer LLM --------------------------------------------------------------------

    async def _chat(
        self, model: str, messages: ChatMessages, what: str, prefix: str, max_tokens: int | None = None
    ) -> str | None:
        """One optimizer call; ``None`` (logged) when it raises or returns nothing."""
        limit = max_tokens if max_tokens is not None else self.optimizer_max_tokens
        extra: dict[str, Any] = {"max_tokens": limit} if limit is not None else {}
        try:
            response = await self.async_openai_client.chat.completions.create(
                model=model, messages=messages, temperature=self.diversity_temperature, **extra
            )
            content: str | None = response.choices[0].message.content
        except Exception as e:  # the optimizer LLM must not end the run (difference f)
            log.error("%s %s call to %s failed: %s: %s", prefix, what, model, type(e).__name__, e)
            return None
        if not content or not content.strip():
            log.error("%s %s call to %s returned no text", prefix, what, model)
            return None
        return content

    async def compute_textual_gradient(
        self,
        current_prompt: VersionedPromptTemplate,
        rollout_results: list[RolloutResultForAPO],
        *,
        prefix: str | None = None,
    ) -> str | None:
        """Ask the critic why ``current_prompt`` scored as it did (a random critique variant).

        Shows ``gradient_batch_size`` randomly sampled results (all of them, with a warning, when
        fewer are available).

        Returns:
            The critique, or ``None`` when there are no results or the call failed.
        """
        if not rollout_results:
            log.error("%s no finished rollouts to critique", prefix or "")
            return None
        sampled = rollout_results
        if len(rollout_results) < self.gradient_batch_size:
            log.warning(
                "%s only %d results for a gradient batch of %d",
                prefix or "",
                len(rollout_results),
                self.gradient_batch_size,
            )
        else:
            sampled = self._rng.sample(rollout_results, self.gradient_batch_size)
        variant = self._rng.choice(GRADIENT_VARIANTS)
        messages = variant(current_prompt.prompt_template.template, sampled, self.evidence_char_budget)
        return await self._chat(self.gradient_model, messages, "critique", prefix or "")

    async def textual_gradient_and_apply_edit(
        self,
        current_prompt: VersionedPromptTemplate,
        rollout: list[RolloutResultForAPO],
        *,
        prefix: str | None = None,
    ) -> str | None:
        """Critique ``current_prompt`` on ``rollout`` results, then rewrite it (a random rewrite variant).

        Returns:
            The rewritten template text, or ``None`` when the critique or the rewrite failed.
        """
        critique = await self.compute_textual_gradient(current_prompt, rollout, prefix=prefix)
        if critique is None:
            return None
        log.info("%s Critique: %s", prefix or "", _truncate(critique, 500))
        template = current_prompt.prompt_template.template
        if self.edit_mode == "append":
            messages = _edit_append(template, _truncate(critique, MAX_CRITIQUE_CHARS))
            sentence = await self._chat(self.apply_edit_model, messages, "rewrite", prefix or "", max_tokens=48)
            return _appended(template, sentence)
        variant = self._rng.choice(APPLY_EDIT_VARIANTS)
        messages = variant(template, _truncate(critique, MAX_CRITIQUE_CHARS))
        return await self._chat(self.apply_edit_model, messages, "rewrite", prefix or "")
