"""Tables, JSON and a chart from the suite's results.

``write(results, out_dir)`` writes ``results.json`` (everything, raw), ``table.md`` (the tables
below) and ``chart.png`` (matplotlib), and returns the tables as text. Columns of the scenario table:

* ``rollouts/s``, ``spans/s``: finished (and checked) rollouts and their stored spans per second of
  the measured window (first enqueue to last check);
* ``lat p50/p99``: enqueue to the algorithm seeing the rollout finished (it polls every 50 ms);
* ``claim p50/p99``: a runner's dequeue call that returned a rollout, from
  ``max(call start, rollout enqueued)`` to its return (so eventlight's long poll is not counted as
  latency, nor the peer's sleep between polls);
* ``RSS sum``: peak over the window of the summed RSS of all the stack's processes (algorithm,
  servers and their children, runners), sampled every 0.5 s; ``PSS``: the same processes' PSS at
  the end of the window, which counts shared pages once (forked runners share most of theirs);
* ``CPU s/rollout``: user+system CPU of all those processes in the window, per rollout;
* ``vs peer``: eventlight's rollouts/s over the peer's in the same run (only when both passed);
* ``vs ceiling``: rollouts/s over the ceiling probe's for the scenario's mean spans per rollout
  (only for runs that passed);
* ``agent bound``: runners / mean planned sleep per rollout (a store taking zero time; ignores
  batch barriers), and ``vs bound`` the fraction of it reached; for ``batch`` mode also the bound
  with the wait for each batch's slowest rollout ("w/ barrier", the planned sleeps list-scheduled
  on the runners). Without sleeps ("(CPU)"): cores / the agent's own CPU per rollout (its plan
  and its OpenTelemetry spans, no store: ``workload.agent_cpu_s_per_rollout``), what a store taking
  zero CPU would leave room for.

Micro table: ops/s of each stack with the min–max of its blocks' rates (``bench.micro`` splits
each operation's time into blocks), p50 and CPU per op, their ratio, and two raw rates:

* ``raw own stream``: the operation's raw twin (``bench.raw_twins``): the same messages, by
  nats-py / asyncpg alone, on eventlight's own stream with its consumers and its projector
  applying them, in blocks alternating with the operation's in the same run; ``vs raw own`` is the
  operation's ops/s over the twin's (all blocks), with the min / median / max of the ratio per pair
  of blocks.
  This is the like-for-like ratio; one noisy run shows as a wide pair range.
* ``raw fresh stream`` (the older row, kept so reports compare with earlier ones): the rate of the
  server round trips the operation needs at the least (``MICRO_ROUND_TRIPS``), made back to back
  by nats-py / asyncpg alone on a stream of their own with no consumers, on the same servers right
  after eventlight's operations (``round_trips`` of its micro result; ``1 / sum(count / rate)``
  over them). It has no projector or consumers to feed and runs after, not beside, the operations,
  so it swings more than the operation does (763–3,492 publishes/s over 12 runs).

A write that is its own message needs at least one fsynced JetStream append; ``add_span`` has
neither raw row because concurrent calls of one process share a message (group commit). ``vs raw``
near 1 means the store adds little on top of the servers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import write_json
from bench.workload import SCENARIOS, expected_spans_per_rollout

STACK_ORDER = ["eventlight", "agentlightning"]
MICRO_OPS = ["enqueue", "dequeue_empty", "dequeue", "dequeue_update", "add_span", "query_spans", "heartbeat"]
# the round trips (bench.ceiling.round_trips) each micro operation needs at the least on eventlight;
# add_span has none: concurrent calls share one SpansAdded message (group commit)
MICRO_ROUND_TRIPS: dict[str, dict[str, int]] = {
    "enqueue": {"publish": 1},  # RolloutCreated
    "dequeue_empty": {"pull": 1},
    "dequeue": {"pull": 1, "publish": 1},  # the message, then the claim (AttemptStarted)
    "dequeue_update": {"pull": 1, "publish": 2},  # ... and AttemptUpdated(succeeded)
    "query_spans": {"pg_select": 1},
    "heartbeat": {"publish": 1},  # WorkerHeartbeat
}


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and v == float("inf"):
        return "∞"
    return f"{v:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}×"


def one_line(entry: dict[str, Any]) -> str:
    """A short summary of one run for progress output."""
    if "ops" in entry and entry.get("ops"):
        ops = ", ".join(f"{k} {v.get('ops_per_s', 0):.0f}/s" for k, v in entry["ops"].items())
        return ("ok " if entry.get("ok") else f"FAILED ({entry.get('error')}) ") + ops
    if not entry.get("ok") and "rollouts_per_s" not in entry:
        return f"FAILED: {entry.get('error')}"
    state = "ok" if entry.get("ok") else f"FAILED ({entry.get('error')})"
    return (
        f"{state}: {entry.get('rollouts')} rollouts in {entry.get('wall_s')} s = {entry.get('rollouts_per_s')}/s, "
        f"{entry.get('spans_per_s')} spans/s, CPU {entry.get('cpu_s_per_rollout')} s/rollout, "
        f"RSS {entry.get('peak_rss_mb')} MB (process {entry.get('process_wall_s')} s)"
    )


def _ceiling_for(results: dict[str, Any], scn: dict[str, Any]) -> float | None:
    c = results.get("ceiling") or {}
    if not c.get("ok"):
        return None
    s = str(round(expected_spans_per_rollout(scn["max_rounds"])))
    return (c["by_spans"].get(s) or {}).get("ceiling_rollouts_per_s")


def scenario_table(results: dict[str, Any]) -> str:
    head = (
        "| scenario | stack | status | rollouts/s | spans/s | lat p50 / p99 (s) | claim p50 / p99 (ms) "
        "| RSS sum (MB) | PSS (MB) | CPU s/rollout | vs peer | vs ceiling | agent bound | vs bound |"
    )
    lines = [head, "|" + "---|" * 14]
    for name, by_stack in results.get("scenarios", {}).items():
        peer = by_stack.get("agentlightning") or {}
        for stack in [s for s in STACK_ORDER if s in by_stack]:
            e = by_stack[stack]
            scn = e.get("scenario") or SCENARIOS[name].scaled(results["meta"]["scale"]).to_dict()
            status = "ok" if e.get("ok") else "FAILED: " + str(e.get("error"))[:160].replace("|", "/")
            if "rollouts_per_s" not in e:
                lines.append(f"| {name} | {stack} | {status} |" + " |" * 11)
                continue
            rps = e["rollouts_per_s"]
            dq = e.get("dequeue") or {}
            ceiling = _ceiling_for(results, scn) if e.get("ok") else None
            both_ok = e.get("ok") and peer.get("ok")
            vs_peer = _ratio(rps, peer.get("rollouts_per_s")) if stack != "agentlightning" and both_ok else "–"
            pss = ((e.get("resources") or {}).get("pss_at_end_mb") or {}).get("total")
            lines.append(
                f"| {name} (n={scn['total_tasks']}) | {stack} | {status} | {_f(rps, 2)} | {_f(e['spans_per_s'], 0)} "
                f"| {_f(_s(e['latency_p50_ms']), 2)} / {_f(_s(e['latency_p99_ms']), 2)} "
                f"| {_f(dq.get('claim_p50_ms'))} / {_f(dq.get('claim_p99_ms'))} "
                f"| {_f(e.get('peak_rss_mb'), 0)} | {_f(pss, 0)} | {_f(e.get('cpu_s_per_rollout'), 3)} "
                f"| {vs_peer} | {_ratio(rps, ceiling)} | {_bound(e)} "
                f"| {_f(e.get('ratio_to_agent_bound'), 2)} |"
            )
    return "\n".join(lines)


def _bound(e: dict[str, Any]) -> str:
    text = _f(e.get("agent_bound_rollouts_per_s"), 1)
    if e.get("agent_bound_kind") == "cpu":
        return f"{text} (CPU)"
    barrier = e.get("agent_bound_with_barrier_rollouts_per_s")
    return text if barrier is None else f"{text} ({_f(barrier, 1)} w/ barrier)"


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def micro_ceiling(results: dict[str, Any], op: str) -> float | None:
    """The raw ops/s of ``op``'s least round trips (``MICRO_ROUND_TRIPS``) in this run, or ``None``
    (not measured, or no such round trips)."""
    rt = ((results.get("micro") or {}).get("eventlight") or {}).get("round_trips") or {}
    rates = [((rt.get(k) or {}).get("ops_per_s"), n) for k, n in MICRO_ROUND_TRIPS.get(op, {}).items()]
    if not rates or any(not r for r, _ in rates):
        return None
    return 1 / sum(n / r for r, n in rates)  # type: ignore[operator]


def _rate_spread(row: dict[str, Any]) -> str:
    """``ops/s (min–max over blocks)``, or just ops/s for a row of one block or an older result."""
    text = _f(row.get("ops_per_s"))
    sp = row.get("spread")
    if not sp or len(row.get("blocks_ops_per_s") or []) < 2:
        return text
    return f"{text} ({_f(sp['min'], 0)}–{_f(sp['max'], 0)})"


def _vs_own(row: dict[str, Any]) -> str:
    """``ratio (min / median / max over pairs)`` of an operation against its raw twin, or ``–``."""
    vs = row.get("vs_raw_own")
    if not vs:
        return "–"
    sp = (row.get("vs_raw_own_pairs") or {}).get("spread")
    return f"{vs:.2f}×" + ("" if not sp else f" ({sp['min']:.2f} / {sp['median']:.2f} / {sp['max']:.2f})")


def micro_table(results: dict[str, Any]) -> str:
    micro = results.get("micro") or {}
    if not micro:
        return ""
    el, pe = micro.get("eventlight") or {}, micro.get("agentlightning") or {}
    lines = [
        "| operation | eventlight ops/s (blocks min–max) | peer ops/s | ratio | raw own stream ops/s (min–max) "
        "| vs raw own (pairs min / median / max) | raw fresh stream ops/s | vs raw fresh | eventlight p50 ms "
        "| peer p50 ms | eventlight CPU µs/op | peer CPU µs/op |",
        "|" + "---|" * 12,
    ]
    for op in MICRO_OPS:
        a, b = (el.get("ops") or {}).get(op) or {}, (pe.get("ops") or {}).get(op) or {}
        raw = micro_ceiling(results, op)
        el_rate = a.get("ops_per_s")
        own = a.get("raw_own") or {}
        lines.append(
            f"| {op} | {_rate_spread(a)} | {_rate_spread(b)} | {_ratio(el_rate, b.get('ops_per_s'))} "
            f"| {_rate_spread(own) if own else '–'} | {_vs_own(a)} "
            f"| {_f(raw)} | {_ratio(el_rate, raw)} | {_f(a.get('p50_ms'), 2)} | {_f(b.get('p50_ms'), 2)} "
            f"| {_f(a.get('cpu_us_per_op'), 0)} | {_f(b.get('cpu_us_per_op'), 0)} |"
        )
    if el.get("blocks"):
        lines += [
            "",
            f"Each operation ran in {el['blocks']} blocks; `raw own stream`: its raw twin (bench/raw_twins.py) on "
            "eventlight's own stream, consumers and projector, in blocks alternating with the operation's; "
            "`raw fresh stream`: the round trips below, chained (`MICRO_ROUND_TRIPS`).",
        ]
    rt = el.get("round_trips")
    if rt:
        lines += [
            "",
            f"Raw round trips on a fresh stream with no consumers, on eventlight's servers after its micro "
            f"benchmarks, {rt['concurrency']} tasks back to back:",
            "",
        ]
        lines += ["| round trip | ops/s | CPU µs/op |", "|---|---|---|"]
        lines += [
            f"| {k} | {_f(v.get('ops_per_s'))} | {_f(v.get('cpu_us_per_op'), 0)} |"
            for k, v in rt.items()
            if k != "concurrency"
        ]
    for stack, e in micro.items():
        if not e.get("ok"):
            lines.append(f"\n{stack} micro FAILED: {e.get('error')}")
        if stack == "eventlight" and e.get("projector_catchup_s") is not None:
            lines.append(f"\n{stack}: projector caught up {e['projector_catchup_s']} s after the write operations")
    return "\n".join(lines)


def ceiling_table(results: dict[str, Any]) -> str:
    c = results.get("ceiling")
    if not c:
        return ""
    if not c.get("ok"):
        return f"ceiling FAILED: {c.get('error')}"
    lines = [
        "| spans/rollout | publish r/s | consume r/s | COPY r/s | CPU ms/rollout | cores/CPU r/s | ceiling r/s "
        "| ceiling spans/s |",
        "|" + "---|" * 8,
    ]
    for s, p in c["by_spans"].items():
        lines.append(
            f"| {s} | {_f(p['publish']['rollouts_per_s'])} | {_f(p['consume']['rollouts_per_s'])} "
            f"| {_f(p['copy']['rollouts_per_s'])} | {_f(p['cpu_s_per_rollout'] * 1000, 2)} "
            f"| {_f(p['cpu_bound_rollouts_per_s'])} | {_f(p['ceiling_rollouts_per_s'])} "
            f"| {_f(p['ceiling_spans_per_s'], 0)} |"
        )
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    m = results["meta"]
    head = (
        f"eventlight bench — scale {m['scale']}, seed {m['seed']}, vs {m.get('vs') or 'nothing'}, "
        f"{m.get('cpu_count')} cores, load {_load(m.get('load_avg_at_start'))} → {_load(m.get('load_avg_at_end'))}, "
        f"wall {m.get('wall_s')} s, durability {m.get('durability', 'fsync')}, "
        f"eventlight runners per process: {m.get('runners_per_process', '1')}"
    )
    if (m.get("peer") or {}).get("error"):
        head += f"\npeer unavailable: {m['peer']['error']}"
    parts = [head]
    if results.get("scenarios"):
        parts += ["## Scenarios", scenario_table(results)]
    if results.get("micro"):
        parts += ["## Micro benchmarks", micro_table(results)]
    if results.get("ceiling"):
        parts += ["## Ceiling (raw JetStream + Postgres COPY, same servers)", ceiling_table(results)]
    return "\n\n".join(parts) + "\n"


def _load(v: list[float] | None) -> str:
    return "?" if not v else f"{v[0]:.1f}"


def chart(results: dict[str, Any], path: Path) -> Path | None:
    """Draw rollouts/s (with agent bound and ceiling), CPU per rollout, memory and micro ops/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results.get("scenarios", {}))
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    width = 0.38
    colors = {"eventlight": "#2a7ab9", "agentlightning": "#e08a2c"}
    panels = [
        (axes[0][0], "rollouts/s", lambda e: e.get("rollouts_per_s")),
        (axes[0][1], "CPU s per rollout (all processes)", lambda e: e.get("cpu_s_per_rollout")),
        (axes[1][0], "peak RSS sum (MB)", lambda e: e.get("peak_rss_mb")),
    ]
    for ax, title, get in panels:
        for k, stack in enumerate(STACK_ORDER):
            vals = [get(results["scenarios"][n].get(stack) or {}) or 0 for n in names]
            xs = [i + (k - 0.5) * width for i in range(len(names))]
            ax.bar(xs, vals, width, label=stack, color=colors[stack])
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_title(title)
    for k, stack in enumerate(STACK_ORDER):  # hatch the runs that failed (numbers kept, not comparable)
        for i, n in enumerate(names):
            e = results["scenarios"][n].get(stack) or {}
            if e and not e.get("ok"):
                x = i + (k - 0.5) * width
                axes[0][0].bar(x, e.get("rollouts_per_s") or 0, width, fill=False, hatch="xx", edgecolor="black")
                axes[0][0].annotate("failed", (x, e.get("rollouts_per_s") or 0.1), fontsize=7, ha="center")
    for k, stack in enumerate(STACK_ORDER):  # PSS, which counts shared pages once, as a marker
        vals = [((results["scenarios"][n].get(stack) or {}).get("resources") or {}) for n in names]
        pss = [((v.get("pss_at_end_mb") or {}).get("total") or 0) for v in vals]
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        axes[1][0].scatter(xs, pss, marker="_", s=300, color="black", label="PSS at end" if k == 0 else None)
    axes[1][0].legend(fontsize=8)
    ax = axes[0][0]
    for i, n in enumerate(names):
        e = next((v for v in results["scenarios"][n].values() if v.get("scenario")), None)
        if e is None:
            continue
        bound, ceiling = e.get("agent_bound_rollouts_per_s"), _ceiling_for(results, e["scenario"])
        if bound:
            ax.hlines(
                bound, i - 0.45, i + 0.45, colors="green", linestyles="dashed", label="agent bound" if i == 0 else None
            )
        if ceiling:
            ax.hlines(
                ceiling, i - 0.45, i + 0.45, colors="red", linestyles="dotted", label="ceiling" if i == 0 else None
            )
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    axes[0][1].legend(fontsize=8)
    ax = axes[1][1]
    micro = results.get("micro") or {}
    for k, stack in enumerate(STACK_ORDER):
        ops = (micro.get(stack) or {}).get("ops") or {}
        vals = [(ops.get(op) or {}).get("ops_per_s") or 0 for op in MICRO_OPS]
        ax.bar([i + (k - 0.5) * width for i in range(len(MICRO_OPS))], vals, width, label=stack, color=colors[stack])
    ax.set_xticks(range(len(MICRO_OPS)), MICRO_OPS, rotation=20)
    ax.set_title("micro: ops/s")
    ax.legend(fontsize=8)
    m = results["meta"]
    fig.suptitle(f"eventlight vs Agent-lightning 0.3.0 — scale {m['scale']}, {m.get('cpu_count')} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict[str, Any], out_dir: Path) -> str:
    """Write ``results.json``, ``table.md`` and ``chart.png`` under ``out_dir``; return the tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    text = render(results)
    (out_dir / "table.md").write_text(text)
    try:
        chart(results, out_dir / "chart.png")
    except Exception as e:  # a chart must never cost the numbers
        (out_dir / "chart.error.txt").write_text(f"{type(e).__name__}: {e}")
    return text


def print_and_save(text: str, result: dict[str, Any], out: Path | None) -> None:
    """Print a probe's table and, with ``--out``, write its raw result as JSON (growth, soak)."""
    print(text)
    if out:
        write_json(result, out)
