"""The ``eventlight`` command line (typer + rich).

Commands: ``up`` / ``down`` (the embedded servers), ``status``, ``sql`` (query the projections),
``runner`` (runner processes for an agent), ``bench``. Every command reads the same settings
(``eventlight.settings``).

Servers: only ``up`` starts them and only ``down`` stops them. ``status``, ``sql`` and ``runner``
use ``EVENTLIGHT_NATS_URL`` / ``EVENTLIGHT_PG_DSN`` when set, else the embedded servers that
``eventlight up`` left running (recorded in ``$EVENTLIGHT_STATE_DIR/services.json``); with neither
they stop with the same one-line hint to run ``eventlight up``.

Errors: every failure is one line on stderr, never a traceback (``EVENTLIGHT_LOG_LEVEL=DEBUG``
logs the traceback of an unexpected one). Exit codes: 0 done, 1 a server is missing or does not
answer (or the runners died), 2 a wrong argument (option, agent spec, namespace, SQL), 130 Ctrl+C,
143 SIGTERM.

Modules: ``app`` (the typer app and ``main``), ``common`` (exit codes, consoles, ``CliError``),
``errors`` (one-line errors), ``discovery`` (finding the servers), and one per command group:
``servers`` (up, down), ``sql``, ``status``, ``runner``, ``replay`` (replay, export, import);
``projection`` (the read models against the log: ``sql``'s lag warning, projecting up to the head).
"""

from eventlight.cli.app import app, main
from eventlight.cli.common import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from eventlight.cli.discovery import _need_nats, _need_pg
from eventlight.cli.runner import load_agent

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "CliError",
    "_need_nats",
    "_need_pg",
    "app",
    "load_agent",
    "main",
]
