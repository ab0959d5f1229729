"""APO's optimizer prompts: the three critique and two rewrite variants, and the evidence budget."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from eventlight.algorithm.apo.models import ChatMessages, RolloutResultForAPO

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


def experiments_text(runs: Sequence[RolloutResultForAPO], budget_chars: int) -> str:
    """Variant 01's evidence: one ``## Experiment k`` block per run (status, final reward, the
    run's chat messages as JSON), within ``budget_chars`` in all (see ``EVIDENCE_CHAR_BUDGET``)."""
    limit = _item_limit(budget_chars, len(runs))
    return "\n\n".join(
        _GRADIENT_01_EXPERIMENT.format(
            index=i,
            status=r["status"],
            reward=_reward_text(r["final_reward"]),
            messages=_truncate(_json(r["messages"]), limit),
        )
        for i, r in enumerate(runs, 1)
    )


def span_runs_text(runs: Sequence[RolloutResultForAPO], budget_chars: int) -> tuple[str, int]:
    """Variant 02's evidence: one ``## Sample Run #k Diagnostics`` block per run (status, final
    reward, at most ``MAX_SPANS_PER_RUN`` spans as JSON), and the characters kept of each span."""
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
    return blocks, limit


def _gradient_01(template: str, runs: Sequence[RolloutResultForAPO], budget_chars: int) -> ChatMessages:
    experiments = experiments_text(runs, budget_chars)
    return [
        {
            "role": "user",
            "content": _GRADIENT_01_USER.format(prompt_template=template, experiments=experiments),
        }
    ]


def _gradient_02(template: str, runs: Sequence[RolloutResultForAPO], budget_chars: int) -> ChatMessages:
    blocks, limit = span_runs_text(runs, budget_chars)
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


GradientVariant = Callable[[str, Sequence[RolloutResultForAPO], int], ChatMessages]
"""``(template, sampled runs, evidence_char_budget) -> messages`` of one critique call."""
ApplyEditVariant = Callable[[str, str], ChatMessages]
"""``(template, critique) -> messages`` of one rewrite call."""

GRADIENT_VARIANTS: tuple[GradientVariant, ...] = (_gradient_01, _gradient_02, _gradient_03)
APPLY_EDIT_VARIANTS: tuple[ApplyEditVariant, ...] = (_edit_01, _edit_02)
