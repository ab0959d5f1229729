"""The ``eventlight`` command line, run as a user runs it (a subprocess) against the test servers.

Each error path must be one line on stderr with a non-zero exit code and no traceback; ``status``,
``sql`` and ``runner`` never start servers and refuse alike when none run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from importlib.metadata import version
from pathlib import Path
from typing import get_args

import pytest
from typer.testing import CliRunner

from eventlight.cli import CliError, app, load_agent
from eventlight.core.types import AttemptStatus, RolloutMode
from eventlight.instrumentation import FRAMEWORKS
from eventlight.ops import Services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

ROOT = Path(__file__).resolve().parent.parent
ENV_VARS = ("EVENTLIGHT_NATS_URL", "EVENTLIGHT_PG_DSN", "EVENTLIGHT_NAMESPACE", "EVENTLIGHT_STATE_DIR")


def cli(*args: str | bytes, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m eventlight.cli`` from the repository root with ``env`` over a clean environment."""
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    base["COLUMNS"] = "120"
    return subprocess.run(
        [sys.executable, "-m", "eventlight.cli", *args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
        cwd=ROOT,
        env={**base, **(env or {})},
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, *parts: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def env_of(ns: Settings) -> dict[str, str]:
    return {
        "EVENTLIGHT_NATS_URL": ns.nats_url or "",
        "EVENTLIGHT_PG_DSN": ns.pg_dsn or "",
        "EVENTLIGHT_NAMESPACE": ns.namespace,
        "EVENTLIGHT_STATE_DIR": str(ns.state_dir),
    }


# -- version and agent specs ------------------------------------------------------------------


def test_version_prints_the_package_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"eventlight {version('eventlight')}"


HELP_WIDTH = 80
PYTHON_LABEL = re.compile(r"<(bool|list\[[^>]*\])>")  # a type label that reads as Python, not as what to type
CUT_CELL = re.compile(r"\S…\s*│\s*$")  # rich's ellipsis where a word did not fit its column
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def help_pages() -> dict[str, str]:
    """``eventlight [COMMAND] --help`` for every command, rendered at ``HELP_WIDTH`` columns (``bench``'s
    own, from ``python -m bench``, which ``eventlight bench`` runs)."""
    import typer.main

    from eventlight.cli import app

    pages = {}
    for name, command in [("", None), *typer.main.get_command(app).commands.items()]:  # type: ignore[attr-defined]
        if command is not None and not command.add_help_option:  # bench: its suite's own help
            done = subprocess.run(
                [sys.executable, "-m", name, "--help"],
                env={**os.environ, "COLUMNS": str(HELP_WIDTH)},
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
                check=True,
            )
            pages[name] = done.stdout
            continue
        args = [name, "--help"] if name else ["--help"]
        result = CliRunner().invoke(app, args, env={"COLUMNS": str(HELP_WIDTH)}, prog_name="eventlight")
        assert result.exit_code == 0, (name, result.output)
        pages[name] = result.output
    return {name: ANSI.sub("", page) for name, page in pages.items()}


def test_every_help_page_reads_well_at_80_columns() -> None:
    """At 80 columns, typer 0.29 labelled every flag ``<bool>`` (``--help`` too), as if it took a
    value, and repeatable options ``<list[str]>``; the commands' docstrings kept their source line
    breaks, which rich broke again, leaving lines of one or two words; and a few cells were cut
    short with "…" (``RolloutConfig.timeout_se…``, ``$EVENTLIGHT_SERVER_TOK…``). None of that now,
    and no line is wider than the terminal."""
    pages = help_pages()
    assert {"", "up", "sql", "runner", "serve", "bench", "replay", "export", "import"} <= set(pages)
    for name, page in pages.items():
        lines = page.splitlines()
        assert "Usage:" in page, (name, page)
        assert not PYTHON_LABEL.search(page), (name, PYTHON_LABEL.findall(page))
        assert [line for line in lines if len(line) > HELP_WIDTH] == [], name
        assert [line for line in lines if CUT_CELL.search(line)] == [], name
        for line, after in zip(lines, lines[1:], strict=False):  # the description: each line as full as it can be
            if "│" in line + after or not line.strip() or not after.strip():
                continue
            assert len(line.rstrip()) + 1 + len(after.split()[0]) > HELP_WIDTH - 1, (name, line, after)


CHOICES = {
    "--format": (("sql", "SELECT 1"), ("table", "csv", "json")),
    "--status": (("replay", "--out", "x.jsonl"), get_args(AttemptStatus)),
    "--mode": (("replay", "--out", "x.jsonl"), get_args(RolloutMode)),
    "--instrument": (("runner", "no_such_module_xyz:agent"), (*FRAMEWORKS, "all")),
}
"""Each option that takes one of a fixed set of values: a command line before it, and the values."""


@pytest.mark.parametrize("option", sorted(CHOICES))
def test_an_option_of_fixed_values_is_a_choice_its_help_lists(option: str) -> None:
    """These options took any string (``sql --format`` showed ``<str>``): a wrong value was refused
    by the command later, in its own words (after loading the agent, for ``runner``), and the help
    of ``--status`` named no status. Now the value is checked as the arguments are parsed (exit 2,
    one line naming every value), before the command starts, and the option's help row lists them."""
    args, values = CHOICES[option]
    line = assert_one_line_error(cli(*args, option, "bogus"), 2, f"Invalid value for '{option}'")
    assert f"'bogus' is not one of {', '.join(map(repr, values))}." in line, line
    page = CliRunner().invoke(app, [args[0], "--help"], env={"COLUMNS": "300"}, prog_name="eventlight").output
    row = next(line for line in ANSI.sub("", page).splitlines() if f" {option} " in line)
    label = f"<{'|'.join(values)}>"
    assert label in row or f"{', '.join(values[:-1])}" in row, row


def test_the_choice_enums_hold_the_values_they_stand_for() -> None:
    """Typer 0.29 takes no ``list[Literal[...]]``: a repeatable choice is an enum of its own, kept
    equal to the type whose values it offers."""
    from eventlight.cli.replay import ModeChoice, StatusChoice
    from eventlight.cli.runner import FrameworkChoice

    assert [*StatusChoice] == [*get_args(AttemptStatus)]
    assert [*ModeChoice] == [*get_args(RolloutMode)]
    assert [*FrameworkChoice] == [*FRAMEWORKS, "all"]


def test_bench_vs_is_a_choice() -> None:
    """``python -m bench --vs`` took any string (``run_suite`` refused it); now typer does, with its help's label."""
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--vs", "bogus"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, "COLUMNS": "300"},  # the error panel's line unbroken
    )
    assert result.returncode == 2 and "'bogus' is not one of 'agentlightning'" in result.stderr, result.stderr
    assert "<agentlightning>" in help_pages()["bench"]


def plain_function(task: object, llm: object) -> float:  # not decorated: not an agent
    return 0.0


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("os:path", "is a module, not an agent"),
        ("os:getcwd", "is a function without @eventlight.rollout, not an agent"),
        ("tests.test_cli:plain_function", "is a function without @eventlight.rollout"),
        ("eventlight:Settings", "is the class Settings, not an agent"),
        ("no_such_module_xyz:agent", "no module named 'no_such_module_xyz'"),
        ("os:no_such_attr", "os has no attribute 'no_such_attr'"),
        ("examples/room_booking/agent.py", "expected module:attribute"),
        ("examples/room_booking/nope.py:agent", "no Python file examples/room_booking/nope.py"),
        ("os", "expected module:attribute"),
    ],
)
def test_runner_refuses_what_is_not_an_agent_in_one_line(spec: str, says: str) -> None:
    assert_one_line_error(cli("runner", spec), 2, repr(spec), says)


