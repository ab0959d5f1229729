"""The ``eventlight`` command line (typer + rich).

Commands: ``up`` / ``down`` (the embedded servers), ``status``, ``sql`` (query the projections),
``runner`` (runner processes for an agent). Every command reads the same settings
(``eventlight.settings``) and exits non-zero with a one-line error, never a traceback, when a
server cannot be reached or an argument is wrong.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from eventlight.core.errors import EventlightError
from eventlight.settings import Settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="eventlight: train agents from their traces.")
console = Console()
err = Console(stderr=True)

NamespaceOpt = Annotated[
    str | None,
    typer.Option("--namespace", "-N", help="Namespace (default: $EVENTLIGHT_NAMESPACE or 'default')."),
]


def _settings(namespace: str | None) -> Settings:
    try:
        return Settings.from_env(namespace=namespace)
    except EventlightError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None


def _run(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except EventlightError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None


@app.command()
def up(namespace: NamespaceOpt = None) -> None:
    """Start (or find) NATS and Postgres and apply streams and migrations."""
    from eventlight.trainer import prepare_services

    t0 = time.monotonic()
    services = _run(prepare_services(_settings(namespace)))
    console.print(f"NATS      {services.nats_url}")
    console.print(f"Postgres  {_redact(services.pg_dsn)}")
    console.print(f"started   {', '.join(services.started) or 'nothing (reused)'} in {time.monotonic() - t0:.2f} s")


@app.command()
def down(namespace: NamespaceOpt = None) -> None:
    """Stop the servers eventlight started (never ones it did not start)."""
    from eventlight.services import stop_services

    stopped = _run(stop_services(_settings(namespace)))
    console.print("stopped " + (", ".join(stopped) if stopped else "nothing (no embedded server was running)"))


def _redact(dsn: str) -> str:
    from eventlight.store.jetstream.pg import redact

    return redact(dsn)


async def _connect_pg(settings: Settings) -> Any:
    import asyncpg

    from eventlight.core.errors import ServiceUnavailableError
    from eventlight.services import apply_migrations, ensure_services, read_services
    from eventlight.store.jetstream.pg import redact

    started: list[str] = []
    dsn = settings.pg_dsn
    if dsn is None:
        found = read_services(settings)
        if found is None:  # start the embedded servers for this command, and stop them after it
            services = await ensure_services(settings)
            dsn, started = services.pg_dsn, services.started
        else:
            dsn = found.pg_dsn
    await apply_migrations(dsn, settings.pg_schema)  # idempotent: a new namespace gets its (empty) tables
    try:
        conn = await asyncpg.connect(dsn, server_settings={"search_path": settings.pg_schema}, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError) as e:
        raise ServiceUnavailableError(redact(dsn), str(e)) from e
    return _Conn(conn, settings if started else None)


class _Conn:
    """A connection that stops the embedded servers on close when this command started them."""

    def __init__(self, conn: Any, owner: Settings | None):
        self.conn = conn
        self.owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    async def close(self) -> None:
        from eventlight.services import stop_services

        await self.conn.close()
        if self.owner is not None:
            await stop_services(self.owner)


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL run against the namespace's read models.")],
    namespace: NamespaceOpt = None,
) -> None:
    """Run SQL over the projections (tables rollouts, attempts, spans, resources, workers; views
    rollout_rewards, reward_by_resources, llm_calls) and print the result.

    The query runs in a read-only transaction: the tables are a projection of the stream, and a
    row changed here would silently disagree with it (write through the store API instead)."""
    import asyncpg

    async def go() -> tuple[list[str], list[Any]]:
        conn = await _connect_pg(_settings(namespace))
        try:
            async with conn.transaction(readonly=True):
                stmt = await conn.prepare(query)
                rows = await stmt.fetch()
            return [a.name for a in stmt.get_attributes()], rows
        finally:
            await conn.close()

    try:
        cols, rows = _run(go())
    except asyncpg.ReadOnlySQLTransactionError as e:
        err.print(
            f"[red]SQL error:[/red] {escape(str(e))}: `eventlight sql` only reads; the tables are "
            "projected from the stream, so write through the store API"
        )
        raise typer.Exit(2) from None
    except asyncpg.PostgresError as e:
        err.print(f"[red]SQL error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    table = Table(*cols)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)
    console.print(f"{len(rows)} row(s)")


@app.command()
def status(namespace: NamespaceOpt = None) -> None:
    """Show the services, rollouts by status and workers."""
    from eventlight.services import read_services

    settings = _settings(namespace)
    found = read_services(settings)
    console.print(f"services  {'running' if found else 'not running (eventlight up)'}")

    async def go() -> tuple[list[Any], list[Any], int]:
        conn = await _connect_pg(settings)
        try:
            by_status = await conn.fetch("SELECT status, count(*) FROM rollouts GROUP BY status ORDER BY status")
            workers = await conn.fetch("SELECT worker_id, status, current_rollout_id FROM workers ORDER BY worker_id")
            spans = await conn.fetchval("SELECT count(*) FROM spans")
            return list(by_status), list(workers), int(spans)
        finally:
            await conn.close()

    by_status, workers, spans = _run(go())
    console.print("rollouts  " + (", ".join(f"{s}={n}" for s, n in by_status) or "none"))
    console.print(f"spans     {spans}")
    for w in workers:
        console.print(f"worker    {w[0]}: {w[1]}" + (f" ({w[2]})" if w[2] else ""))


def load_agent(spec: str) -> Any:
    """Import ``module:attribute`` (or ``path/to/file.py:attribute``).

    Raises:
        typer.BadParameter: The module or attribute does not exist.
    """
    if ":" not in spec:
        raise typer.BadParameter(f"{spec!r}: expected module:attribute, e.g. examples.room_booking.agent:room_booker")
    module_name, attr = spec.split(":", 1)
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        sys.path.insert(0, str(path.parent))
        module_name = path.stem
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise typer.BadParameter(f"cannot load {spec!r}: {e}") from e


@app.command()
def runner(
    agent: Annotated[str, typer.Argument(help="The agent, as module:attribute.")],
    n: Annotated[int, typer.Option("--n-runners", "-n", min=1, help="Runner processes.")] = 1,
    namespace: NamespaceOpt = None,
) -> None:
    """Run runner processes that consume the namespace's rollout queue until Ctrl+C."""
    from eventlight.services import read_services
    from eventlight.trainer import RunnerPool

    settings = _settings(namespace)
    the_agent = load_agent(agent)
    nats_url = settings.nats_url or (found.nats_url if (found := read_services(settings)) else None)
    if nats_url is None:
        err.print("[red]error:[/red] no NATS server: run `eventlight up` or set EVENTLIGHT_NATS_URL")
        raise typer.Exit(2)
    pool = RunnerPool(the_agent, n, settings, nats_url, log_level=settings.log_level)
    pool.start()
    console.print(f"{n} runner(s) consuming el.{settings.namespace}; Ctrl+C to stop")
    try:
        while pool.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping runners…")
        pool.stop()
        raise typer.Exit(130) from None
    raise typer.Exit(1)


def _register_bench() -> None:
    from eventlight.bench_cli import bench

    app.command(help="Throughput benchmark, side by side with Agent-lightning 0.3.0 (see bench/README.md).")(bench)


_register_bench()


def main() -> None:
    """Console entry point."""
    import os

    level = os.environ.get("EVENTLIGHT_LOG_LEVEL", "INFO").upper()
    if level not in logging.getLevelNamesMapping():
        err.print(f"[yellow]warning:[/yellow] EVENTLIGHT_LOG_LEVEL={level!r} is not a log level; using INFO")
        level = "INFO"
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
