"""tutorials_emitter.md as a program: only the import changed (``agentlightning`` -> ``eventlight``).

``multi_step_agent`` emits a message, an object, an intermediate reward and (on a bad plan) an
exception; ``operation`` wraps a helper as a decorator and as a context manager; ``emit_object``
with semconv attributes. The tutorial's elided helpers (``generate_plan``, ``grade_plan``, ...)
are filled in minimally. It runs one rollout with ``LitAgentRunner.step`` on an
``InMemoryLightningStore`` (as tutorials_debug.md does) and prints the spans.
Not ported: ``agentlightning.utils.otel.extract_links_from_attributes`` / ``query_linked_spans``
(eventlight has no span links yet).
"""

from __future__ import annotations

import asyncio

from opentelemetry.semconv.attributes import server_attributes

import eventlight as agl
from eventlight import PromptTemplate, emit_object


def generate_plan(task: dict, prompt_template: PromptTemplate) -> list[str]:
    return [step.strip() for step in prompt_template.format(**task).split(",")]


def grade_plan(plan: list[str]) -> float:
    return 0.5 if plan else 0.0


@agl.operation
def execute_plan(plan: list[str]) -> str:
    return " then ".join(plan)


@agl.operation(name="custom-name")
def any_weird_name_i_dont_want() -> None:
    pass


def custom_grade_final_result(result: str, expected: str) -> float:
    return 1.0 if result == expected else 0.0


@agl.rollout
def multi_step_agent(task: dict, prompt_template: PromptTemplate) -> float:
    try:
        # Step 1: Initial planning
        agl.emit_message("Starting planning phase.")
        plan = generate_plan(task, prompt_template)
        agl.emit_object({"plan_steps": len(plan), "first_step": plan[0]})
        # Award a small reward for a valid plan
        plan_reward = grade_plan(plan)
        agl.emit_reward(plan_reward)
        # Step 2: Execute the plan
        agl.emit_message(f"Executing {len(plan)}-step plan.")
        execution_result = execute_plan(plan)
        any_weird_name_i_dont_want()
        with agl.operation(user_id=123) as op:
            op.set_input(plan=plan)
            op.set_output(execution_result)
        emit_object(
            {"name": "John Doe", "age": 30, "email": "john.doe@example.com"},
            attributes={server_attributes.SERVER_ADDRESS: "127.0.0.1", server_attributes.SERVER_PORT: 8080},
        )
        # Step 3: Final evaluation
        final_reward = custom_grade_final_result(execution_result, task["expected_output"])
        # The return value is treated as the final reward for the rollout
        return final_reward
    except ValueError as e:
        # Record the specific error and return a failure reward
        agl.emit_exception(e)
        return 0.0


async def main() -> None:
    tracer = agl.OtelTracer()
    runner = agl.LitAgentRunner(tracer)
    store = agl.InMemoryLightningStore()
    resource = agl.PromptTemplate(template="{first}, {second}", engine="f-string")
    with runner.run_context(agent=multi_step_agent, store=store):
        rollout = await runner.step(
            {"first": "boil water", "second": "add tea", "expected_output": "boil water then add tea"},
            resources={"prompt_template": resource},
        )
    spans = await store.query_spans(rollout.rollout_id)
    for span in spans:
        print(f"- {span.name}: {dict(span.attributes)}")
    print(f"emitter: final reward {agl.find_final_reward(list(spans))}, {len(spans)} spans")


if __name__ == "__main__":
    asyncio.run(main())
