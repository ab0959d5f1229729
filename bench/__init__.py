"""eventlight's benchmark suite: eventlight against Agent-lightning 0.3.0 on the same machine.

Modules (see ``bench/README.md``): ``workload`` (scenarios, task plans, checks; standard library
only), ``driver`` (one scenario on one stack, run in that stack's venv), ``stack_eventlight`` /
``stack_agl`` (each imports only its own stack), ``procs`` (RSS and CPU sampling), ``micro`` (store
operations per second), ``ceiling`` (raw JetStream + Postgres COPY probe), ``peer`` (the peer's
venv), ``suite`` (runs everything, one subprocess per stack and scenario) and ``report`` (table,
JSON, chart). Nothing here imports a stack at import time.
"""

import json as _json
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
