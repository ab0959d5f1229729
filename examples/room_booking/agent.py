"""Room-booking agent: pick the one meeting room that satisfies a request.

The demo task for prompt optimisation with a small local model (SmolLM2-135M-Instruct, see
``eventlight.local_llm``). Each task (``tasks.jsonl``, written by ``make_tasks.py``) lists 3-4
candidate rooms in the prompt; exactly one fits the request (capacity, equipment, wheelchair
access, no clashing booking). The agent sends one chat completion and is graded 1.0 when the
first room name in the answer is the right one, else 0.0.

The prompt template is the resource being optimised: a ``str.format`` template with the
placeholders in :data:`PLACEHOLDERS`.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import eventlight as agl

TASKS_PATH = Path(__file__).with_name("tasks.jsonl")

PLACEHOLDERS = ("date", "time", "duration_min", "attendees", "needs", "accessible_required", "rooms")
"""Fields a prompt template may use, as ``{name}``."""

INITIAL_PROMPT = """\
I need a meeting room on {date} at {time} for {duration_min} minutes for {attendees} people. \
We need: {needs}. Wheelchair access required: {accessible_required}.

Rooms:
{rooms}

Which room should I book?"""
"""The starting template: plausible, but it neither names the checks nor asks for a bare name."""

ALTERNATIVE_PROMPTS: dict[str, str] = {
    # INITIAL_PROMPT plus an answer-format instruction.
    "name_only": INITIAL_PROMPT + " Answer with only the room name.",
    # The four checks spelled out.
    "checklist": """\
Pick the one room that meets ALL of these rules:
1. seats at least {attendees}
2. has {needs}
3. wheelchair access if required (required: {accessible_required})
4. not booked at {time} for {duration_min} minutes

Rooms:
{rooms}

Answer with the room name only.""",
    # Request first, short question, bare-name answer.
    "request_first": """\
Request: {attendees} people, {date} {time}, {duration_min} min, needs {needs}, \
wheelchair access required: {accessible_required}.
Rooms:
{rooms}
Which one room meets every requirement? Reply with just its name.""",
    # One worked example before the question.
    "one_shot": """\
Pick the room that fits the request. Reply with the room name only.

Example:
Rooms:
- Alpha: 6 seats; projector; wheelchair access: yes; booked nothing
- Beta: 12 seats; projector; wheelchair access: yes; booked nothing
Request: 10 people, needs projector.
Answer: Beta

