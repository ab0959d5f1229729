"""``eventlight replay``, ``eventlight export`` and ``eventlight import`` (registered by ``eventlight.cli.app``).

Errors follow ``eventlight.cli``: one line on stderr, exit 1 when a server is missing or does not
answer, 2 for a wrong argument (an unknown adapter, a bad range, a file name without a known suffix).
"""

from __future__ import annotations

import contextlib
import math
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from eventlight.cli.common import EXIT_INTERRUPTED, CliError, NamespaceOpt, _run, _settings, console, err
from eventlight.cli.discovery import _connect_pg, _need_nats, _need_pg, _no_namespace
from eventlight.cli.help import ReadableCommand
from eventlight.cli.status import _stream_state
from eventlight.logreplay.parallel import MAX_WORKERS
from eventlight.settings import Settings


async def _nats_settings(settings: Settings) -> Settings:
    """``settings`` with the NATS URL found (``$EVENTLIGHT_NATS_URL`` or the embedded server), after
    checking the namespace's stream exists."""
    import msgspec

    found = await _need_nats(settings)
    if await _stream_state(found.url, settings) is None:
        raise _no_namespace(settings, f"no stream {settings.stream_name}")
    return msgspec.structs.replace(settings, nats_url=str(found.url))


SKIPPED_SHOWN = 10
"""Skipped attempts printed one a line; the rest are counted."""


def _writable(out: Path) -> Path:
    """``out`` if its folder exists, takes a new file, and ``out`` is not a folder nor a file that
    may not be written (checked before any server is asked).

    The output is written to a temporary file in that folder and renamed over ``out`` once whole
    (``eventlight.logreplay.files``), so one is made and removed here: a folder that takes no new
    file (read-only, ``/proc``) is refused now, not after the replay.

    Raises:
        CliError: The folder is missing, ``out`` is a folder, or either cannot be written.
    """
    from eventlight.logreplay.files import temporary_beside

    if out.is_dir():
        raise CliError(f"--out {out} is a folder: give a file name")
    if not out.absolute().parent.is_dir():
        raise CliError(f"--out {out}: no folder {out.absolute().parent}")
    try:
        if out.exists():
            with out.open("ab"):  # a file made read-only is not replaced
                pass
        temporary_beside(out).unlink()
    except OSError as e:
        raise CliError(f"--out {out}: cannot write it ({e.strerror or e})") from e
    return out


def _progress() -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        TextColumn("{task.fields[events]:>10,} events read"),
        TextColumn("{task.fields[records]:>10,} records written"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )


async def _replay_to_file(settings: Settings, out: Path, opts: dict[str, Any]) -> Any:
    from eventlight.logreplay.files import replacing
    from eventlight.logreplay.replay import replay
    from eventlight.logreplay.writer import writer_for

    run = replay(settings, **opts)  # an unknown adapter or a bad range fails before connecting,
    make_writer = writer_for(out)  # and so does a file name without a known suffix
    settings = await _nats_settings(settings)
    run.source = settings
    run.log_first_skip = False  # printed below with the others, once
    run.log_range_outside = False  # printed below as a warning
    run.log_unmatched = False  # and so is this
    run.log_left_out = False  # and this
    # a partial dataset would pass for a whole one: written beside `out`, renamed over it when whole
    with replacing(out) as part, _progress() as bar:
        writer = make_writer(part)
        task = bar.add_task("replay", events=0, records=0)
        run.on_progress = lambda s: bar.update(task, events=s.events, records=s.records)
        try:
            attempt: list[dict[str, Any]] = []  # one attempt's records, written all or none
            async for record in run:
                if attempt and (record["rollout_id"], record["attempt_id"]) != (
                    attempt[0]["rollout_id"],
                    attempt[0]["attempt_id"],
                ):
                    _write_attempt(writer, attempt, run)
                    attempt = []
                attempt.append(record)
            if attempt:
                _write_attempt(writer, attempt, run)
            if run.errors and not run.stats.attempts:
                raise _EveryAttemptFailed(run)
            writer.close()  # the Parquet writer's last row group, and its footer
        except BaseException:
            with contextlib.suppress(Exception):  # the file goes; the first error is the one to tell
                writer.close()
            raise
        bar.update(task, events=run.stats.events, records=run.stats.records)
    return run


