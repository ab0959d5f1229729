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
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from eventlight.core.errors import EventlightError, ServiceUnavailableError
from eventlight.settings import Settings

EXIT_UNAVAILABLE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

_log = logging.getLogger(__name__)
console = Console()
err = Console(stderr=True, highlight=False, soft_wrap=True)


class CliError(Exception):
    """A failure the CLI reports as one line, with its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def _class_named(cls: type[BaseException], name: str) -> Any:
    """A base class by name (typer >= 0.20 vendors click as ``typer._click``, older ones use click);
    ``Any``: which module defines it depends on the installed typer."""
    return next(c for c in cls.__mro__ if c.__name__ == name)


_ClickException = _class_named(typer.BadParameter, "ClickException")


def _one_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()] or ["(no message)"]
    more = " (EVENTLIGHT_LOG_LEVEL=DEBUG for details)" if len(lines) > 1 else ""
    if more:
        _log.debug("full error: %s", message)
    return lines[0].strip() + more


def _print_error(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(_one_line(message))}")


def _exit_code_of(e: BaseException) -> int:
    """Print ``e`` as one line on stderr and return the exit code for it."""
    if isinstance(e, CliError):
        _print_error(str(e))
        return e.exit_code
    if isinstance(e, EventlightError):
        _print_error(str(e))
        return EXIT_UNAVAILABLE if isinstance(e, ServiceUnavailableError) else EXIT_USAGE
    if isinstance(e, BrokenPipeError):  # `eventlight sql … | head`
        return 1
    _log.debug("unexpected error", exc_info=e)
    _print_error(f"internal error: {type(e).__name__}: {e} (EVENTLIGHT_LOG_LEVEL=DEBUG logs the traceback)")
    return 1


class _OneLineErrors(TyperGroup):
    """Typer's group, printing usage errors and failures as one line on stderr instead of a panel."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            rv = super().main(
                args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra
            )
        except _ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                console.print(e.format_message())
                sys.exit(EXIT_USAGE)
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _print_error(e.format_message() + hint)
            sys.exit(e.exit_code)
        except Exception as e:
            if type(e).__name__ == "Abort":
                _print_error("aborted")
                sys.exit(1)
            sys.exit(_exit_code_of(e))
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="eventlight: train agents from their traces.",
)

NamespaceOpt = Annotated[
    str | None,
    typer.Option("--namespace", "-N", help="Namespace (default: $EVENTLIGHT_NAMESPACE or 'default')."),
]


