"""how-to_train-first-agent.md as a program: only the import changed (``agentlightning`` -> ``eventlight``).

The room selector (tool use: ``get_rooms_and_availability``, then a final choice), graded 0/1,
trained with APO through ``Trainer(algorithm=algo, n_runners=..., initial_resources=...,
adapter=agl.TraceToMessages()).fit(...)``. The tutorial's hyper-parameters are scaled down to a
smoke run (one round, small batches) and its datasets to a few tasks; the OpenAI clients use
``OPENAI_BASE_URL`` (the tests: a scripted stand-in).
"""

from __future__ import annotations

import json
from typing import TypedDict

from openai import AsyncOpenAI, OpenAI

import eventlight as agl

ROOMS = [
    {"id": "A103", "capacity": 10, "equipment": ["whiteboard"], "free": ["10:00"]},
    {"id": "B201", "capacity": 4, "equipment": [], "free": ["10:00", "14:00"]},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_rooms_and_availability",
            "description": "Rooms and when they are free.",
            "parameters": {
                "type": "object",
                "properties": {
                    "date": {"type": "string"},
                    "time": {"type": "string"},
                    "duration_min": {"type": "integer"},
                },
                "required": ["date"],
            },
        },
    }
]


class RoomSelectionTask(TypedDict):
    id: str
    task_input: dict
    expected_choice: str


def get_rooms_and_availability(date: str | None, time_str: str | None, duration_min: int | None) -> list[dict]:
    return [room for room in ROOMS if time_str is None or time_str in room["free"]]


def grade_the_choice(final_choice: str | None, expected_choice: str) -> float:
    return 1.0 if final_choice and expected_choice in final_choice else 0.0


def prompt_template_baseline() -> agl.PromptTemplate:
    return agl.PromptTemplate(
        template="Find a room on {date} at {time} for {duration_min} minutes, {attendees} people, needs: {needs}.",
        engine="f-string",
    )


@agl.rollout
def room_selector(task: RoomSelectionTask, prompt_template: agl.PromptTemplate) -> float:
    client = OpenAI()
    messages: list = [{"role": "user", "content": prompt_template.format(**task["task_input"])}]
    # 1. First LLM call to decide if a tool is needed.
    response = client.chat.completions.create(model="gpt-5-mini", messages=messages, tools=TOOLS, tool_choice="auto")
    response_message = response.choices[0].message
    tool_calls = response_message.tool_calls
    # 2. Check if the LLM wants to use a tool.
    if tool_calls:
        messages.append(response_message)  # Append assistant's reply
        # 3. Execute the tool and get the real-world data.
        for tool_call in tool_calls:
            function_name = tool_call.function.name  # type: ignore[union-attr]
            if function_name == "get_rooms_and_availability":
                function_args = json.loads(tool_call.function.arguments)  # type: ignore[union-attr]
                function_response = get_rooms_and_availability(
                    date=function_args.get("date"),
                    time_str=function_args.get("time"),
                    duration_min=function_args.get("duration_min"),
                )
                messages.append(
                    {
                        "tool_call_id": tool_call.id,
                        "role": "tool",
                        "name": function_name,
                        "content": json.dumps(function_response),
                    }
                )
        # 4. Second LLM call with the tool's output to get a final choice.
        second_response = client.chat.completions.create(model="gpt-5-mini", messages=messages)
        final_choice = second_response.choices[0].message.content
    else:
        final_choice = response_message.content
    # 5. Grade the final choice to get a reward.
    return grade_the_choice(final_choice, task["expected_choice"])


def task(i: int, needs: str) -> RoomSelectionTask:
    inputs = {"date": "2025-10-15", "time": "10:00", "duration_min": 60, "attendees": 4 + i, "needs": needs}
    return RoomSelectionTask(id=f"t{i}", task_input=inputs, expected_choice="A103")


def main() -> None:
    openai = AsyncOpenAI()
    algo = agl.APO(openai, val_batch_size=2, gradient_batch_size=2, beam_width=1, branch_factor=1, beam_rounds=1)
    # 1. Configure the Trainer with the algorithm and initial prompt
    trainer = agl.Trainer(
        algorithm=algo,
        n_runners=2,
        initial_resources={"prompt_template": prompt_template_baseline()},
        adapter=agl.TraceToMessages(),
    )
    # 2. Load datasets: They can be list of task objects consumable by `room_selector`.
    dataset_train, dataset_val = [task(i, "whiteboard") for i in range(3)], [task(i, "none") for i in range(2)]
    # 3. Start the training process!
    trainer.fit(agent=room_selector, train_dataset=dataset_train, val_dataset=dataset_val)
    print("train-first-agent: done")


if __name__ == "__main__":
    main()
