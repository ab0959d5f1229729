"""Every failure as one line on stderr with its exit code: the typer group that runs the commands."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import typer
from rich.markup import escape

from eventlight.cli.common import EXIT_INTERRUPTED, EXIT_UNAVAILABLE, EXIT_USAGE, CliError, console, err
from eventlight.cli.help import ReadableGroup
from eventlight.core.errors import EventlightError, ServiceUnavailableError

_log = logging.getLogger(__name__)


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


class _OneLineErrors(ReadableGroup):
    """Typer's group (with readable help: ``eventlight.cli.help``), printing usage errors and failures as
    one line on stderr instead of a panel, and a command stopped by Ctrl+C as ``interrupted`` (exit 130:
    typer turns the ``KeyboardInterrupt`` into that code, and ``serve`` / ``runner`` exit with it
    once they stopped; a command that says more raises ``CliError`` with it instead)."""

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
        if rv == EXIT_INTERRUPTED:
            err.print("interrupted")
        sys.exit(rv if isinstance(rv, int) else 0)
