"""``eventlight sql``: one read-only statement against the namespace's projections."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import typer

from eventlight.cli.common import CliError, NamespaceOpt, _run, _settings, console
from eventlight.cli.discovery import _connect_pg, _need_pg
from eventlight.settings import Settings

# ---------------------------------------------------------------------------------------------
# sql


def _check_query(query: str, params: Sequence[str] = ()) -> None:
    """Refuse what cannot be one SQL statement, or a ``--param`` that cannot be text, before connecting.

    Raises:
        CliError: Empty, or the query or a parameter not valid UTF-8 (an argument the shell passed
            as raw bytes).
    """
    if not query.strip().strip(";").strip():
        raise CliError('empty query: give one SQL statement, e.g. eventlight sql "SELECT * FROM rollouts LIMIT 5"')
    _utf8(query, "the query")
    for k, value in enumerate(params, 1):
        _utf8(value, f"--param ${k}")


def _utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text.encode("utf-8", "surrogateescape")[e.start : e.start + 1]
        raise CliError(f"{what} is not valid UTF-8 (byte {bad!r} at position {e.start})") from None


_PLACEHOLDER = re.compile(r"\$[0-9]")


def _shell_hint(query: str, params: Sequence[str], *, counted: bool = False) -> str:
    """A hint for a query given ``--param`` values but holding no ``$1``, ``$2``, …: in double
    quotes, a shell replaces ``$1`` with its own (empty) argument before eventlight sees the query.
    ``counted``: the message already says how many placeholders and values there are."""
    if not params or _PLACEHOLDER.search(query):
        return ""
    what = "" if counted else f"the query has no $1 placeholder but {len(params)} --param given: "
    return f" ({what}did the shell expand $1? quote the query with single quotes)"


OutputFormat = Literal["table", "csv", "json"]
"""The values of ``--format`` (``eventlight.cli_output`` prints each); typer offers them as choices."""

STREAM_ROWS = 1000
"""Rows a fetch brings, and a write prints, when ``--format csv|json`` streams a result."""


async def _query(
    settings: Settings,
    query: str,
    timeout_s: float,
    params: Sequence[str] = (),
    sink: Callable[[list[Any], Sequence[Any]], None] | None = None,
    catch_up: bool = False,
) -> tuple[list[Any], list[Any]]:
    """Run ``query`` as the namespace's read-only role ``<schema>_reader`` (``eventlight.sql_reader``),
    with ``params`` bound to ``$1``, ``$2``, … (``eventlight.sql_params``).

    First, with ``catch_up``, the read models are projected up to the log's head
    (``cli.projection.project_to_head``); without it, a warning says when they are behind it
    (``warn_if_behind``). Neither keeps the query from running.

    With ``sink``, a statement that returns rows is read through a cursor, ``STREAM_ROWS`` at a
    time, each batch handed to ``sink(columns, rows)`` (then once more with none at the end), and
    the rows returned are ``[]``: a result larger than memory streams. The timeout then bounds each
    fetch (Postgres' ``statement_timeout`` counts per execute)."""
    import asyncpg

    from eventlight.cli.projection import project_to_head, warn_if_behind
    from eventlight.cli_output import Column
    from eventlight.core.errors import InvalidInputError
    from eventlight.sql_params import bind_on
    from eventlight.sql_reader import connect_reader
    from eventlight.store.jetstream.pg_errors import sql_error_detail

    found = await _need_pg(settings)
    owner = await _connect_pg(settings, found)  # brings the schema up to date
    try:
        if catch_up:
            await project_to_head(settings, found.url)
        else:
            await warn_if_behind(settings, owner)
        conn = await connect_reader(
            owner, found.url, settings.pg_schema, timeout_s=timeout_s, open_wait_s=settings.pg_open_wait_s
        )
    finally:
        await owner.close()
    try:
        async with conn.transaction(readonly=True):
            stmt = await conn.prepare(query)
            try:
                values = await bind_on(conn, params, stmt.get_parameters())
            except InvalidInputError as e:
                raise CliError(f"{e}{_shell_hint(query, params, counted=True)}") from e
            cols = [Column(a.name, a.type.name) for a in stmt.get_attributes()]
            if sink is not None and cols:
                batch: list[Any] = []
                async for row in stmt.cursor(*values, prefetch=STREAM_ROWS, timeout=timeout_s + 5):
                    batch.append(row)
                    if len(batch) == STREAM_ROWS:
                        sink(cols, batch)
                        batch = []
                sink(cols, batch)
                return cols, []
            rows = await stmt.fetch(*values, timeout=timeout_s + 5)  # the server's statement_timeout fires first
        if stmt.get_statusmsg().startswith("COPY"):  # TO STDOUT: its rows go to a stream we do not read
            raise CliError(
                "COPY ... TO STDOUT is not run here (it would print nothing): SELECT what you want,"
                " with --format csv or json"
            )
    except TimeoutError as e:
        raise CliError(f"SQL error: no answer within {timeout_s + 5:g} s") from e
    except Exception as e:
        detail = sql_error_detail(e, timeout_s)
        if detail is None:
            raise
        hint = _shell_hint(query, params) if isinstance(e, asyncpg.PostgresSyntaxError) else ""
        raise CliError(f"SQL error: {detail}{hint}") from e
    finally:
        await conn.close()
    if sink is not None:  # a result without columns (SELECT FROM t): its rows, read whole
        sink(cols, rows)
        return cols, []
    return cols, rows


def sql(
    query: Annotated[str, typer.Argument(help="One SQL statement, run against the namespace's read models.")],
    output_format: Annotated[
        OutputFormat,
        typer.Option(
            "--format",
            "-f",
            help="table: for reading (UTC times, folded cells, compact JSON); csv / json (JSON lines): raw values"
            " (in json a repeated column name gets _2, _3, ...; NaN and infinities are strings, as in Postgres' JSON).",
        ),
    ] = "table",
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout-s", min=0.001, max=86400.0, help="Cancel the query after this many seconds (at most a day)."
        ),
    ] = 30.0,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-p", help="A value for $1, $2, … in order (repeatable); bound, never pasted in."),
    ] = None,
    catch_up: Annotated[
        bool,
        typer.Option(
            "--catch-up",
            help="First project the log into the read models up to its head (needs NATS; progress on stderr"
            " when it is a terminal),"
            " so that the result is not behind the log.",
        ),
    ] = False,
    namespace: NamespaceOpt = None,
) -> None:
    """Run one SQL statement over the projections and print the result.

    Tables rollouts, attempts, spans, resources, workers; views v_rollouts, v_attempts, v_spans,
    v_rewards, llm_calls, reward_by_resources, rollout_rewards (see
    eventlight/_data/migrations/008_documented_views.sql and the README's example queries). Values
    go in as --param, for $1, $2, …

    The query runs in a read-only transaction, as the namespace's role el_<namespace>_reader that
    may only read this namespace's tables and views, with a statement timeout: the tables are a
    projection of the stream, and a row changed here would silently disagree with it (write
    through the store API instead).

    csv and json stream: rows are printed as they are fetched, 1,000 at a time, so a result
    larger than memory goes through (the timeout then bounds each fetch); table reads it whole.

    The read models advance only while something projects the namespace (a trainer, `eventlight
    serve`, a store opened with Postgres): when they are behind the log and do not reach its head
    within 1 s (a running projector trails it by a few events for milliseconds), a warning on
    stderr says by how many events; --catch-up projects them up to the log's head before the query.

    Servers: uses $EVENTLIGHT_PG_DSN when set, else the embedded Postgres `eventlight up` started;
    never starts or stops one (without it: exit 1, 'run `eventlight up`'). NATS
    ($EVENTLIGHT_NATS_URL, else the embedded one) is asked only for the log's head, and for
    --catch-up; without it the query still runs."""
    from eventlight.cli_output import ResultLines, result_table

    _check_query(query, param or ())
    if output_format != "table":
        lines: list[ResultLines] = []

        def write(cols: list[Any], rows: Sequence[Any]) -> None:
            if not lines:
                lines.append(ResultLines(cols, output_format))
                sys.stdout.write(lines[0].header())
            sys.stdout.writelines(lines[0].rows(rows))
            sys.stdout.flush()

        _run(_query(_settings(namespace), query, timeout_s, param or (), sink=write, catch_up=catch_up))
        return
    cols, rows = _run(_query(_settings(namespace), query, timeout_s, param or (), catch_up=catch_up))
    if cols:
        console.print(result_table(cols, rows, console.width))
    console.print(f"{len(rows)} row(s)")
