"""``eventlight`` (the CLI) with the embedded Postgres forced to the ``pgserver`` fallback, as on a
machine without system binaries; run with this folder first on ``PYTHONPATH`` so the stand-in
``pgserver`` is the one imported."""

import eventlight.ops.postgres as postgres
from eventlight.cli import main

postgres._system_pg_usable = lambda: False  # type: ignore[attr-defined]
main()