def _version() -> str:
    try:
        return package_version("eventlight")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def _show_version(value: bool) -> None:
    if value:
        console.print(f"eventlight {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """eventlight: train agents from their traces."""


def _settings(namespace: str | None) -> Settings:
    return Settings.from_env(namespace=namespace)  # InvalidInputError: exit 2, one line


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------
# up / down


@app.command()
def up(namespace: NamespaceOpt = None) -> None:
    """Start (or find) NATS and Postgres and apply streams and migrations for the namespace.

    The servers keep running after this command (until `eventlight down`)."""
    from eventlight.net import redact
    from eventlight.ops import prepare_services

    t0 = time.monotonic()
    services = _run(prepare_services(_settings(namespace)))
    console.print(f"NATS      {escape(redact(services.nats_url))}")
    console.print(f"Postgres  {escape(redact(services.pg_dsn))}")
    console.print(f"started   {', '.join(services.started) or 'nothing (reused)'} in {time.monotonic() - t0:.2f} s")


@app.command()
def down(namespace: NamespaceOpt = None) -> None:
    """Stop the servers eventlight started (never ones it did not start)."""
    from eventlight.ops import stop_services

    stopped = _run(stop_services(_settings(namespace)))
    console.print("stopped " + (", ".join(stopped) if stopped else "nothing (no embedded server was running)"))


# ---------------------------------------------------------------------------------------------
# finding the servers (never starting them)


def _no_servers(settings: Settings, variable: str) -> CliError:
    return CliError(
        f"no eventlight servers are running (state folder {settings.state_dir}): "
        f"run `eventlight up`, or set {variable}",
        EXIT_UNAVAILABLE,
    )


async def _need_nats(settings: Settings) -> Any:
    from eventlight.ops import find_nats

    found = await find_nats(settings)
    if found is None:
        raise _no_servers(settings, "EVENTLIGHT_NATS_URL")
    return found


async def _need_pg(settings: Settings) -> Any:
    from eventlight.ops import find_pg

    found = await find_pg(settings)
    if found is None:
        raise _no_servers(settings, "EVENTLIGHT_PG_DSN")
    return found


def _no_namespace(settings: Settings, what: str) -> CliError:
    return CliError(
        f"namespace {settings.namespace!r} does not exist ({what}): run `eventlight up -N {settings.namespace}` "
        "or check EVENTLIGHT_NAMESPACE / --namespace",
        EXIT_USAGE,
    )


async def _connect_pg(settings: Settings, found: Any = None) -> Any:
    """A connection to the namespace's schema, on ``found`` or the Postgres ``_need_pg`` finds.

    Raises:
        CliError: No server, or the namespace's schema does not exist.
        ServiceUnavailableError: The server does not answer.
    """
    from eventlight.net import redact
    from eventlight.ops import apply_migrations
    from eventlight.store.jetstream import pg_errors

    found = found or await _need_pg(settings)
    where = f"{found.origin} {redact(found.url)}"
    conn = await pg_errors.connect(found.url, server_settings={"search_path": settings.pg_schema}, name=where)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", settings.pg_schema)
        if not exists:
            raise _no_namespace(settings, f"no schema {settings.pg_schema}")
        await apply_migrations(found.url, settings.pg_schema)  # idempotent: brings an older schema up to date
    except BaseException:
        await conn.close()
        raise
    return conn


# ---------------------------------------------------------------------------------------------
# sql


def _check_query(query: str) -> None:
    """Refuse what cannot be one SQL statement before connecting.

    Raises:
        CliError: Empty, or not valid UTF-8 (an argument the shell passed as raw bytes).
    """
    if not query.strip().strip(";").strip():
        raise CliError('empty query: give one SQL statement, e.g. eventlight sql "SELECT * FROM rollouts LIMIT 5"')
    try:
        query.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = query.encode("utf-8", "surrogateescape")[e.start : e.start + 1]
        raise CliError(f"the query is not valid UTF-8 (byte {bad!r} at position {e.start})") from None


async def _query(
    settings: Settings, query: str, timeout_s: float, params: Sequence[str] = ()
) -> tuple[list[Any], list[Any]]:
    """Run ``query`` as the read-only role ``eventlight_reader`` (``eventlight.sql_reader``), with
    ``params`` bound to ``$1``, ``$2``, … (``eventlight.sql_params``)."""
    from eventlight.cli_output import Column
    from eventlight.sql_params import bind
    from eventlight.sql_reader import connect_reader
    from eventlight.store.jetstream.pg_errors import sql_error_detail

    found = await _need_pg(settings)
    owner = await _connect_pg(settings, found)  # brings the schema (and the reader's grants) up to date
    try:
        conn = await connect_reader(owner, found.url, settings.pg_schema, timeout_s=timeout_s)
    finally:
        await owner.close()
    try:
        async with conn.transaction(readonly=True):
            stmt = await conn.prepare(query)
            values = bind(params, stmt.get_parameters())
            rows = await stmt.fetch(*values, timeout=timeout_s + 5)  # the server's statement_timeout fires first
        cols = [Column(a.name, a.type.name) for a in stmt.get_attributes()]
    except TimeoutError as e:
        raise CliError(f"SQL error: no answer within {timeout_s + 5:g} s") from e
    except Exception as e:
        detail = sql_error_detail(e, timeout_s)
        if detail is None:
            raise
        raise CliError(f"SQL error: {detail}") from e
    finally:
        await conn.close()
    return cols, rows


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="One SQL statement, run against the namespace's read models.")],
    output_format: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="table: for reading (UTC times, folded cells, compact JSON); csv / json (JSON lines): raw values.",
        ),
    ] = "table",
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", min=0.001, help="Cancel the query after this many seconds.")
    ] = 30.0,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-p", help="A value for $1, $2, … in order (repeatable); bound, never pasted in."),
    ] = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Run one SQL statement over the projections and print the result.

    Tables rollouts, attempts, spans, resources, workers; views v_rollouts, v_attempts, v_spans,
    v_rewards, llm_calls, reward_by_resources, rollout_rewards (see
    eventlight/_data/migrations/008_documented_views.sql and the README's example queries). Values
    go in as --param, for $1, $2, …

    The query runs in a read-only transaction, as the role eventlight_reader that may only read
    this namespace's tables, with a statement timeout: the tables are a projection of the stream,
    and a row changed here would silently disagree with it (write through the store API instead).

    Servers: uses $EVENTLIGHT_PG_DSN when set, else the embedded Postgres `eventlight up` started;
    never starts or stops one (without it: exit 1, 'run `eventlight up`')."""
    from eventlight.cli_output import FORMATS, result_table, result_text

    if output_format not in FORMATS:
        raise CliError(f"--format {output_format!r}: expected one of {', '.join(FORMATS)}")
    _check_query(query)
    cols, rows = _run(_query(_settings(namespace), query, timeout_s, param or ()))
    if output_format != "table":
        sys.stdout.write(result_text(cols, rows, output_format))
        return
    if cols:
        console.print(result_table(cols, rows, console.width))
    console.print(f"{len(rows)} row(s)")


# ---------------------------------------------------------------------------------------------
# status


def _describe(name: str, found: Any) -> str:
    from eventlight.net import redact

    if found.origin == "embedded":
        where = f"embedded, {name} pid {found.pid}" + (f" ({found.kind})" if found.kind != "embedded" else "")
        return f"{escape(redact(found.url))}  [dim]{escape(where)}[/dim]"
    return f"{escape(redact(found.url))}  [dim]external, from {found.origin}[/dim]"


async def _stream_state(url: str, settings: Settings) -> tuple[int, int] | None:
    """(messages, last sequence) of the namespace's stream, ``None`` when it does not exist."""
    from eventlight.net import redact
    from eventlight.store.jetstream.connect import connect_nats
    from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors

    nc = await connect_nats(url, name="eventlight-cli")
    try:
        with nats_errors(redact(url), "stream info"):
            try:
                info = await nc.jetstream().stream_info(settings.stream_name)
            except JsNotFoundError:
                return None
        return int(info.state.messages), int(info.state.last_seq)
    finally:
        await nc.close()


async def _status(settings: Settings) -> dict[str, Any]:
    nats = await _need_nats(settings)
    pg = await _need_pg(settings)
    stream = await _stream_state(nats.url, settings)
    conn = await _connect_pg(settings, pg)
    try:
        projected = await conn.fetchval("SELECT last_seq FROM projector_checkpoint")
        by_status = await conn.fetch("SELECT status, count(*) FROM rollouts GROUP BY status ORDER BY status")
        workers = await conn.fetch(
            "SELECT worker_id, status, last_heartbeat_time, current_rollout_id FROM workers ORDER BY worker_id"
        )
        spans = await conn.fetchval("SELECT count(*) FROM spans")
    finally:
        await conn.close()
    return {
        "nats": nats,
        "pg": pg,
        "stream": stream,
        "projected": projected,
        "by_status": by_status,
        "workers": workers,
        "spans": spans,
    }


def _projection_line(stream: tuple[int, int] | None, projected: int | None) -> str:
    if stream is None or projected is None or projected >= stream[1]:
        return "up to date"
    return (
        f"at event {projected} of {stream[1]} ({stream[1] - projected} behind: the tables below advance only "
        "while a trainer or another store opened with pg_dsn projects)"
    )


def _workers_table(workers: list[Any], now: float) -> Table:
    from eventlight.cli_output import age

    table = Table("worker", "status", "last heartbeat", "rollout", box=None, pad_edge=False, header_style="dim")
    for w in workers:
        beat = age(now - w["last_heartbeat_time"]) if w["last_heartbeat_time"] is not None else "never"
        table.add_row(escape(w["worker_id"]), w["status"], beat, escape(w["current_rollout_id"] or ""))
    return table


@app.command()
def status(namespace: NamespaceOpt = None) -> None:
    """Show the services, rollouts by status, spans and workers.

    Services: where each server is and whether it is embedded or external; workers: status, last
    heartbeat and current rollout.

    Servers: uses $EVENTLIGHT_NATS_URL / $EVENTLIGHT_PG_DSN when set, else the embedded servers
    `eventlight up` started; never starts or stops any (without them: exit 1, 'run `eventlight up`')."""
    settings = _settings(namespace)
    s = _run(_status(settings))
    stream = f"{s['stream'][0]} events" if s["stream"] is not None else "missing"
    console.print(f"NATS       {_describe('nats-server', s['nats'])}")
    console.print(f"Postgres   {_describe('postgres', s['pg'])}")
    if "embedded" in (s["nats"].origin, s["pg"].origin):
        console.print(f"state      {escape(str(settings.state_dir))}")
    console.print(
        f"namespace  {settings.namespace}  [dim]stream {settings.stream_name} ({stream}), "
        f"schema {settings.pg_schema}[/dim]"
    )
    console.print(f"projection {_projection_line(s['stream'], s['projected'])}")
    console.print("rollouts   " + (", ".join(f"{st}={n}" for st, n in s["by_status"]) or "none"))
    console.print(f"spans      {s['spans']}")
    console.print(f"workers    {len(s['workers']) or 'none'}")
    if s["workers"]:
        console.print(_workers_table(s["workers"], time.time()))


# ---------------------------------------------------------------------------------------------
# runner

AGENT_EXPECTED = (
    "expected module:attribute naming a LitAgent instance or a function decorated with "
    "@eventlight.rollout (or @llm_rollout / @prompt_rollout), e.g. examples.room_booking.agent:room_booker"
)


def _import_module(spec: str, module_name: str) -> Any:
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file() or path.suffix != ".py":
            raise CliError(f"agent {spec!r}: no Python file {module_name}; {AGENT_EXPECTED}")
        sys.path.insert(0, str(path.resolve().parent))  # spawned runner processes inherit sys.path
        module_name = path.stem
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            msg = f"agent {spec!r}: no module named {e.name!r} (searched the current folder and sys.path)"
            raise CliError(msg) from None
        raise CliError(f"agent {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # the user's module raised while importing
        raise CliError(f"agent {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None


def _what(obj: Any) -> str:
    import inspect

    if inspect.ismodule(obj):
        return "a module"
    if inspect.isclass(obj):
        return f"the class {obj.__name__}"
    if inspect.isroutine(obj):
        return "a function without @eventlight.rollout"
    return f"a {type(obj).__name__}"


def load_agent(spec: str) -> Any:
    """Import ``module:attribute`` (or ``path/to/file.py:attribute``) and check it is an agent.

    ``attribute`` may be dotted (``module:holder.agent``). A ``LitAgent`` subclass is instantiated
    without arguments.

    Returns:
        The ``LitAgent``.

    Raises:
        CliError: The spec is malformed, the module or attribute does not exist, importing the
            module failed, or the attribute is not an agent (exit code 2).
    """
    from eventlight.agent import LitAgent

    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"agent {spec!r}: {AGENT_EXPECTED}")
    obj = _import_module(spec, module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"agent {spec!r}: {module_name} has no attribute {attr!r}; {AGENT_EXPECTED}") from None
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        try:
            obj = obj()
        except Exception as e:
            raise CliError(f"agent {spec!r}: {obj.__name__}() failed ({type(e).__name__}: {e})") from None
    if not isinstance(obj, LitAgent):
        raise CliError(f"agent {spec!r} is {_what(obj)}, not an agent: {AGENT_EXPECTED}")
    return obj


async def _runner_nats(settings: Settings) -> str:
    found = await _need_nats(settings)
    if await _stream_state(found.url, settings) is None:
        raise _no_namespace(settings, f"no stream {settings.stream_name}")
    return str(found.url)


@app.command()
def runner(
    agent: Annotated[str, typer.Argument(help="The agent, as module:attribute or path/to/file.py:attribute.")],
    n: Annotated[int, typer.Option("--n-runners", "-n", min=1, help="Runner processes (at least 1).")] = 1,
    namespace: NamespaceOpt = None,
) -> None:
    """Run runner processes that consume the namespace's rollout queue until Ctrl+C or SIGTERM.

    A process that dies is restarted (at most about once a minute when it keeps dying). Ctrl+C or
    SIGTERM gives attempts in flight 10 s to finish, then records the rest failed (their rollouts
    are requeued or failed by their RolloutConfig); a second Ctrl+C does so at once.

    Servers: uses $EVENTLIGHT_NATS_URL when set, else the embedded NATS `eventlight up` started;
    never starts or stops one (without it: exit 1, 'run `eventlight up`'), so stopping the runners
    leaves the servers to the trainer and other runners."""
    from eventlight.net import redact
    from eventlight.runner_pool import GRACEFUL_STOP_S, RunnerPool

    settings = _settings(namespace)
    the_agent = load_agent(agent)
    nats_url = _run(_runner_nats(settings))
    pool = RunnerPool(the_agent, n, settings, nats_url, log_level=settings.log_level)
    signal.signal(signal.SIGTERM, _raise_terminated)
    pool.start()
    console.print(f"{n} runner(s) consuming {settings.stream_name} on {escape(redact(nats_url))}; Ctrl+C to stop")
    try:
        while pool.supervising():
            time.sleep(0.5)
    except (KeyboardInterrupt, _Terminated) as e:
        console.print(
            f"stopping runners: attempts in flight get {GRACEFUL_STOP_S:.0f} s to finish, then are recorded "
            "failed (Ctrl+C again: at once)…"
        )
        try:
            pool.stop()
        except (KeyboardInterrupt, _Terminated):
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            pool.stop(graceful_s=0)
        raise typer.Exit(EXIT_INTERRUPTED if isinstance(e, KeyboardInterrupt) else EXIT_TERMINATED) from None
    codes = pool.stop()
    raise CliError(f"runner processes exited (exit codes {codes}); their log is above", EXIT_UNAVAILABLE)


class _Terminated(Exception):
    """SIGTERM arrived (raised by ``_raise_terminated`` in the main thread)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def _register_bench() -> None:
    from eventlight.bench_cli import bench

    app.command(
        help="Throughput benchmark, side by side with Agent-lightning 0.3.0: `python -m bench` of the source "
        "checkout (see bench/README.md); `eventlight bench --help` lists its options.",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
    )(bench)


_register_bench()


def _register_replay() -> None:
    from eventlight.logreplay.cli import register

    register(app, sys.modules[__name__])  # replay, export, import


_register_replay()


def main() -> None:
    """Console entry point."""
    level = os.environ.get("EVENTLIGHT_LOG_LEVEL", "INFO").upper()
    if level not in logging.getLevelNamesMapping():
        err.print(f"[yellow]warning:[/yellow] EVENTLIGHT_LOG_LEVEL={escape(level)!r} is not a log level; using INFO")
        level = "INFO"
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