Now:
Rooms:
{rooms}
Request: {attendees} people at {time} for {duration_min} min, needs {needs}, \
wheelchair access required: {accessible_required}.
Answer:""",
}
"""Hand-written templates measured against :data:`INITIAL_PROMPT` (see ``evaluate.py``)."""


def load_tasks(path: Path | str = TASKS_PATH) -> list[dict]:
    """Read the tasks, one JSON object a line.

    Returns:
        The tasks in file order (48 for the shipped file).
    """
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def split(tasks: list[dict]) -> tuple[list[dict], list[dict]]:
    """Split tasks into a training and a validation half (first half / second half).

    ``make_tasks.py`` balances room counts (12 with 3 rooms, 12 with 4) and the position of the
    right room within each half, so answering "the first listed room" scores 7/24 on both.

    Returns:
        ``(train, val)``; 24 and 24 for the shipped file.
    """
    half = len(tasks) // 2
    return tasks[:half], tasks[half:]


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def render_rooms(task: dict) -> str:
    """The candidate rooms of ``task``, one line each, for the ``{rooms}`` placeholder.

    Example line: ``- Nova: 10 seats; projector, whiteboard; wheelchair access: yes;
    booked 09:00-10:00, 13:00-14:00``.
    """
    lines = []
    for room in task["rooms"]:
        equipment = ", ".join(room["equipment"]) or "no equipment"
        booked = ", ".join(room["booked"]) or "nothing"
        lines.append(
            f"- {room['name']}: {room['capacity']} seats; {equipment}; "
            f"wheelchair access: {_yes_no(room['accessible'])}; booked {booked}"
        )
    return "\n".join(lines)


def prompt_fields(task: dict) -> dict[str, str]:
    """The placeholder values for ``task`` (all strings)."""
    req = task["request"]
    return {
        "date": req["date"],
        "time": req["time"],
        "duration_min": str(req["duration_min"]),
        "attendees": str(req["attendees"]),
        "needs": ", ".join(req["needs"]) or "nothing",
        "accessible_required": _yes_no(req["accessible_required"]),
        "rooms": render_rooms(task),
    }


def format_prompt(template_text: str, task: dict) -> str:
    """Fill ``template_text`` for ``task``.

    Args:
        template_text: A ``str.format`` template using only names from :data:`PLACEHOLDERS`
            (literal braces must be doubled).
        task: One task from :func:`load_tasks`.

    Returns:
        The user message sent to the model.

    Raises:
        ValueError: The template uses an unknown placeholder, a positional ``{}`` or is malformed.
    """
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template_text) if f is not None}
    except ValueError as e:
        raise ValueError(f"malformed prompt template: {e}") from e
    unknown = sorted(n for n in names if n not in PLACEHOLDERS)
    if unknown:
        raise ValueError(f"prompt template uses unknown placeholders {unknown}; allowed: {list(PLACEHOLDERS)}")
    return template_text.format(**prompt_fields(task))


def first_room_mentioned(answer: str, task: dict) -> str | None:
    """The task's room name that occurs first in ``answer`` (whole word, any case), or ``None``."""
    best: tuple[int, str] | None = None
    for room in task["rooms"]:
        m = re.search(rf"\b{re.escape(room['name'])}\b", answer, flags=re.IGNORECASE)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), room["name"])
    return best[1] if best else None


def grade(answer: str, task: dict) -> float:
    """Reward of an answer: 1.0 if the first room it names is the expected one, else 0.0.

    Naming several rooms is not penalised as such, but only the first counts, so "Nova or
    Vega" is graded as "Nova". No partial credit: a wrong room is as wrong as no room.
    """
    return 1.0 if first_room_mentioned(answer, task) == task["expected_choice"] else 0.0


async def book_room(
    task: dict,
    prompt_template_text: str,
    base_url: str,
    model: str,
    api_key: str = "local",
    *,
    max_tokens: int = 24,
    client=None,
) -> tuple[float, str]:
    """Ask the model which room to book, and grade the answer.

    Args:
        task: One task from :func:`load_tasks`.
        prompt_template_text: The template to fill with :func:`format_prompt`.
        base_url: OpenAI-compatible endpoint, e.g. ``http://127.0.0.1:8000/v1``.
        model: Model name to send.
        api_key: API key (a local llama.cpp server accepts anything).
        max_tokens: Completion limit, in tokens.
        client: An ``openai.AsyncOpenAI`` to reuse; default: a new one, closed afterwards.

    Returns:
        ``(reward, answer)``: :func:`grade` of the answer, and the answer text.

    Raises:
        ValueError: The template is invalid (see :func:`format_prompt`).
        openai.APIError: The endpoint failed.
    """
    import openai

    prompt = format_prompt(prompt_template_text, task)
    own = client is None
    if own:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    try:
        r = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=max_tokens,
        )
    finally:
        if own:
            await client.close()
    answer = r.choices[0].message.content or ""
    return grade(answer, task), answer


@agl.rollout
async def room_booker(task: dict, prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    """The agent eventlight trains: one chat completion through the LLM proxy, graded against the truth.

    ``llm`` is the ``ProxyLLM`` resource already resolved to this attempt's routed URL, so the proxy
    records the call as a span of this attempt; the returned reward becomes the final reward span.
    """
    reward, _answer = await book_room(task, prompt_template.template, llm.endpoint, llm.model, llm.api_key or "local")
    return reward
