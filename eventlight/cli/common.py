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


async def _lease(settings: Settings, what: str) -> Any:
    """A lease on the embedded servers for this command (``eventlight.ops.lease_services``), taken
    before it looks for them; ``None``, with a warning, in a state folder this user cannot write."""
    from rich.markup import escape

    from eventlight.core.errors import InvalidInputError
    from eventlight.ops import lease_services

    try:
        return await lease_services(settings, what)
    except InvalidInputError as e:
        err.print(f"warning: {escape(str(e))}: a trainer's run that started the servers may stop them under {what}")
        return None


async def _release(lease: Any) -> None:
    """Give up a lease on the embedded servers (``eventlight.ops.lease_services``), and say what that
    stopped: the servers a trainer's run started, when no one else uses them any more."""
    from rich.markup import escape

    from eventlight.core.errors import EventlightError
    from eventlight.ops import release_services

    try:
        stopped = await release_services(lease)
    except EventlightError as e:
        err.print(f"warning: could not stop the servers a trainer's run started: {escape(str(e))}; `eventlight down`")
        return
    if stopped:
        console.print(f"stopped {', '.join(stopped)}: a trainer's run started them and no one else uses them")
