"""``APO``: the beam search over prompt templates (Agent-lightning ``APO``)."""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Sequence
from typing import Any, Literal

from eventlight.algorithm.apo.checks import _clean_edit, _field_names, _format_error, _prefix
from eventlight.algorithm.apo.critic import DEFAULT_APPLY_EDIT_MODEL, DEFAULT_GRADIENT_MODEL, TextualGradient
from eventlight.algorithm.apo.evaluation import RolloutEvaluation
from eventlight.algorithm.apo.models import ProgressCallback, T_task, VersionedPromptTemplate
from eventlight.algorithm.apo.prompt_files import apply_edit_files, gradient_files
from eventlight.algorithm.apo.prompts import APPLY_EDIT_VARIANTS, EVIDENCE_CHAR_BUDGET, GRADIENT_VARIANTS
from eventlight.algorithm.base import Dataset, batch_iter_over_dataset
from eventlight.algorithm.checks import (
    MAX_COUNT,
    MAX_TOKENS,
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_number,
    check_version_prefix,
)
from eventlight.core.errors import InvalidInputError, InvalidTypeError
from eventlight.core.types import (
    PromptTemplate,
    RolloutConfig,
)

log = logging.getLogger(__name__)


class APO(TextualGradient, RolloutEvaluation[T_task]):
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
        ``gradient_prompt_files`` / ``apply_edit_prompt_files`` are therefore plain-text templates
        of one user message filled with ``str.format``, not POML (see Args); ``_poml_trace`` has
        no effect.
    (b) The published resources are ALL initial resources with the tuned template replaced, so an
        agent that also needs its LLM (e.g. a ``ProxyLLM``) still gets it. They are published with
        ``store.update_resources(version, ...)``; the resources id is the version ("v0", "v1", ...),
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
        parent's text as a duplicate child when the critique fails). An optimizer that cannot be
        used at all stops the run with ``LLMUnavailableError`` naming its endpoint and model
        (Agent-lightning logs each failure and goes on): one whose endpoint takes no connection,
        checked before the first rollout (``check_optimizer``: ``GET /models``); a first
        optimizer call of the run that gets no connection, no answer in time, 401, 403 or 404
        (an unknown model, such as the default ``gpt-5-mini`` on a local server); and a round in
        which every optimizer call failed so or with a 5xx status (after the client's own retries:
        a proxy whose backend is down; one 5xx that a later answer follows stops nothing), the
        message naming the last failure's status. A child that is empty or
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
        gradient_model: Model for critiques (default Agent-lightning's, an OpenAI model name:
            name your endpoint's model).
        apply_edit_model: Model for rewrites (default Agent-lightning's, as ``gradient_model``).
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
        gradient_prompt_files: Paths (``str`` or ``Path``) of critique prompts that replace the
            three built-in variants; one is picked uniformly at random per critique call, as the
            built-ins are. ``None`` or ``[]``: the built-ins. Each file is a UTF-8 plain-text
            template of ONE user message (no system message) for ``str.format``, read once here,
            using any of ``{prompt_template}`` (the template critiqued), ``{experiments}`` (per
            sampled run: status, final reward, chat messages as JSON), ``{runs}`` (per sampled
            run: status, final reward, at most ``{max_spans}`` spans as JSON, each cut to
            ``{max_chars}`` characters), ``{max_spans}`` and ``{max_chars}``, and at least
            ``{prompt_template}`` and one of ``{experiments}`` and ``{runs}`` (as every built-in
            variant); a literal brace is written ``{{`` or ``}}``. Agent-lightning's ``.poml`` files
            are refused: convert them.
        apply_edit_prompt_files: Paths of rewrite prompts that replace the two built-in variants,
            as ``gradient_prompt_files``, using both ``{prompt_template}`` and ``{critique}``. Not
            used with ``edit_mode="append"``.
        _poml_trace: Agent-lightning's POML debug trace; eventlight has no POML renderer, so
            ``True`` only logs (INFO) that it has no effect.

    Raises:
        InvalidInputError: A size or count below 1 (``beam_rounds`` below 0), a timeout not above
            0, a negative, NaN or infinite temperature, an unknown ``edit_mode``, a ``version_prefix``
            no id may start with; the message names the argument, the value and what it may be.
            A prompt file that is ``.poml``, missing, unreadable, not UTF-8, empty, uses an
            unknown placeholder (or one ``str.format`` cannot fill) or misses a required one; the
            message names the file (and the placeholder).
        InvalidTypeError: An argument of the wrong type (``beam_width="4"``, ``beam_rounds=2.0``, a
            ``progress`` that cannot be called, a single path instead of a list of paths).
            Both are ``ValueError`` s.
    """

    def __init__(
        self,
        async_openai_client: Any,
        *,
        gradient_model: str = DEFAULT_GRADIENT_MODEL,
        apply_edit_model: str = DEFAULT_APPLY_EDIT_MODEL,
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
        gradient_prompt_files: Sequence[str | os.PathLike[str]] | None = None,
        apply_edit_prompt_files: Sequence[str | os.PathLike[str]] | None = None,
        _poml_trace: bool = False,
    ):
        check_version_prefix("APO.version_prefix", version_prefix)
        check_choice("APO.edit_mode", edit_mode, ("rewrite", "append"))
        for name, model in (("gradient_model", gradient_model), ("apply_edit_model", apply_edit_model)):
            if not isinstance(model, str) or not model:
                error = InvalidInputError if isinstance(model, str) else InvalidTypeError
                raise error(f"APO.{name} must be a model name, got {model!r:.80}")
        self.diversity_temperature = check_number("APO.diversity_temperature", diversity_temperature, 0.0)
        self.gradient_batch_size = check_int("APO.gradient_batch_size", gradient_batch_size, 1, MAX_COUNT)
        self.val_batch_size = check_int("APO.val_batch_size", val_batch_size, 1, MAX_COUNT)
        self.beam_width = check_int("APO.beam_width", beam_width, 1, MAX_COUNT)
        self.branch_factor = check_int("APO.branch_factor", branch_factor, 1, MAX_COUNT)
        self.beam_rounds = check_int("APO.beam_rounds", beam_rounds, 0, MAX_COUNT)
        self.rollout_batch_timeout = check_number("APO.rollout_batch_timeout", rollout_batch_timeout, 0.0, above=True)
        self.run_initial_validation = check_bool("APO.run_initial_validation", run_initial_validation)
        if rollout_config is not None and not isinstance(rollout_config, RolloutConfig):
            raise InvalidTypeError(f"APO.rollout_config must be a RolloutConfig or None, got {rollout_config!r:.80}")
        if optimizer_max_tokens is not None:
            optimizer_max_tokens = check_int("APO.optimizer_max_tokens", optimizer_max_tokens, 1, MAX_TOKENS)
        check_callable("APO.progress", progress)
        if check_bool("APO._poml_trace", _poml_trace):
            log.info("APO(_poml_trace=True) has no effect: eventlight renders its optimizer prompts without POML")
        self.gradient_variants = gradient_files("APO.gradient_prompt_files", gradient_prompt_files) or GRADIENT_VARIANTS
        self.apply_edit_variants = (
            apply_edit_files("APO.apply_edit_prompt_files", apply_edit_prompt_files) or APPLY_EDIT_VARIANTS
        )
        self.async_openai_client = async_openai_client
        self.gradient_model = gradient_model
        self.apply_edit_model = apply_edit_model
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
            LLMUnavailableError: The optimizer cannot be used at all (difference (f)); the message
                names its endpoint and model.
        """
        if not train_dataset or not val_dataset:
            raise ValueError("APO needs a non-empty train_dataset and val_dataset")
        self.get_adapter()  # fail before any rollout
        self.get_store()
        name, seed = self.get_seed_prompt_template()
        self._start(seed)
        await self.check_optimizer()
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
        self._answered = False
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
        self._new_round()
        for beam_no, parent in enumerate(self._sample_parents(beam), 1):
            for branch_no in range(1, self.branch_factor + 1):
                prefix = _prefix(round_no, beam_no, branch_no, parent.version)
                results, _ = await self.evaluate_prompt_on_batch(parent, name, next(grad_iter), "train", prefix=prefix)
                text = await self.textual_gradient_and_apply_edit(parent, results, prefix=prefix)
                child = self._accept_child(round_no, parent, text, prefix)
                if child is not None:
                    children.append(child)
        self._check_round(round_no)
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