def test_runner_needs_at_least_one_process() -> None:
    assert_one_line_error(cli("runner", "examples.room_booking.agent:room_booker", "-n", "0"), 2, "--n-runners")


def test_runner_refuses_a_metrics_port_in_use_before_starting_processes(tmp_path: Path) -> None:
    """Runner process 1's port taken: it failed to bind and was restarted forever, after the CLI had
    promised metrics on both ports."""
    import socket

    from eventlight.net import free_port

    taken = socket.socket()
    while True:  # two neighbouring ports: the first free, the second held here
        first = free_port()
        try:
            taken.bind(("127.0.0.1", first + 1))
            break
        except OSError:
            continue
    taken.listen()
    with taken:
        env = {"EVENTLIGHT_STATE_DIR": str(tmp_path / "state")}
        result = cli("runner", "tests/fault_agents.py:quick", "-n", "2", "--metrics-port", str(first), env=env)
    assert_one_line_error(result, 2, f"--metrics-port {first}: port {first + 1} (runner process 1) is already in use")
    assert "metrics on" not in result.stdout


def test_down_refuses_a_namespace_it_would_not_limit(tmp_path: Path) -> None:
    """``down -N x`` stopped the servers of every namespace, as if -N had limited it to one."""
    result = cli("down", "-N", "x", env={"EVENTLIGHT_STATE_DIR": str(tmp_path / "state")})
    assert_one_line_error(result, 2, "every namespace shares", "-N x")


