"""``eventlight runner``: load an agent by ``module:attribute`` and run runner processes for it."""

from __future__ import annotations

import importlib
import math
import signal
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from eventlight.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_UNAVAILABLE,
    CliError,
    NamespaceOpt,
    _lease,
    _release,
    _run,
    _settings,
    console,
)
from eventlight.cli.discovery import _need_nats, _no_namespace
from eventlight.cli.status import _stream_state
from eventlight.core.types import RolloutConfig
from eventlight.settings import Settings
from eventlight.store.validate import check_rollout_config

# ---------------------------------------------------------------------------------------------
# runner

AGENT_EXPECTED = (
    "expected module:attribute naming a LitAgent instance or a function decorated with "
    "@eventlight.rollout (or @llm_rollout / @prompt_rollout), e.g. examples.room_booking.agent:room_booker"
)


def _import_module(spec: str, module_name: str) -> Any:
    """The module ``module_name`` names: a dotted module, or a Python file by path, which is imported
    under a name that cannot clash (``eventlight.file_modules``: ``x/random.py`` is that file, not
    the standard library's ``random``), with its folder on ``sys.path`` for its own imports (runner
    processes inherit ``sys.path``). The folder goes last, not first as for a script: first, a file
    there named like a module (that ``random.py``) would shadow it in the runner processes, which
    import the standard library after this."""
    from eventlight.file_modules import import_file

    path = None
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file() or path.suffix != ".py":
            raise CliError(f"agent {spec!r}: no Python file {module_name}; {AGENT_EXPECTED}")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return import_file(path) if path is not None else importlib.import_module(module_name)
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


class FrameworkChoice(StrEnum):
    """The values of ``--instrument``: ``eventlight.instrumentation.FRAMEWORKS`` and ``all`` (a test pins them)."""

    openai = "openai"
    openai_agents = "openai_agents"
    langchain = "langchain"
    all = "all"


