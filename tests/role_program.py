"""One training script for both roles (tutorials_parallelize.md): ``AGL_CURRENT_ROLE`` picks the side.

Run by ``tests/test_trainer_strategies.py`` twice, as two processes that share only
``EVENTLIGHT_NATS_URL``, ``EVENTLIGHT_PG_DSN`` and ``EVENTLIGHT_NAMESPACE``::

    AGL_CURRENT_ROLE=algorithm python tests/role_program.py --max-rollouts 3
    AGL_CURRENT_ROLE=runner python tests/role_program.py --max-rollouts 3
"""

from __future__ import annotations

import argparse
import logging

import eventlight as agl

TASKS = ["What's 1 + 1?", "What's the capital of France?", "Why is the sky blue?"]


@agl.rollout
def score_length(task: str, prompt_template: agl.PromptTemplate) -> float:
    return float(len(prompt_template.format(any_question=task)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-runners", type=int, default=1)
    parser.add_argument("--max-rollouts", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    trainer = agl.Trainer(
        algorithm=agl.Baseline(),
        n_runners=args.n_runners,
        max_rollouts=args.max_rollouts,
        initial_resources={"prompt_template": agl.PromptTemplate(template="Q: {any_question}", engine="f-string")},
        strategy="cs",
    )
    trainer.fit(score_length, TASKS)


if __name__ == "__main__":
    main()