def test_serve_body_min_rate_0_disables_the_minimum_rate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--body-min-rate 0`` serves with no minimum body rate (``BodyLimit``'s ``None``), as
    ``LightningStoreServer(body_min_bytes_per_s=None)`` does; it was refused as not positive."""
    import importlib
    import socket

    serve_module = importlib.import_module("eventlight.cli.serve")
    seen: list[dict[str, object]] = []

    async def fake_serve(*args: object) -> int:
        seen.append(dict(args[-1]))  # type: ignore[call-overload]
        return 0

    monkeypatch.setattr(serve_module, "_serve", fake_serve)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"EVENTLIGHT_STATE_DIR": str(tmp_path)}
    for rate, expected in (("0", None), ("512", 512.0)):
        result = CliRunner().invoke(
            app, ["serve", "--backend", "memory", "--port", port, "--body-min-rate", rate], env=env
        )
        assert result.exit_code == 0, result.output
        assert seen.pop()["body_min_bytes_per_s"] == expected
    refused = CliRunner().invoke(app, ["serve", "--port", port, "--body-min-rate", "-1"], env=env)
    assert refused.exit_code == 2 and not seen
    page = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "300"}, prog_name="eventlight").output
    assert "0: no minimum rate" in ANSI.sub("", page)


def test_load_agent_accepts_agents_by_module_or_file() -> None:
    from eventlight.agent import LitAgent

    assert isinstance(load_agent("examples.room_booking.agent:room_booker"), LitAgent)
    assert isinstance(load_agent("examples/room_booking/agent.py:room_booker"), LitAgent)
    with pytest.raises(CliError, match="not an agent"):
        load_agent("examples.room_booking.agent:grade")


AGENT_FILE = """
import eventlight as agl


@agl.rollout
async def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    return 0.25
"""


def test_load_agent_imports_the_file_named_not_a_module_of_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``x/random.py:agent`` gave the standard library's ``random`` ('has no attribute 'agent'')."""
    import pickle
    import random

    from eventlight.agent import LitAgent

    monkeypatch.setattr(sys, "path", list(sys.path))  # load_agent adds the file's folder
    (tmp_path / "random.py").write_text(AGENT_FILE)
    agent = load_agent(f"{tmp_path}/random.py:agent")
    assert isinstance(agent, LitAgent) and not hasattr(random, "agent")
    # runner processes inherit sys.path: the folder must not shadow the standard library there
    # (first on sys.path, this file was `random` to every process spawned afterwards)
    shadow = subprocess.run(
        [sys.executable, "-c", "import random; print(hasattr(random, 'agent'))"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        capture_output=True,
        timeout=60,
    )
    assert shadow.stdout.strip() == b"False", shadow.stderr.decode()
    # a runner process (here a fresh interpreter with the standard library's random imported first)
    # unpickles the agent by its module's name and gets the function from that file
    code = "import asyncio, pickle, random, sys; print(asyncio.run(pickle.loads(sys.stdin.buffer.read())({}, None)))"
    child = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(agent), capture_output=True, cwd=ROOT, timeout=60
    )
    assert child.returncode == 0 and child.stdout.strip() == b"0.25", child.stderr.decode()


# -- absent, unreachable and recorded servers -------------------------------------------------


def test_status_sql_and_runner_refuse_alike_when_no_server_runs(tmp_path: Path) -> None:
    env = {"EVENTLIGHT_STATE_DIR": str(tmp_path / "state")}
    lines = [
        assert_one_line_error(cli(*args, env=env), 1, "no eventlight servers are running", "run `eventlight up`")
        for args in (("status",), ("sql", "SELECT 1"), ("runner", "examples.room_booking.agent:room_booker"))
    ]
    assert lines[0] == lines[1].replace("EVENTLIGHT_PG_DSN", "EVENTLIGHT_NATS_URL") == lines[2]
    assert not (tmp_path / "state").exists()  # nothing was started, not even a state folder


def test_unreachable_configured_servers_are_named_without_their_password(tmp_path: Path) -> None:
    env = {
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
        "EVENTLIGHT_PG_DSN": "postgresql://user:s3cret@127.0.0.1:1/db",
        "EVENTLIGHT_NATS_URL": "nats://user:s3cret@127.0.0.1:1",
    }
    for args, var in (
        (("sql", "SELECT 1"), "EVENTLIGHT_PG_DSN postgresql://user:***@127.0.0.1:1/db"),
        (("status",), "EVENTLIGHT_NATS_URL nats://user:***@127.0.0.1:1"),
        (("runner", "examples.room_booking.agent:room_booker"), "EVENTLIGHT_NATS_URL nats://user:***@127.0.0.1:1"),
    ):
        line = assert_one_line_error(cli(*args, env=env), 1, "cannot reach", var)
        assert "s3cret" not in line


def test_up_refuses_a_configured_postgres_that_refuses_the_role(namespace: Settings) -> None:
    """A DSN naming a role the server does not have (a typo, a wrong password) made `up` warn and put
    the namespace into an embedded Postgres of its own, exit 0: the data landed in another server."""
    assert namespace.pg_dsn is not None
    url = urllib.parse.urlsplit(namespace.pg_dsn)
    dsn = urllib.parse.urlunsplit(url._replace(netloc=f"eventlight_no_such_role:s3cret@{url.hostname}:{url.port}"))
    root = Path(tempfile.mkdtemp(prefix="el-test-cli-"))
    root.chmod(0o755)  # one the embedded Postgres could use (it runs as `postgres` under root)
    env = {**env_of(namespace), "EVENTLIGHT_PG_DSN": dsn, "EVENTLIGHT_STATE_DIR": str(root / "state")}
    result = cli("up", env=env)
    try:
        line = assert_one_line_error(
            result,
            2,
            f"EVENTLIGHT_PG_DSN postgresql://eventlight_no_such_role:***@{url.hostname}:{url.port}",
            'Postgres refused the connection (role "eventlight_no_such_role" does not exist)',
            "fix the DSN, or unset EVENTLIGHT_PG_DSN to use the embedded Postgres",
        )
        assert "s3cret" not in line
        assert not (root / "state" / "pg").exists() and not (root / "state" / "services.json").exists()
    finally:
        cli("down", env=env)  # what an `up` that fell back started
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("options=-c%20el_no_such%3D1", 'refused the connection (unrecognized configuration parameter "el_no_such")'),
        ("sslmode=require", "refused the connection (PostgreSQL server at"),
    ],
    ids=["an option it refuses", "ssl it does not do"],
)  # fmt: skip
def test_up_refuses_a_configured_postgres_that_refuses_the_dsns_settings(
    namespace: Settings, query: str, says: str
) -> None:
    """The server answered, but refused a setting the DSN asks for: an unknown ``options`` setting
    made `up` (and `status`) fail with "internal error: UndefinedObjectError", and ``sslmode=require``
    on a server without SSL made `up` warn that the server "did not answer" and put the namespace in
    the embedded Postgres (exit 0), as a refused role did."""
    import asyncio

    import asyncpg

    assert namespace.pg_dsn is not None
    dsn = f"{namespace.pg_dsn}{'&' if '?' in namespace.pg_dsn else '?'}{query}"
    if query.startswith("sslmode"):
        try:
            asyncio.run(asyncio.wait_for(asyncpg.connect(dsn), 5)).terminate()
            pytest.skip("this Postgres does SSL")
        except (OSError, asyncpg.PostgresError, TimeoutError):
            pass
    root = Path(tempfile.mkdtemp(prefix="el-test-cli-"))
    root.chmod(0o755)
    env = {**env_of(namespace), "EVENTLIGHT_PG_DSN": dsn, "EVENTLIGHT_STATE_DIR": str(root / "state")}
    try:
        result = cli("up", env=env)
        assert_one_line_error(result, 2, f"Postgres {says}", "fix the DSN, or unset EVENTLIGHT_PG_DSN")
        assert not (root / "state" / "pg").exists() and not (root / "state" / "services.json").exists()
        assert_one_line_error(cli("status", env=env), 1, f"Postgres {says}")
    finally:
        cli("down", env=env)
        shutil.rmtree(root, ignore_errors=True)


