"""``eventlight up`` / ``eventlight down``: start and stop the embedded servers."""

from __future__ import annotations

import time

from rich.markup import escape

from eventlight.cli.common import EXIT_INTERRUPTED, CliError, NamespaceOpt, _run, _settings, console

# ---------------------------------------------------------------------------------------------
# up / down


def up(namespace: NamespaceOpt = None) -> None:
    """Start (or find) NATS and Postgres and apply streams and migrations for the namespace.

    The servers keep running after this command (until `eventlight down`)."""
    from eventlight.net import redact
    from eventlight.ops import prepare_services
    from eventlight.settings import DURABILITY

    t0 = time.monotonic()
    settings = _settings(namespace)
    try:
        services = _run(prepare_services(settings))
    except KeyboardInterrupt:  # prepare_services stopped the servers it had started
        raise CliError(
            "interrupted: the servers this `eventlight up` was starting are stopped again; "
            "those it found running still run",
            exit_code=EXIT_INTERRUPTED,
        ) from None
    console.print(f"NATS      {escape(redact(services.nats_url))}")
    console.print(f"durability {settings.durability}: {escape(DURABILITY[settings.durability])}")
    console.print(f"Postgres  {escape(redact(services.pg_dsn))}")
    console.print(f"started   {', '.join(services.started) or 'nothing (reused)'} in {time.monotonic() - t0:.2f} s")


def down(namespace: NamespaceOpt = None) -> None:
    """Stop the servers eventlight started (never ones it did not start); every namespace shares them."""
    from eventlight.ops import stop_services

    if namespace is not None:
        raise CliError(f"down stops the servers every namespace shares: -N {namespace} would not limit it (drop -N)")
    stopped = _run(stop_services(_settings(namespace)))
    console.print("stopped " + (", ".join(stopped) if stopped else "nothing (no embedded server was running)"))
