"""The textual gradient: critique a prompt with the optimizer LLM, then rewrite it (mixed into ``APO``).

An optimizer that cannot be used at all stops the run with ``LLMUnavailableError`` naming its
endpoint and model, instead of a run that logs one failure per child and ends with nothing:

* before the first rollout, when the endpoint takes no connection (``check_optimizer``: one
  ``GET /models``, no tokens spent; any answer, an error status included, passes);
* at the first optimizer call of a run that fails as unusable (``unusable``: no connection or no
  answer in time, the key refused with 401 or 403, the model unknown with 404), since nothing of
  this endpoint has answered yet;
* at the end of a round in which every optimizer call failed as unusable or with a 5xx status
  (``server_error``: a proxy whose backend is down answers 502 to every call; each such answer
  came after the client's own retries, the OpenAI SDK's two by default), the message naming the
  last failure's status.

A 5xx does not stop the run at its first call: it may pass (the next call answers). Any other
failure (a 4xx status other than those above, an empty answer, an exception of a look-alike
client) is logged and its child skipped, as before.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any, Literal

from eventlight.algorithm.apo.models import ChatMessages, RolloutResultForAPO, VersionedPromptTemplate
from eventlight.algorithm.apo.prompts import (
    APPLY_EDIT_VARIANTS,
    GRADIENT_VARIANTS,
    MAX_CRITIQUE_CHARS,
    ApplyEditVariant,
    GradientVariant,
    _appended,
    _edit_append,
    _truncate,
)
from eventlight.core.errors import LLMUnavailableError

log = logging.getLogger(__name__)

DEFAULT_GRADIENT_MODEL = "gpt-5-mini"
DEFAULT_APPLY_EDIT_MODEL = "gpt-4.1-mini"
"""Agent-lightning's defaults: OpenAI's model names, which a local endpoint does not serve."""
CHECK_TIMEOUT_S = 10.0
"""Seconds ``check_optimizer`` waits for each try of ``GET /models``."""
UNUSABLE_STATUS = (401, 403, 404)
"""HTTP statuses that say an optimizer call cannot succeed: the key refused, the model unknown."""


def no_connection(e: BaseException) -> bool:
    """The endpoint took no connection or gave no answer in time (the OpenAI SDK's
    ``APIConnectionError``, ``APITimeoutError``; httpx's transport errors; ``OSError``s of a socket)."""
    if isinstance(e, ConnectionError | TimeoutError):
        return True
    # The SDKs are loaded by whoever raised their errors. Not imported here: every process that
    # imports eventlight (each runner) would pay for them, about 30 MB and 0.4 s.
    openai, httpx = sys.modules.get("openai"), sys.modules.get("httpx")
    return (openai is not None and isinstance(e, openai.APIConnectionError)) or (
        httpx is not None and isinstance(e, httpx.TransportError)
    )


def server_error(e: BaseException) -> int | None:
    """The status of an optimizer call's error that is an answer of status 500 to 599 (the OpenAI
    SDK's ``InternalServerError``, or any error with such an ``int`` ``status_code``), else ``None``."""
    status = getattr(e, "status_code", None)
    return status if isinstance(status, int) and 500 <= status <= 599 else None


def unusable(e: BaseException) -> bool:
    """An optimizer call's error says no call can succeed: ``no_connection``, or an answer with
    status 401 or 403 (the key) or 404 (the model, or the path, does not exist there)."""
    return no_connection(e) or getattr(e, "status_code", None) in UNUSABLE_STATUS


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
    gradient_variants: tuple[GradientVariant, ...] = GRADIENT_VARIANTS
    """Critique prompts, one picked uniformly at random per call (``gradient_prompt_files`` replace them)."""
    apply_edit_variants: tuple[ApplyEditVariant, ...] = APPLY_EDIT_VARIANTS
    """Rewrite prompts, one picked uniformly at random per call (``apply_edit_prompt_files`` replace them)."""
    _rng: random.Random
    _answered = False
    """Some optimizer call of this run got an answer."""
    _calls: tuple[int, int] = (0, 0)
    """Optimizer calls of the current round, and how many of them failed as ``unusable`` or ``server_error``."""
    _last_failure = ""
    """The latest such failure of the round: call, status when there is one, error type and message."""
    _short_batch_warned = False
    """A gradient batch of the current round had fewer results than ``gradient_batch_size``, and it was logged."""

    # -- the optimizer LLM --------------------------------------------------------------------

    def optimizer_endpoint(self) -> str:
        """Where the optimizer calls go: the client's ``base_url``, else its type."""
        client = self.async_openai_client
        base_url = getattr(client, "base_url", None)
        return str(base_url) if base_url is not None else f"the optimizer client {type(client).__name__}"

    def _unavailable(self, detail: str, models: list[str]) -> LLMUnavailableError:
        defaults = [
            f"{m!r} is APO's default {name} (Agent-lightning's)"
            for m, name, default in (
                (self.gradient_model, "gradient_model", DEFAULT_GRADIENT_MODEL),
                (self.apply_edit_model, "apply_edit_model", DEFAULT_APPLY_EDIT_MODEL),
            )
            if m == default and m in models
        ]
        hint = (
            f" ({'; '.join(defaults)}: name a model your endpoint serves with APO(gradient_model=..., "
            "apply_edit_model=...))"
            if defaults
            else ""
        )
        distinct = list(dict.fromkeys(models))
        named = ("model " if len(distinct) == 1 else "models ") + " and ".join(map(repr, distinct))
        return LLMUnavailableError(
            f"APO's optimizer at {self.optimizer_endpoint()} ({named})",
            f"{detail.rstrip('.')}{hint}; the run was stopped",
        )

    async def check_optimizer(self) -> None:
        """Check that the optimizer's endpoint takes a connection, before any rollout: one
        ``GET /models`` (``CHECK_TIMEOUT_S`` a try) when the client has ``models.list`` (an
        ``openai.AsyncOpenAI`` does; a look-alike without it is not checked). Any answer passes,
        an error status too (an endpoint without ``/models``, a key that may not list models).

        Raises:
            LLMUnavailableError: No connection, or no answer in time; it names the endpoint and models.
        """
        client = self.async_openai_client
        if not callable(getattr(getattr(client, "models", None), "list", None)):
            return
        with_options = getattr(client, "with_options", None)
        if callable(with_options):
            client = with_options(timeout=CHECK_TIMEOUT_S)
        try:
            await client.models.list()
        except Exception as e:
            if no_connection(e):
                raise self._unavailable(
                    f"GET /models: {type(e).__name__}: {e}", [self.gradient_model, self.apply_edit_model]
                ) from e
            log.debug("APO's optimizer check: GET /models answered %s: %s (so it is up)", type(e).__name__, e)

    def _new_round(self) -> None:
        self._calls = (0, 0)
        self._last_failure = ""
        self._short_batch_warned = False

    def _check_round(self, round_no: int) -> None:
        """Stop the run when every optimizer call of the round failed as ``unusable`` or with a 5xx.

        Raises:
            LLMUnavailableError: They did (and there was at least one); it names the last failure.
        """
        calls, failed = self._calls
        if calls and failed == calls:
            raise self._unavailable(
                f"all {calls} optimizer call(s) of round {round_no} failed, the last: {self._last_failure} "
                "(see the errors logged above)",
                [self.gradient_model, self.apply_edit_model],
            )

    async def _chat(
        self, model: str, messages: ChatMessages, what: str, prefix: str, max_tokens: int | None = None
    ) -> str | None:
        """One optimizer call; ``None`` (logged) when it raises or returns nothing.

        Raises:
            LLMUnavailableError: The call failed as ``unusable`` and no optimizer call of this run
                has answered yet.
        """
        limit = max_tokens if max_tokens is not None else self.optimizer_max_tokens
        extra: dict[str, Any] = {"max_tokens": limit} if limit is not None else {}
        calls, failed = self._calls
        try:
            response = await self.async_openai_client.chat.completions.create(
                model=model, messages=messages, temperature=self.diversity_temperature, **extra
            )
            content: str | None = response.choices[0].message.content
        except Exception as e:  # a misbehaving optimizer LLM does not end the run (difference f)
            status = server_error(e)
            down = unusable(e) or status is not None
            self._calls = (calls + 1, failed + down)
            if down:
                shown = f"HTTP {status}, " if status is not None else ""
                self._last_failure = f"{what} call to {model!r}: {shown}{type(e).__name__}: {e}"
            if unusable(e) and not self._answered:  # an absent one does: nothing of it has answered
                raise self._unavailable(f"{what} call: {type(e).__name__}: {e}", [model]) from e
            log.error("%s %s call to %s failed: %s: %s", prefix, what, model, type(e).__name__, e)
            return None
        self._answered = True
        self._calls = (calls + 1, failed)
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

        Shows ``gradient_batch_size`` randomly sampled results (all of them when fewer are
        available, with a warning once per round: a train set smaller than the batch makes every
        batch of every round short).

        Returns:
            The critique, or ``None`` when there are no results or the call failed.
        """
        if not rollout_results:
            log.error("%s no finished rollouts to critique", prefix or "")
            return None
        sampled = rollout_results
        if len(rollout_results) < self.gradient_batch_size:
            log.log(
                logging.DEBUG if self._short_batch_warned else logging.WARNING,
                "%s only %d results for a gradient batch of %d (warned once per round)",
                prefix or "",
                len(rollout_results),
                self.gradient_batch_size,
            )
            self._short_batch_warned = True
        else:
            sampled = self._rng.sample(rollout_results, self.gradient_batch_size)
        variant = self._rng.choice(self.gradient_variants)
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
        variant = self._rng.choice(self.apply_edit_variants)
        messages = variant(template, _truncate(critique, MAX_CRITIQUE_CHARS))
        return await self._chat(self.apply_edit_model, messages, "rewrite", prefix or "")
