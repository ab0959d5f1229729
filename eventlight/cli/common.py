"""What every command shares: exit codes, the two consoles, ``CliError``, the namespace option, settings."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Annotated, Any

import typer
from rich.console import Console

from eventlight.settings import Settings

EXIT_UNAVAILABLE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

console = Console(soft_wrap=True)  # lines are not broken at rich's 80 columns when piped; tables fit the width
err = Console(stderr=True, highlight=False, soft_wrap=True)


class CliError(Exception):
    """A failure the CLI reports as one line, with its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


NamespaceOpt = Annotated[
    str | None,
    typer.Option("--namespace", "-N", help="Namespace (default: $EVENTLIGHT_NAMESPACE or 'default')."),
]


def _settings(namespace: str | None) -> Settings:
    return Settings.from_env(namespace=namespace)  # InvalidInputError: exit 2, one line


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)
