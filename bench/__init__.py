"""eventlight's benchmark suite: eventlight against Agent-lightning 0.3.0 on the same machine.

Modules (see ``bench/README.md``): ``workload`` (scenarios, task plans, checks; standard library
only), ``driver`` (one scenario on one stack, run in that stack's venv), ``stack_eventlight`` /
``stack_agl`` (each imports only its own stack), ``procs`` (RSS and CPU sampling), ``micro`` (store
operations per second), ``ceiling`` (raw JetStream + Postgres COPY probe), ``peer`` (the peer's
venv), ``suite`` (runs everything, one subprocess per stack and scenario) and ``report`` (table,
JSON, chart). Nothing here imports a stack at import time.
"""

import argparse as _argparse
import json as _json
import os as _os
import sys as _sys
from pathlib import Path as _Path
from typing import Any as _Any


def write_json(result: dict[str, _Any], out: _Path | None) -> None:
    """A bench entry point's raw result: to ``out`` (folders made) or, without one, to stdout."""
    text = _json.dumps(result, indent=2)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    else:
        _sys.stdout.write(text + "\n")


def require_positive(parser: _argparse.ArgumentParser, args: _argparse.Namespace, *names: str) -> None:
    """A usage error (exit 2) naming the option when one of ``names`` (argparse dests) is ``<= 0``."""
    for name in names:
        value = getattr(args, name)
        if value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value}")


def positive_ints(text: str) -> list[int]:
    """An argparse type: ``"14,39"`` -> ``[14, 39]``, each > 0."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise _argparse.ArgumentTypeError(f"expected whole numbers > 0, got {text!r}")
    return values


def bench_durability() -> str:
    """The durability level the embedded servers run at: ``EVENTLIGHT_DURABILITY`` (``fsync`` or
    ``interval``; the benchmark's single embedded node cannot be ``replicated``), else ``fsync``."""
    level = _os.environ.get("EVENTLIGHT_DURABILITY") or "fsync"
    if level not in ("fsync", "interval"):
        raise ValueError(f"EVENTLIGHT_DURABILITY={level!r}: the benchmark runs fsync or interval")
    return level