def test_up_probes_a_configured_postgres_before_it_starts_nats(namespace: Settings, tmp_path: Path) -> None:
    """`up` with the embedded NATS and a DSN the server refuses started nats-server, then probed the
    DSN and stopped NATS again: it now probes first and starts nothing."""
    assert namespace.pg_dsn is not None
    url = urllib.parse.urlsplit(namespace.pg_dsn)
    dsn = urllib.parse.urlunsplit(url._replace(netloc=f"eventlight_no_such_role@{url.hostname}:{url.port}"))
    state = tmp_path / "state"
    env = {**env_of(namespace), "EVENTLIGHT_NATS_URL": "", "EVENTLIGHT_PG_DSN": dsn, "EVENTLIGHT_STATE_DIR": str(state)}
    try:
        result = cli("up", env=env)
        assert_one_line_error(result, 2, "Postgres refused the connection", "fix the DSN")
        assert not (state / "nats").exists(), "nats-server was started"
    finally:
        cli("down", env=env)


@pytest.mark.parametrize("where", ["sslrootcert", "PGSSLROOTCERT", "home"])
def test_up_refuses_verify_full_without_a_root_certificate(namespace: Settings, tmp_path: Path, where: str) -> None:
    """``sslmode=verify-full`` with no root certificate (asyncpg refuses it before it connects) read
    "did not answer", and `up` put the namespace in the embedded Postgres: now a refused
    configuration, exit 2, naming the DSN (password hidden) and the missing certificate."""
    assert namespace.pg_dsn is not None
    url = urllib.parse.urlsplit(namespace.pg_dsn)
    missing = tmp_path / "no-root.crt"
    query = "sslmode=verify-full" + (f"&sslrootcert={missing}" if where == "sslrootcert" else "")
    netloc = f"postgres:s3cret@{url.hostname}:{url.port}"
    dsn = urllib.parse.urlunsplit(url._replace(netloc=netloc, query=query))
    state = tmp_path / "state"
    env = {**env_of(namespace), "EVENTLIGHT_NATS_URL": "", "EVENTLIGHT_PG_DSN": dsn}
    env |= {"EVENTLIGHT_STATE_DIR": str(state), "HOME": str(tmp_path), "PGSSLROOTCERT": ""}
    if where == "PGSSLROOTCERT":
        env["PGSSLROOTCERT"] = str(missing)
    names = str(tmp_path / ".postgresql" / "root.crt") if where == "home" else str(missing)
    try:
        line = assert_one_line_error(
            cli("up", env=env),
            2,
            f"EVENTLIGHT_PG_DSN postgresql://postgres:***@{url.hostname}:{url.port}",
            "Postgres cannot be used with this DSN (",
            names,
            "fix the DSN",
        )
        assert "s3cret" not in line
        assert not (state / "nats").exists() and not (state / "pg").exists()
    finally:
        cli("down", env=env)


