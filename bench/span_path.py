"""CPU of a runner's span path per rollout, in process (``python -m bench.span_path``).

Runs ``--tasks`` plans of the ``batch_nosleep`` workload (the spans and attributes ``bench.runner_cpu
--agent workload`` records) through an OpenTelemetry tracer provider, then times, per rollout, what
the runner does with the agent's spans before they reach NATS (its rewards' spans, 2.8 a rollout,
are left out): ``span_from_readable`` (the tracer's conversion), ``check_spans`` (the store's
checks) and encoding the ``SpansAdded`` event. Prints the best of ``--repeats`` passes of each, in
µs of process CPU per rollout, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from bench import require_positive
from bench.workload import SCENARIOS, plan_task, run_plan, task_name
from eventlight.core.events import SpansAdded, encode_event
from eventlight.otel import span_from_readable
from eventlight.store.validate import check_spans


class _Keep(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


async def _no_sleep(_: float) -> None:
    return None


def _recorded(tasks: int, seed: int) -> list[list[ReadableSpan]]:
    """Each task's spans, as the runner's tracer gets them."""
    kept = _Keep()
    provider = TracerProvider(resource=Resource.create({"service.name": "eventlight-runner"}))
    provider.add_span_processor(kept)
    tracer = provider.get_tracer("bench")
    scenario = SCENARIOS["batch_nosleep"]
    out = []
    for i in range(tasks):
        kept.spans = []
        plan = plan_task(seed, task_name(i), scenario.max_rounds, 0.0)
        asyncio.run(run_plan(plan, tracer, lambda _reward: None, _no_sleep))
        out.append(kept.spans)
    return out


def _best_us(fn: Callable[[], Any], per: int, repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return round(min(times) * 1e6 / per, 1), result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.span_path", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    require_positive(parser, args, "tasks", "repeats")
    recorded = _recorded(args.tasks, args.seed)
    n = len(recorded)

    def convert() -> list[list[Any]]:
        return [[span_from_readable(s, "ro-0123456789ab", "at-01234567", 0) for s in spans] for spans in recorded]

    convert_us, converted = _best_us(convert, n, args.repeats)
    check_us, _ = _best_us(lambda: [check_spans(spans) for spans in converted], n, args.repeats)

    def encode() -> None:
        for spans in converted:
            encode_event(SpansAdded(time=0.0, rollout_id="ro-0123456789ab", attempt_id="at-01234567", spans=spans))

    encode_us, _ = _best_us(encode, n, args.repeats)
    result = {
        "tasks": n,
        "spans_per_rollout": round(sum(map(len, recorded)) / n, 2),
        "attributes_per_rollout": round(sum(len(s.attributes or {}) for spans in recorded for s in spans) / n, 1),
        "span_from_readable_us": convert_us,
        "check_spans_us": check_us,
        "encode_us": encode_us,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