class _EveryAttemptFailed(Exception):
    """Every selected attempt failed in the adapter or reward function: a failure, not an empty file."""

    def __init__(self, run: Any):
        super().__init__(f"every one of the {len(run.errors)} selected attempt(s) failed")
        self.run = run


def _print_skipped(run: Any) -> None:
    for e in run.errors[:SKIPPED_SHOWN]:
        err.print(f"[yellow]skipped:[/yellow] rollout {e.rollout_id} attempt {e.attempt_id}: {escape(e.error)}")
    if len(run.errors) > SKIPPED_SHOWN:
        err.print(f"[yellow]skipped:[/yellow] … and {len(run.errors) - SKIPPED_SHOWN} more attempt(s)")


def _write_attempt(writer: Any, records: list[dict[str, Any]], run: Any) -> None:
    """Write an attempt's records; ones that cannot be written skip the attempt, reported as the
    adapter's errors are (``run.errors``), and leave the counts as what was written."""
    from eventlight.logreplay.replay import ReplayError
    from eventlight.logreplay.writer import UnwritableError

    try:
        writer.write_attempt(records)
    except UnwritableError as e:
        first = records[0]
        run.errors.append(ReplayError(first["rollout_id"], first["attempt_id"], f"its records cannot be written: {e}"))
        run.stats.records -= len(records)
        run.stats.attempts -= 1


class StatusChoice(StrEnum):
    """The values of ``--status``: ``eventlight.core.types.AttemptStatus`` (a test pins them)."""

    preparing = "preparing"
    running = "running"
    failed = "failed"
    succeeded = "succeeded"
    unresponsive = "unresponsive"
    timeout = "timeout"


class ModeChoice(StrEnum):
    """The values of ``--mode``: ``eventlight.core.types.RolloutMode`` (a test pins them)."""

    train = "train"
    val = "val"
    test = "test"


