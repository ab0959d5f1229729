"""``python -m bench ...`` (also what ``eventlight bench ...`` runs): measure eventlight against
Agent-lightning 0.3.0 on this machine (see ``bench/README.md``).

``$BENCH_PROG_NAME`` is the command its usage and errors name (``eventlight bench`` sets it to
that); default ``python -m bench``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Literal

import typer

REPO = Path(__file__).resolve().parent.parent


def bench(
    scenarios: Annotated[
        list[str] | None,
        typer.Argument(
            help="Scenarios: batch, single, heavy, batch_nosleep, single_nosleep, heavy_nosleep, half_load, and micro "
            "(store operations per second). Default: all of them."
        ),
    ] = None,
    vs: Annotated[
        Literal["agentlightning"] | None,
        typer.Option("--vs", help="Also run the peer: Agent-lightning 0.3.0, in bench/.peer-venv."),
    ] = None,
    scale: Annotated[float, typer.Option(min=0.001, help="Factor on every scenario's task count.")] = 1.0,
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default: one named by the time, in bench/results).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Workload seed, the same for both stacks.")] = 1,
    micro_seconds: Annotated[float, typer.Option(help="Seconds per micro operation.")] = 3.0,
    timeout_s: Annotated[float, typer.Option(help="Limit of each scenario's measured part.")] = 300.0,
    ceiling: Annotated[bool, typer.Option(help="Run the raw JetStream + COPY ceiling probe.")] = True,
) -> None:
    """Measure eventlight (and Agent-lightning 0.3.0 with --vs agentlightning) on the same workload:
    prints a table and writes results.json, table.md and chart.png."""
    from bench.suite import SuiteConfig, run_suite
    from bench.workload import SCENARIOS

    chosen = scenarios or [*SCENARIOS, "micro"]
    out_dir = out or REPO / "bench" / "results" / time.strftime("%Y%m%d-%H%M%S")
    cfg = SuiteConfig(
        scenarios=chosen,
        vs=vs,
        scale=scale,
        out_dir=out_dir,
        seed=seed,
        micro_seconds=micro_seconds,
        timeout_s=timeout_s,
        ceiling=ceiling,
        log=lambda line: typer.echo(line, err=True),
    )
    try:
        results = run_suite(cfg)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    from bench.report import render

    typer.echo(render(results))
    typer.echo(f"results: {out_dir}/results.json, table.md, chart.png")


PROG_NAME_VAR = "BENCH_PROG_NAME"


def main() -> None:
    """Run :func:`bench` as a command named ``$BENCH_PROG_NAME`` (default ``python -m bench``)."""
    from eventlight.cli.help import ReadableCommand

    app = typer.Typer(add_completion=False)
    app.command(cls=ReadableCommand)(bench)
    app(prog_name=os.environ.get(PROG_NAME_VAR) or "python -m bench")


if __name__ == "__main__":
    main()
