"""The textual gradient: critique a prompt with the optimizer LLM, then rewrite it (mixed into ``APO``)."""

from __future__ import annotations

import logging
import random
from typing import Any, Literal

from eventlight.algorithm.apo.models import ChatMessages, RolloutResultForAPO, VersionedPromptTemplate
from eventlight.algorithm.apo.prompts import (
    APPLY_EDIT_VARIANTS,
    GRADIENT_VARIANTS,
    MAX_CRITIQUE_CHARS,
    _appended,
    _edit_append,
    _truncate,
)

log = logging.getLogger(__name__)


class TextualGradient:
    """Asks the optimizer LLM for critiques and rewrites; the textual-gradient half of ``APO``."""

    async_openai_client: Any
    gradient_model: str
    apply_edit_model: str
    diversity_temperature: float
    gradient_batch_size: int
    edit_mode: Literal["rewrite", "append"]
    optimizer_max_tokens: int | None
    evidence_char_budget: int
    _rng: random.Random

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