def replay_command(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="FILE.jsonl or FILE.parquet.")] = None,
    adapter: Annotated[
        str | None,
        typer.Option("--adapter", "-a", help="triplets (default) | messages | proxy-triplets | MODULE:CALLABLE."),
    ] = None,
    llm_call_match: Annotated[
        str | None,
        typer.Option(
            "--llm-call-match",
            help="With --adapter triplets: the regex on span names that marks LLM calls (default "
            r"'openai\.chat\.completion'; '^chat ' for OpenTelemetry GenAI spans such as 'chat gpt-4o').",
        ),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Attempts that started at/after: a log position or ISO time.")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Attempts that started at/before: a log position or ISO time.")
    ] = None,
    status: Annotated[
        list[StatusChoice] | None,
        typer.Option(
            "--status",
            metavar="<status>",
            help=f"Attempt status to keep: {', '.join(StatusChoice)} (repeatable).",
        ),
    ] = None,
    resources_id: Annotated[
        list[str] | None, typer.Option("--resources-id", help="The rollout's resources id to keep (repeatable).")
    ] = None,
    mode: Annotated[list[ModeChoice] | None, typer.Option("--mode", help="Rollout mode to keep (repeatable).")] = None,
    min_reward: Annotated[
        float | None, typer.Option("--min-reward", help="Keep attempts with a final reward >= X.")
    ] = None,
    reward: Annotated[
        str | None, typer.Option("--reward", help="MODULE:CALLABLE of an attempt's spans: relabel its reward.")
    ] = None,
    rebuild: Annotated[
        bool,
        typer.Option("--rebuild", help="Project the whole log into a fresh schema and compare it with the live one."),
    ] = False,
    swap: Annotated[
        bool, typer.Option("--swap", help="With --rebuild: put the rebuilt schema in place of the live one.")
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            "-j",
            min=1,
            max=MAX_WORKERS,
            help="Processes running the adapter (default: the CPUs, at most 8). Use 1 for an adapter that keeps "
            "state from one attempt to the next: each worker has its own.",
        ),
    ] = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Replay stored traces from the log into a dataset, or (--rebuild) the read models.

    Reads the namespace's event log itself (never the read models), up to its head when the replay
    starts, and writes one record per triplet or conversation of each selected attempt, with its
    rollout and attempt ids, resources version, reward and log positions. Same log, same bytes out.

    Servers: uses $EVENTLIGHT_NATS_URL (and for --rebuild $EVENTLIGHT_PG_DSN) when set, else the
    embedded servers `eventlight up` started; never starts or stops one."""
    settings = _settings(namespace)
    if rebuild and out is not None:
        raise CliError(
            "--rebuild writes a schema, not a file: drop --out to rebuild, or drop --rebuild to write records"
        )
    if rebuild:
        given = {
            "--adapter": adapter,
            "--llm-call-match": llm_call_match,
            "--since": since,
            "--until": until,
            "--status": status,
            "--resources-id": resources_id,
            "--mode": mode,
            "--min-reward": min_reward,
            "--reward": reward,
            "--workers": workers,
        }
        ignored = [name for name, value in given.items() if value is not None and value != []]  # 0 and "" too
        if ignored:
            raise CliError(f"--rebuild projects the whole log with the projector: {', '.join(ignored)} would not apply")
        from eventlight.logreplay.rebuild import rebuild_command

        rebuild_command(settings, swap)
        return
    if swap:
        raise CliError("--swap goes with --rebuild")
    if out is None:
        raise CliError("--out FILE.jsonl|FILE.parquet is required (or --rebuild)")
    if min_reward is not None and not math.isfinite(min_reward):
        raise CliError(f"--min-reward must be a finite number, not {min_reward}")
    from eventlight.logreplay.parallel import default_workers

    opts: dict[str, Any] = {
        "adapter": adapter or "triplets",
        "llm_call_match": llm_call_match,
        "since": since,
        "until": until,
        "statuses": [s.value for s in status] if status else None,
        "modes": [m.value for m in mode] if mode else None,
        "resources_ids": resources_id or None,
        "min_reward": min_reward,
        "reward": reward,
        "workers": default_workers() if workers is None else workers,
    }
    from eventlight.logreplay.replay import ReplayWorkerError, left_out_warning, range_outside_log, unmatched_warning

    try:
        run = _run(_replay_to_file(settings, _writable(out), opts))
    except ReplayWorkerError as died:
        raise CliError(f"{died} (nothing was written to {out})", exit_code=1) from died
    except KeyboardInterrupt:
        raise CliError(f"interrupted: nothing was written to {out}", exit_code=EXIT_INTERRUPTED) from None
    except _EveryAttemptFailed as failed:
        _print_skipped(failed.run)
        raise CliError(
            f"{failed} in the adapter or reward function (first: {failed.run.errors[0].error}); "
            f"nothing was written to {out}",
            exit_code=1,
        ) from None
    _print_skipped(run)
    s = run.stats
    for outside in range_outside_log(run.filters, s):
        err.print(f"[yellow]warning:[/yellow] {escape(outside)}")
    if (unmatched := unmatched_warning(run)) is not None:
        err.print(f"[yellow]warning:[/yellow] {escape(unmatched)}")
    if (left_out := left_out_warning(run)) is not None:
        err.print(f"[yellow]warning:[/yellow] {escape(left_out)}")
    console.print(
        f"{s.records} record(s) from {s.attempts} attempt(s) → {escape(str(out))}  "
        f"[dim]({s.events} events and {s.spans} spans read up to log position {s.head_seq}"
        f"{f'; {len(run.errors)} attempt(s) skipped' if run.errors else ''})[/dim]"
    )


def export_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="The file to write: FILE.jsonl (JSON lines).")],
    since: Annotated[int, typer.Option(min=0, help="Export entries after this log position.")] = 0,
    until: Annotated[
        int | None, typer.Option(min=0, help="Export entries up to this log position (default: the head).")
    ] = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Write a slice of the namespace's event log to a file, as stored (payloads untouched).

    The file ends with the count of its entries, which `eventlight import` checks; it is written
    beside --out and renamed over it once whole, so a failed or interrupted export leaves --out as it was.
    Entries that are not eventlight events (dead-lettered messages) are written too, and counted
    in a warning: import such a file with `eventlight import --skip-non-events`.

    Servers: uses $EVENTLIGHT_NATS_URL when set, else the embedded NATS; never starts one."""
    from eventlight.logreplay.transfer import export_log

    if until is not None and until < since:
        raise CliError(f"bad range: --until {until} is before --since {since}")
    if out.suffix.lower() != ".jsonl":
        raise CliError(f"--out {out}: an export is JSON lines: give a .jsonl file name")
    _writable(out)
    settings = _run(_nats_settings(_settings(namespace)))
    try:
        report = _run(export_log(settings, out, since, until))
    except KeyboardInterrupt:
        raise CliError(f"interrupted: nothing was written to {out}", exit_code=EXIT_INTERRUPTED) from None
    console.print(f"{report.entries} entries (log positions {report.first}..{report.last}) → {escape(str(out))}")
    if report.non_events:
        err.print(
            f"[yellow]warning:[/yellow] {len(report.non_events)} of them are not eventlight events "
            f"(log positions {_positions(report.non_events)}), such as messages the projector dead-lettered: "
            "`eventlight import` refuses the file for them; `eventlight import --skip-non-events` leaves them out"
        )


