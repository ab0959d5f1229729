"""The typer app: the root callback, every command in the order ``--help`` lists them, ``main``."""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Annotated

import typer
from rich.markup import escape

from eventlight.cli.common import console, err
from eventlight.cli.errors import _OneLineErrors
from eventlight.cli.help import ReadableCommand
from eventlight.cli.runner import runner
from eventlight.cli.serve import serve
from eventlight.cli.servers import down, up
from eventlight.cli.sql import sql
from eventlight.cli.status import status
from eventlight.logging import log_level_from_env

app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="eventlight: train agents from their traces.",
)


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


for _command in (up, down, sql, status, runner, serve):
    app.command(cls=ReadableCommand)(_command)


def _register_bench() -> None:
    from eventlight.bench_cli import bench

    app.command(
        cls=ReadableCommand,
        help="Throughput benchmark, side by side with Agent-lightning 0.3.0: `python -m bench` of the source "
        "checkout (see bench/README.md); `eventlight bench --help` lists its options.",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
    )(bench)


_register_bench()


def _register_replay() -> None:
    from eventlight.cli.replay import register

    register(app)  # replay, export, import


_register_replay()


class _LogLines(logging.Formatter):
    """The CLI's log lines: a warning as the commands print their own (``warning: …``), any other
    record with its level and logger (``INFO eventlight.ops.schema: …``)."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self._warning = logging.Formatter("warning: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.WARNING:
            return self._warning.format(record)
        return super().format(record)


def main() -> None:
    """Console entry point."""
    level, warning = log_level_from_env("INFO")
    if warning:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    handler = logging.StreamHandler()
    handler.setFormatter(_LogLines())
    logging.basicConfig(level=level, handlers=[handler])
    app()
