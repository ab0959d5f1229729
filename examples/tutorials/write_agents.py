"""tutorials_write-agents.md as a program: only the import changed (``agentlightning`` -> ``eventlight``).

The tutorial's agents — ``room_selector`` (``@rollout`` with a ``PromptTemplate``),
``flight_assistant`` (``@rollout`` with ``llm`` and ``rollout``) and ``RoomSelectorAgent`` (a
``LitAgent`` class) — each run on two tasks with ``Trainer(...).dev(...)``. The tutorial's elided
parts (``...``: the grader, the LLM logic) are filled in minimally. The doc's
``Trainer().fit(agent=room_selector, train_dataset=dataset)`` has no algorithm, so it only serves
the queue (in Agent-lightning 0.3.0 too); ``dev`` runs the dataset through ``Baseline``.

The LLM is whatever ``OPENAI_BASE_URL`` names (the tests: a scripted stand-in).
"""

from __future__ import annotations

import os
from typing import TypedDict

from openai import OpenAI

import eventlight as agl
from eventlight import LLM, Dataset, PromptTemplate, Rollout, Trainer, rollout


class RoomSelectionTask(TypedDict):
    date: str
    time: str
    duration_min: int
    attendees: int
    expected_choice: str


class FlightBookingTask(TypedDict):
    request: str
    expected_booking: dict


def room_selection_grader(final_message: str | None, expected_choice: str) -> float:
    return 1.0 if final_message and expected_choice in final_message else 0.0


def grade_flight_booking(final_message: str | None, expected_booking: dict) -> float:
    return 1.0 if final_message and expected_booking["to"] in final_message else 0.0


def call_llm(prompt: str) -> str | None:
    client = OpenAI()
    response = client.chat.completions.create(model="gpt-4.1-nano", messages=[{"role": "user", "content": prompt}])
    return response.choices[0].message.content


@rollout
def room_selector(task: RoomSelectionTask, prompt_template: PromptTemplate) -> float:
    # 1. Use the injected prompt_template to format the input for the LLM
    prompt = prompt_template.format(**task)
    # 2. Execute the agent's logic (e.g., call an LLM, use tools)
    final_message = call_llm(prompt)
    # 3. Grade the final choice to get a reward
    reward = room_selection_grader(final_message, task["expected_choice"])
    # 4. Return the final reward as a float
    return reward


@rollout
def flight_assistant(task: FlightBookingTask, llm: LLM, rollout: Rollout) -> float:
    print(f"Rollout ID: {rollout.rollout_id}")
    print(f"Rollout Mode: {rollout.mode}")
    client = OpenAI(base_url=llm.endpoint, api_key=llm.api_key or "dummy-key")
    response = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["request"]}])
    final_message = response.choices[0].message.content
    reward = grade_flight_booking(final_message, task["expected_booking"])
    return reward


class RoomSelectorAgent(agl.LitAgent[RoomSelectionTask]):
    def rollout(self, task: RoomSelectionTask, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        prompt_template: PromptTemplate = resources["prompt_template"]  # type: ignore[assignment]
        prompt = prompt_template.format(**task)
        final_message = call_llm(prompt)
        return room_selection_grader(final_message, task["expected_choice"])


def main() -> None:
    dataset: Dataset[RoomSelectionTask] = [
        RoomSelectionTask(date="2025-10-15", time="10:00", duration_min=60, attendees=10, expected_choice="A103"),
        RoomSelectionTask(date="2025-10-16", time="10:00", duration_min=60, attendees=10, expected_choice="A103"),
    ]
    prompt = PromptTemplate(template="Find a room on {date} at {time} for {attendees} people.", engine="f-string")
    Trainer(n_runners=1, initial_resources={"prompt_template": prompt}).dev(room_selector, dataset)
    Trainer(n_runners=1, initial_resources={"prompt_template": prompt}).dev(RoomSelectorAgent(), dataset)
    flights: Dataset[FlightBookingTask] = [
        FlightBookingTask(request="Book a flight to Paris on Friday.", expected_booking={"to": "Paris"}),
    ]
    llm = LLM(endpoint=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"), model="gpt-4.1-nano")
    Trainer(n_runners=1, initial_resources={"llm": llm}).dev(flight_assistant, flights)
    print("write-agents: done")


if __name__ == "__main__":
    main()