async def _fill(ns: Settings) -> None:
    async with JetStreamLightningStore(ns, pg_dsn=ns.pg_dsn) as store:
        await store.enqueue_rollout(input={"q": 1})
        await store.enqueue_rollout(input={"q": 2})
        await store.start_rollout(input={"q": 3}, worker_id="Worker-7")
        await store.update_worker("Worker-7", {"cpu": 0.5})
        await store.sync_all()


async def test_status_shows_services_rollouts_spans_and_worker_heartbeats(namespace: Settings) -> None:
    await _fill(namespace)
    result = cli("status", env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^NATS\s+nats://\S+\s+external, from EVENTLIGHT_NATS_URL", out, re.M), out
    assert re.search(r"^Postgres\s+postgresql://\S+\s+external, from EVENTLIGHT_PG_DSN", out, re.M), out
    assert f"stream {namespace.stream_name} (" in out and "events)" in out
    assert re.search(r"^rollouts\s+.*queuing=2", out, re.M), out
    assert re.search(r"^durability\s+fsync$", out, re.M), out  # external servers: the setting
    assert re.search(r"^spans\s+0$", out, re.M) and re.search(
        r"^projection\s+up to date \(lag 0 events\)$", out, re.M
    ), out
    assert re.search(r"Worker-7\s+yes\s+busy\s+\d+ s ago", out), out
    assert "not running" not in out + result.stderr


async def test_status_and_sql_use_the_embedded_servers_up_recorded(
    namespace: Settings, services: tuple[Settings, Services]
) -> None:
    base, svc = services
    env = {"EVENTLIGHT_STATE_DIR": str(base.state_dir), "EVENTLIGHT_NAMESPACE": namespace.namespace}
    result = cli("status", env=env)
    assert result.returncode == 0, result.stderr
    if svc.nats_pid is not None:
        assert re.search(rf"^NATS\s+nats://\S+\s+embedded, nats-server pid {svc.nats_pid}", result.stdout, re.M)
        assert re.search(r"^durability\s+fsync$", result.stdout, re.M), result.stdout  # from its config
        other = cli("status", env={**env, "EVENTLIGHT_DURABILITY": "interval"})
        assert re.search(r"^durability\s+fsync \(EVENTLIGHT_DURABILITY asks interval\)$", other.stdout, re.M)
    ok = cli("sql", "SELECT count(*) AS n FROM rollouts", env=env)
    assert ok.returncode == 0 and "1 row(s)" in ok.stdout, ok.stderr


def test_a_namespace_that_does_not_exist_is_refused_not_created(namespace: Settings) -> None:
    env = {**env_of(namespace), "EVENTLIGHT_NAMESPACE": "no_such_ns_cli"}
    for args in (("sql", "SELECT 1"), ("status",)):
        assert_one_line_error(cli(*args, env=env), 2, "namespace 'no_such_ns_cli' does not exist")
    assert_one_line_error(cli("status", "-N", "Bad-Name", env=env), 2, "namespace 'Bad-Name' must match")
    schemas = cli("sql", "SELECT nspname FROM pg_namespace WHERE nspname = 'el_no_such_ns_cli'", env=env_of(namespace))
    assert "0 row(s)" in schemas.stdout, schemas.stderr + schemas.stdout


# -- sql --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("", "empty query"),
        ("  \n ", "empty query"),
        (";", "empty query"),
        ("SELECT 1; SELECT 2", "several statements given"),
        ("SELEC nonsense", "SQL error: syntax error"),
        ("SELECT * FROM no_such_table", 'SQL error: relation "no_such_table" does not exist'),
        ("DELETE FROM rollouts", "only reads"),
    ],
)
def test_sql_refuses_bad_queries_in_one_line(namespace: Settings, query: str, says: str) -> None:
    assert_one_line_error(cli("sql", query, env=env_of(namespace)), 2, says)