def import_command(
    file: Annotated[Path, typer.Argument(help="A file `eventlight export` wrote.")],
    skip_non_events: Annotated[
        bool,
        typer.Option(
            "--skip-non-events",
            help="Leave out (and count) entries that are not eventlight events, such as messages the source's "
            "projector dead-lettered, instead of refusing the file.",
        ),
    ] = False,
    namespace: NamespaceOpt = None,
) -> None:
    """Append an exported slice to this namespace's log; what it already holds is not appended again.

    A rollout whose beginning neither the namespace nor the file holds is refused (nothing is appended),
    as is a slice that leaves a gap after what the namespace holds of a rollout (an export with
    --since records each rollout's entry before the slice).

    The namespace must exist (`eventlight up -N NAMESPACE`). Before it returns, the import projects
    the namespace's log into its read models up to the head (progress on stderr when it is a
    terminal; stdout carries only the summary), so `eventlight sql` sees what it appended.

    Servers: uses $EVENTLIGHT_NATS_URL and $EVENTLIGHT_PG_DSN when set, else the embedded servers;
    never starts one."""
    from eventlight.logreplay.transfer import import_log

    if file.is_dir():
        raise CliError(f"{file} is a folder: give the file `eventlight export --out` wrote")
    if not file.is_file():
        raise CliError(f"no file {file}")
    settings = _run(_nats_settings(_settings(namespace)))
    report = _run(import_log(settings, file, skip_non_events=skip_non_events))
    console.print(f"{report.appended} entries appended, {report.present} already present in {settings.stream_name}")
    if report.skipped:
        err.print(
            f"[yellow]skipped:[/yellow] {len(report.skipped)} entries that are not eventlight events "
            f"(log positions {_positions(report.skipped)})"
        )
    _run(_project(settings))


async def _project(settings: Settings) -> None:
    """Project the namespace up to its log's head (``cli.projection``), with a progress bar on a
    terminal; a warning, not an error, when the read models cannot be brought up to date (the import is done:
    they catch up when a store with Postgres next opens the namespace)."""
    from eventlight.cli.projection import project_to_head
    from eventlight.core.errors import EventlightError

    try:
        found = await _need_pg(settings)
        await (await _connect_pg(settings, found)).close()  # the schema exists, migrated to this version
    except (EventlightError, CliError) as e:
        err.print(f"[yellow]warning:[/yellow] the read models were not brought up to date: {escape(str(e))}")
        return
    head = await project_to_head(settings, found.url)
    if head is not None:
        console.print(f"read models projected up to log position {head}: `eventlight sql` sees the import")


def _positions(seqs: list[int]) -> str:
    """The first ``SKIPPED_SHOWN`` log positions, and how many more."""
    shown = ", ".join(str(seq) for seq in seqs[:SKIPPED_SHOWN])
    return shown + (f", … ({len(seqs) - SKIPPED_SHOWN} more)" if len(seqs) > SKIPPED_SHOWN else "")


def register(app: typer.Typer) -> None:
    """Add the commands to the ``eventlight`` app."""
    app.command("replay", cls=ReadableCommand)(replay_command)
    app.command("export", cls=ReadableCommand)(export_command)
    app.command("import", cls=ReadableCommand)(import_command)
