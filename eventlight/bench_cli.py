"""``eventlight bench``: run the throughput suite of the source checkout (``python -m bench``).

The suite (``bench/``, with its side-by-side runs against Agent-lightning 0.3.0) is not part of the
installed package: it lives in the source checkout. This command runs ``python -m bench`` there with
the same arguments (and ``BENCH_PROG_NAME=eventlight bench``, so its usage names this command), the
checkout being the one eventlight is installed from (an editable install) or the current folder;
without one it says where the suite lives. Registered in ``eventlight.cli``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer

__all__ = ["bench", "find_checkout"]


def find_checkout() -> Path | None:
    """The source checkout holding ``bench/``: the one eventlight runs from, else the current folder."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "bench" / "__main__.py").is_file() and (root / "eventlight" / "__init__.py").is_file():
            return root
    return None


def bench(ctx: typer.Context) -> None:
    """Throughput benchmark, side by side with Agent-lightning 0.3.0: ``python -m bench`` of the source
    checkout, with these arguments (``eventlight bench --help`` lists them)."""
    root = find_checkout()
    if root is None:
        typer.echo(
            "eventlight bench: the benchmark suite lives in the source checkout (bench/ next to eventlight/, "
            "see bench/README.md), not in the installed package; run it from a checkout: "
            "`python -m bench ...` or `eventlight bench ...` there",
            err=True,
        )
        raise typer.Exit(2)
    env = {**os.environ, "BENCH_PROG_NAME": "eventlight bench"}  # its usage line names this command
    raise typer.Exit(subprocess.call([sys.executable, "-m", "bench", *ctx.args], cwd=root, env=env))