def test_sql_refuses_a_query_that_is_not_utf8(namespace: Settings) -> None:
    assert_one_line_error(cli("sql", b"SELECT '\xff'", env=env_of(namespace)), 2, "not valid UTF-8")


WIDE = (
    "SELECT repeat('x', 500) AS wide, '{\"a\": 1, \"b\": [1, 2]}'::jsonb AS j, "
    "1700000000.5::float8 AS start_time, NULL::text AS nothing, "
    "timestamptz '2024-01-02 03:04:05+02' AS ts, 42 AS n"
)


def test_sql_prints_wide_results_times_json_and_null_readably(namespace: Settings) -> None:
    result = cli("sql", WIDE, env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "row 1" in out and re.search(r"^start_time\s+2023", out, re.M)  # too wide: one record per row
    assert out.count("x") == 239 and "x…" in out  # a long cell is cut with an ellipsis
    assert '{"a":1,"b":[1,2]}' in out
    assert "2023-11-14 22:13:20.500Z" in out  # float epoch seconds in a *_time column
    assert "2024-01-02 01:04:05.000Z" in out  # timestamptz, in UTC
    assert "null" in out and "1 row(s)" in out


def test_sql_folds_long_cells_of_a_table_that_fits(namespace: Settings) -> None:
    result = cli("sql", "SELECT repeat('y', 100) AS long, 1 AS n", env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert "┃ long" in result.stdout and "y" * 60 in result.stdout and "y" * 61 not in result.stdout


async def test_sql_prints_projected_epoch_columns_as_utc(namespace: Settings) -> None:
    await _fill(namespace)
    result = cli("sql", "SELECT rollout_id, start_time FROM rollouts ORDER BY start_time", env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z", result.stdout)) == 3, result.stdout


def test_sql_csv_and_json_keep_raw_values(namespace: Settings) -> None:
    as_json = cli("sql", WIDE, "--format", "json", env=env_of(namespace))
    assert as_json.returncode == 0, as_json.stderr
    row = json.loads(as_json.stdout)
    assert row["j"] == {"a": 1, "b": [1, 2]} and row["start_time"] == 1700000000.5 and row["nothing"] is None
    assert len(row["wide"]) == 500 and row["n"] == 42
    as_csv = cli("sql", "SELECT 1 AS a, NULL::text AS b, '{\"k\": 2}'::jsonb AS c", "-f", "csv", env=env_of(namespace))
    assert as_csv.stdout == 'a,b,c\n1,,"{""k"":2}"\n', as_csv.stdout
    assert_one_line_error(cli("sql", "SELECT 1", "-f", "yaml", env=env_of(namespace)), 2, "'yaml' is not one of")


async def test_runner_runs_heartbeats_into_status_and_stops_on_ctrl_c(namespace: Settings) -> None:
    import asyncio
    import signal

    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-X", "faulthandler", "-m", "eventlight.cli", "runner"),
        *("examples/room_booking/agent.py:room_booker", "-n", "1"),  # a file: its runner process imports it again
        cwd=ROOT,
        env={**base, **env_of(namespace)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn):  # projects, as a trainer does
            out = ""
            for _ in range(120):
                out = (await asyncio.to_thread(cli, "status", env=env_of(namespace))).stdout
                if "Worker-0@" in out:
                    break
                await asyncio.sleep(0.5)
        assert re.search(r"Worker-0@\S+\s+yes\s+\S+\s+\d+ s ago", out), out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out_bytes, err_bytes = await asyncio.wait_for(proc.communicate(), 60)
        except TimeoutError:  # where it hung: -X faulthandler prints every thread's stack on SIGABRT
            proc.send_signal(signal.SIGABRT)
            out_bytes, err_bytes = await asyncio.wait_for(proc.communicate(), 30)
    stdout, stderr = out_bytes.decode(), err_bytes.decode()
    assert proc.returncode == 130, f"exit {proc.returncode}\n{stdout}\n{stderr}"
    assert "consuming" in stdout and "Traceback" not in stderr
    after = await asyncio.to_thread(cli, "sql", "SELECT 1 AS one", env=env_of(namespace))
    assert after.returncode == 0, after.stderr  # the runner left the servers running


async def test_a_command_stopped_by_ctrl_c_says_interrupted(namespace: Settings) -> None:
    """Ctrl+C during ``eventlight sql`` (and any command that does not catch it) exited 130 with
    nothing on stderr, as if it had finished; now one line ``interrupted`` says it did not."""
    import asyncio
    import signal

    import asyncpg

    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "eventlight.cli", "sql", "SELECT pg_sleep(59.25)"),
        cwd=ROOT,
        env={**base, **env_of(namespace)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        admin = await asyncpg.connect(namespace.pg_dsn)
        try:
            running = (
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(59.25)%' AND pid <> pg_backend_pid()"
            )
            for _ in range(600):  # until the query runs: the command is then inside asyncio.run
                if await admin.fetchval(running) or proc.returncode is not None:
                    break
                await asyncio.sleep(0.1)
        finally:
            await admin.close()
    finally:
        proc.send_signal(signal.SIGINT)
        out_bytes, err_bytes = await asyncio.wait_for(proc.communicate(), 60)
    stderr = err_bytes.decode()
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out_bytes.decode()}\n{stderr}"
    assert stderr.strip().splitlines() == ["interrupted"], stderr


def test_redact_hides_passwords_and_tokens() -> None:
    from eventlight.net import redact

    assert redact("postgresql://u:pw@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact("nats://tok@h:4222,nats://a:b@h2:4222") == "nats://***@h:4222,nats://a:***@h2:4222"
    assert redact("host=h password=pw user=u") == "host=h password=*** user=u"
    assert redact("postgresql://postgres@127.0.0.1/postgres") == "postgresql://postgres@127.0.0.1/postgres"
    # a password holding an unencoded "@": all of it, up to the last "@" before the host
    assert redact("nats://u:se@cret@h:4222 (x@y)") == "nats://u:***@h:4222 (x@y)"


async def test_an_address_that_does_not_parse_never_shows_its_password() -> None:
    """``scheme://user:secret`` (the host forgotten) parses as host ``user``, port ``secret``: the
    parsers' errors quote that port, and ``redact`` finds no ``@`` to mask before."""
    from eventlight.core.errors import InvalidInputError
    from eventlight.store.jetstream import pg_errors
    from eventlight.store.jetstream.connect import server_urls

    with pytest.raises(InvalidInputError) as nats_error:
        server_urls("nats://user:secret")
    assert "secret" not in str(nats_error.value) and "is not a NATS URL" in str(nats_error.value)
    with pytest.raises(InvalidInputError) as pg_error:  # asyncpg's ValueError, before any connection
        await pg_errors.connect("postgresql://user:secret/db")
    assert "secret" not in str(pg_error.value) and "is not a Postgres DSN" in str(pg_error.value)
    with pytest.raises(InvalidInputError) as with_at:  # "user:password@" is there: redact masks it, the rest stays
        server_urls("nats://user:secret@host:x")
    assert str(with_at.value) == "nats://user:***@host:x is not a NATS URL: its port 'x' is not a number"
    with pytest.raises(InvalidInputError) as out_of_range:  # asyncpg's socket call: OverflowError
        await pg_errors.connect("postgresql://user:secret@127.0.0.1:99999/db")
    assert "secret" not in str(out_of_range.value) and "is not a Postgres DSN" in str(out_of_range.value)


@pytest.mark.parametrize("command", [["status"], ["sql", "SELECT 1"], ["runner", "examples.tutorials.debug:main"]])
def test_a_nats_url_of_another_scheme_is_one_line_before_connecting(command: list[str], tmp_path: Path) -> None:
    """``EVENTLIGHT_NATS_URL=http://127.0.0.1:4222 eventlight status`` printed a 15-line table ending
    in ``TimeoutError()``: nats-py reads ``http://…`` as a host named ``http``. Settings refuse a
    scheme nats-py does not take (nats, tls, ws, wss), so every command says so in one line."""
    env = {"EVENTLIGHT_NATS_URL": "http://127.0.0.1:4222", "EVENTLIGHT_STATE_DIR": str(tmp_path)}
    done = cli(*command, env=env)
    assert_one_line_error(done, 2, "EVENTLIGHT_NATS_URL", "http://127.0.0.1:4222 is not a NATS URL", "nats://")


def test_settings_take_the_schemes_nats_py_connects_with() -> None:
    from eventlight.core.errors import InvalidInputError

    for url in ["nats://a:1", "tls://a:1", "ws://a:1", "wss://a", "a:1", "a", "nats://a:1, b:2"]:
        assert Settings(nats_url=url).nats_url == url
    for url, says in [
        ("http://a:1", "its scheme is http://"),
        ("NATS://a:1", "its scheme is NATS://"),
        ("nats://a:1,ws://b:2", "mix WebSocket"),
        ("nats://u:secret@a:1,https://u:secret@b", "its scheme is https://"),
    ]:
        with pytest.raises(InvalidInputError, match="EVENTLIGHT_NATS_URL") as refused:
            Settings(nats_url=url)
        assert says in str(refused.value) and "secret" not in str(refused.value)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("EVENTLIGHT_STREAM_REPLICAS", "0", "stream_replicas must be 1 to 5 (JetStream's limit; EVENTLIGHT_STREAM_"),
        ("EVENTLIGHT_RETENTION_S", "-1", "retention_s must be 0 or more seconds (EVENTLIGHT_RETENTION_S), not -1"),
    ],
)
def test_a_setting_out_of_range_names_its_variable(name: str, value: str, says: str, tmp_path: Path) -> None:
    """``EVENTLIGHT_STREAM_REPLICAS=0`` was refused as "stream_replicas must be 1 to 5 (JetStream's
    limit), not 0", without the variable every other setting's error names."""
    done = cli("status", env={"EVENTLIGHT_STATE_DIR": str(tmp_path), name: value})
    assert_one_line_error(done, 2, says, name)


def test_a_log_level_no_logger_knows_is_warned_as_typed(tmp_path: Path) -> None:
    """``EVENTLIGHT_LOG_LEVEL=bogus`` warned "EVENTLIGHT_LOG_LEVEL='BOGUS' is not a log level", a
    value nobody typed; the warning gives it as typed."""
    done = cli("--version", env={"EVENTLIGHT_STATE_DIR": str(tmp_path), "EVENTLIGHT_LOG_LEVEL": "bogus"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "warning: EVENTLIGHT_LOG_LEVEL='bogus' is not a log level; using INFO"


def test_log_level_from_env_takes_any_case_and_a_default() -> None:
    from eventlight.logging import log_level_from_env

    assert log_level_from_env("INFO", {"EVENTLIGHT_LOG_LEVEL": "debug"}) == ("DEBUG", None)
    assert log_level_from_env("WARNING", {}) == ("WARNING", None)
    assert log_level_from_env("WARNING", {"EVENTLIGHT_LOG_LEVEL": ""}) == ("WARNING", None)
    assert log_level_from_env("INFO", {"EVENTLIGHT_LOG_LEVEL": "Loud"}) == (
        "INFO",
        "EVENTLIGHT_LOG_LEVEL='Loud' is not a log level; using INFO",
    )
