"""Adapter throughput: spans per second of each adapter on one recorded trace of ``--spans`` spans.

    python -m bench.adapters [--spans 10000] [--repeat 3] [--out FILE.json]

The trace is what a multi-turn agent under a runner leaves: one root agent span, then per turn an
agent-step span holding a proxy LLM call (prompt and completion token ids, a response id, the
current GenAI and the flat attributes) and a tool span, and every tenth turn a reward annotation;
ids and parents are set as the tracer sets them, in sequence order. Each adapter
(``TracerTraceToTriplet``, ``LlmProxyTraceToTriplet``, ``TraceToMessages``) adapts the whole
trace ``--repeat`` times; the best time counts (the least disturbed by other work on the machine).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import require_positive
from bench.report import print_and_save
from eventlight.adapter import LlmProxyTraceToTriplet, TracerTraceToTriplet, TraceToMessages
from eventlight.core.types import Span

RID, AID, TRACE = "ro-bench", "at-bench", "0" * 31 + "1"


def _span(seq: int, name: str, parent: str | None, attrs: dict[str, Any], t: float) -> Span:
    return Span.from_attributes(
        attributes=attrs,
        rollout_id=RID,
        attempt_id=AID,
        sequence_id=seq,
        name=name,
        trace_id=TRACE,
        span_id=f"{seq:016x}",
        parent_id=parent,
        start_time=t,
        end_time=t + 0.5,
    )


def recorded_trace(n_spans: int) -> list[Span]:
    """About ``n_spans`` spans (see the module docstring), in sequence order."""
    spans = [_span(1, "agent.run", None, {"agent.name": "solver"}, 0.0)]
    root = spans[0].span_id
    turn = 0
    while len(spans) < n_spans:
        turn += 1
        t = float(turn)
        step = _span(len(spans) + 1, "agent.step", root, {"agent.name": "solver"}, t)
        question, answer = f"turn {turn}: what is {turn} + 1?", f"{turn + 1}"
        llm = _span(
            len(spans) + 2,
            "openai.chat.completion",
            step.span_id,
            {
                "gen_ai.system": "hosted_vllm",
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "policy",
                "gen_ai.response.id": f"chatcmpl-{turn}",
                "gen_ai.prompt.0.role": "user",
                "gen_ai.prompt.0.content": question,
                "gen_ai.completion.0.role": "assistant",
                "gen_ai.completion.0.content": answer,
                "gen_ai.input.messages": json.dumps(
                    [{"role": "user", "parts": [{"type": "text", "content": question}]}]
                ),
                "gen_ai.output.messages": json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": answer}], "finish_reason": "stop"}]
                ),
                "gen_ai.usage.input_tokens": 24,
                "gen_ai.usage.output_tokens": 3,
                "prompt_token_ids": list(range(100, 124)),
                "response_token_ids": [7, 8, 2],
            },
            t + 0.1,
        )
        tool = _span(len(spans) + 3, "tool.call", step.span_id, {"tool.name": "add", "tool.output": answer}, t + 0.3)
        spans += [step, llm, tool]
        if turn % 10 == 0:
            reward = {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 1.0}
            spans.append(_span(len(spans) + 1, "agentlightning.annotation", step.span_id, reward, t + 0.4))
    return spans[:n_spans]


def measure(spans: list[Span], repeat: int) -> dict[str, dict[str, Any]]:
    adapters = {
        "TracerTraceToTriplet": TracerTraceToTriplet(),
        "LlmProxyTraceToTriplet": LlmProxyTraceToTriplet(),
        "TraceToMessages": TraceToMessages(),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, adapter in adapters.items():
        best, records = float("inf"), 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            records = len(adapter.adapt(spans))
            best = min(best, time.perf_counter() - t0)
        out[name] = {"records": records, "best_s": round(best, 3), "spans_per_s": round(len(spans) / best)}
    return out


def report(result: dict[str, Any]) -> str:
    lines = [
        f"one trace of {result['spans']:,} spans, best of {result['repeat']}",
        "",
        "| adapter | records | best s | spans/s |",
        "|---|---|---|---|",
    ]
    for name, r in result["adapters"].items():
        lines.append(f"| {name} | {r['records']:,} | {r['best_s']} | {r['spans_per_s']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.adapters", description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "spans", "repeat")
    spans = recorded_trace(args.spans)
    result = {"spans": len(spans), "repeat": args.repeat, "adapters": measure(spans, args.repeat)}
    print_and_save(report(result), result, args.out)


if __name__ == "__main__":
    main()