def runner(
    agent: Annotated[str, typer.Argument(help="The agent, as module:attribute or path/to/file.py:attribute.")],
    n: Annotated[int, typer.Option("--n-runners", "-n", min=1, help="Runners (at least 1).")] = 1,
    per_process: Annotated[
        int,
        typer.Option(
            "--per-process",
            min=1,
            help="Runners per process, as asyncio tasks on one store (default 1: a process each). "
            "Fewer processes use less memory; a synchronous agent then runs in a thread.",
        ),
    ] = 1,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Serve Prometheus /metrics on 127.0.0.1: runner process i on this port + i (default: none).",
        ),
    ] = None,
    timeout_s: Annotated[
        float | None, typer.Option(help="The timeout_seconds of the RolloutConfig of rollouts enqueued without one.")
    ] = None,
    unresponsive_s: Annotated[
        float | None,
        typer.Option(help="The unresponsive_seconds of the RolloutConfig of rollouts enqueued without one."),
    ] = None,
    max_attempts: Annotated[
        int | None, typer.Option(help="The max_attempts of the RolloutConfig of rollouts enqueued without one.")
    ] = None,
    retry_on: Annotated[
        str | None,
        typer.Option(
            help="The retry_condition of the RolloutConfig of rollouts enqueued without one: attempt statuses, "
            "comma-separated (failed,timeout,...)."
        ),
    ] = None,
    instrument: Annotated[
        list[FrameworkChoice] | None,
        typer.Option(
            "--instrument",
            metavar="<framework>",
            help="Switch on OpenInference's instrumentation of a framework in each runner: openai, openai_agents, "
            "langchain or all (repeatable; the frameworks extra).",
        ),
    ] = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Run runner processes that consume the namespace's rollout queue until Ctrl+C or SIGTERM.

    --timeout-s, --unresponsive-s, --max-attempts and --retry-on set the RolloutConfig of each
    claimed rollout that was enqueued with the default one (a rollout's own config wins).

    A process that dies is restarted (at most about once a minute when it keeps dying). Ctrl+C or
    SIGTERM gives attempts in flight 10 s to finish, then records the rest failed (their rollouts
    are requeued or failed by their RolloutConfig); a second Ctrl+C does so at once.

    Servers: uses $EVENTLIGHT_NATS_URL when set, else the embedded NATS `eventlight up` or a
    trainer started; never starts one (without it: exit 1, 'run `eventlight up`'). No trainer's
    run stops the servers while runners use them, and stopping the runners leaves them to the
    trainer and other runners: only when it is the last to use the servers a run started does it
    stop them."""
    from eventlight.net import redact
    from eventlight.runner import LitAgentRunner
    from eventlight.runner.metrics import RunnerMetrics
    from eventlight.runner_pool import GRACEFUL_STOP_S, RunnerPool
    from eventlight.tracer import OtelTracer

    settings = _settings(namespace)
    config = _rollout_config(timeout_s, unresponsive_s, max_attempts, retry_on)
    the_agent = load_agent(agent)
    instrument_names = _instrumented([f.value for f in instrument or ()])
    processes = -(-n // per_process)
    if metrics_port is not None:
        _check_metrics_ports(metrics_port, processes)
    lease = _run(_lease(settings, "eventlight runner"))  # before finding NATS: no run stops it then
    try:
        nats_url = _run(_runner_nats(settings))
        template = LitAgentRunner(
            OtelTracer(instrument=instrument_names),
            metrics=RunnerMetrics() if metrics_port is not None else None,
            rollout_config=config,
        )
        pool = RunnerPool(
            the_agent,
            n,
            settings,
            nats_url,
            runner=template,
            log_level=settings.log_level,
            metrics_port=metrics_port,
            runners_per_process=per_process,
        )
        signal.signal(signal.SIGTERM, _raise_terminated)
        # SIGINT stops the runners even when this process was started with it ignored (a parent that
        # ignores SIGINT passes that on through exec, and Python then installs no KeyboardInterrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pool.start()
        where = f" in {processes} process{'es' if processes > 1 else ''}" if processes != n else ""
        console.print(
            f"{n} runner(s){where} consuming {settings.stream_name} on {escape(redact(nats_url))}; Ctrl+C to stop"
        )
        if metrics_port is not None:
            console.print(f"metrics on http://127.0.0.1:{metrics_port}…{metrics_port + processes - 1}/metrics")
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
    finally:
        _run(_release(lease))


def _check_metrics_ports(first: int, processes: int) -> None:
    """Refuse ``--metrics-port`` when a port runner process ``i`` would serve on (``first + i``) is
    taken, before any process starts: that process would fail to bind, die and be restarted forever."""
    from eventlight.net import port_free

    if first + processes - 1 > 65535:
        raise CliError(f"--metrics-port {first} with {processes} runner processes goes past port 65535")
    for i in range(processes):
        if not port_free(first + i):
            raise CliError(
                f"--metrics-port {first}: port {first + i} (runner process {i}) is already in use on 127.0.0.1; "
                "pick another --metrics-port"
            )


def _instrumented(frameworks: list[str] | None) -> tuple[str, ...]:
    """The frameworks ``--instrument`` names, checked here before any process starts."""
    from eventlight import instrumentation
    from eventlight.core.errors import InvalidInputError

    if not frameworks:
        return ()
    try:
        names = instrumentation.validate(frameworks)
        instrumentation.require(*names)
    except InvalidInputError as exc:
        raise CliError(f"--instrument: {exc}") from exc
    return names


RETRYABLE = ("failed", "timeout", "unresponsive")
"""The attempt statuses ``--retry-on`` may name: the ones an attempt ends in without succeeding."""


def _rollout_config(
    timeout_s: float | None, unresponsive_s: float | None, max_attempts: int | None, retry_on: str | None
) -> RolloutConfig | None:
    """The ``RolloutConfig`` the options ask for, ``None`` when none is given.

    Raises:
        CliError: A value is out of range or names an unknown attempt status.
    """
    fields: dict[str, Any] = {}
    for name, value in (("timeout_seconds", timeout_s), ("unresponsive_seconds", unresponsive_s)):
        if value is not None:
            if not math.isfinite(value) or value <= 0:
                raise CliError(f"--{name.split('_')[0]}-s must be a finite number of seconds > 0, got {value:g}")
            fields[name] = value
    if max_attempts is not None:
        fields["max_attempts"] = max_attempts
    if retry_on is not None:
        statuses = [p.strip() for p in retry_on.split(",")]
        wrong = [p for p in statuses if p not in RETRYABLE]
        if wrong:
            raise CliError(f"--retry-on takes {', '.join(RETRYABLE)} (comma-separated), got {retry_on!r}")
        fields["retry_condition"] = statuses
    if not fields:
        return None
    try:
        return check_rollout_config(fields)
    except ValueError as exc:
        raise CliError(f"invalid rollout config: {exc}") from None


class _Terminated(Exception):
    """SIGTERM arrived (raised by ``_raise_terminated`` in the main thread)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated
