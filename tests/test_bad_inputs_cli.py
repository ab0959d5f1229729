"""Bad input at the command line: every ``eventlight`` command and ``eventlight sql`` (issue 12).

Each case runs ``python -m eventlight.cli`` in a process of its own and asserts one line on stderr
starting ``error:``, naming the cause, no traceback, and the documented exit code (2 a wrong
argument, 1 a server missing or not answering). Every case is recorded in the bad-input table
(``bad_input_table``, printed with ``-s``). Afterwards the same servers still answer ``status`` and
``sql``.
"""

from __future__ import annotations

import asyncio
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
from conftest import BadInputRows
from test_cli import assert_one_line_error, cli, env_of

from eventlight.net import free_port
from eventlight.settings import Settings

Case = tuple[tuple[str | bytes, ...], dict[str, str], int, str]
"""(arguments, environment over the namespace's, exit code, what the error line says)."""

SQL: dict[str, Case] = {
    "COPY TO PROGRAM": (("sql", "COPY (SELECT 1) TO PROGRAM 'id'"), {}, 2, "pg_execute_server_program"),
    "pg_read_file": (("sql", "SELECT pg_read_file('/etc/hostname')"), {}, 2, "permission denied for function"),
    "pg_terminate_backend": (("sql", "SELECT pg_terminate_backend({victim})"), {}, 2, "must be a superuser"),
    "lo_import": (("sql", "SELECT lo_import('/etc/hostname')"), {}, 2, "permission denied"),
    "DROP TABLE": (("sql", "DROP TABLE rollouts"), {}, 2, "read-only transaction"),
    "INSERT": (("sql", "INSERT INTO rollouts (rollout_id) VALUES ('x')"), {}, 2, "read-only transaction"),
    "two statements": (("sql", "SELECT 1; SELECT 2"), {}, 2, "several statements"),
    "syntax error": (("sql", "SELEC 1"), {}, 2, 'syntax error at or near "SELEC"'),
    "empty query": (("sql", ""), {}, 2, "empty query"),
    "unknown table": (("sql", "SELECT * FROM nosuchtable"), {}, 2, 'relation "nosuchtable" does not exist'),
    "non-UTF-8 query": (("sql", b"SELECT '\xff'"), {}, 2, "not valid UTF-8"),
    "timeout": (("sql", "SELECT pg_sleep(10)", "--timeout-s", "0.3"), {}, 2, "longer than --timeout-s 0.3 s"),
    "--timeout-s 0": (("sql", "SELECT 1", "--timeout-s", "0"), {}, 2, "greater than or equal to 0.001"),
    "--format xml": (("sql", "SELECT 1", "-f", "xml"), {}, 2, "'xml' is not one of 'table', 'csv', 'json'"),
    "--param not an int": (("sql", "SELECT $1::int", "-p", "abc"), {}, 2, "--param $1 'abc' is not a whole number"),
    "--param missing": (("sql", "SELECT $1, $2", "-p", "1"), {}, 2, "2 placeholder(s) ($1…) and 1 --param"),
    "--param non-UTF-8": (("sql", "SELECT $1::text", "-p", b"\xff"), {}, 2, "not valid UTF-8"),
    "no query": (("sql",), {}, 2, "Missing argument 'query'"),
}

CLI: dict[str, Case] = {
    "unknown command": (("nosuchcommand",), {}, 2, "No such command 'nosuchcommand'"),
    "unknown option": (("status", "--bogus"), {}, 2, "No such option: --bogus"),
    "invalid namespace": (("status", "-N", "Bad-NS!"), {}, 2, "must match ^[a-z0-9_]{1,40}$"),
    "unknown namespace": (("status", "-N", "nosuchns"), {}, 2, "namespace 'nosuchns' does not exist"),
    "non-UTF-8 namespace": (("status", "-N", b"\xff"), {}, 2, "must match"),
    "runner: no agent": (("runner",), {}, 2, "Missing argument 'agent'"),
    "runner: unknown module": (("runner", "nosuchmod:agent"), {}, 2, "no module named 'nosuchmod'"),
    "runner: unknown attribute": (
        ("runner", "tests/fault_agents.py:nosuch"),
        {},
        2,
        "has no attribute 'nosuch'",
    ),
    "runner: not an agent": (("runner", "tests/fault_agents.py:asyncio"), {}, 2, "fault_agents.py:asyncio"),
    "runner -n 0": (("runner", "tests/fault_agents.py:quick", "-n", "0"), {}, 2, "greater than or equal to 1"),
    "runner --per-process 0": (
        ("runner", "tests/fault_agents.py:quick", "--per-process", "0"),
        {},
        2,
        "greater than or equal to 1",
    ),
    "serve --body-timeout-s 0": (("serve", "--body-timeout-s", "0"), {}, 2, "0.0 is not a positive, finite number"),
    "serve --body-min-rate nan": (("serve", "--body-min-rate", "nan"), {}, 2, "nan is not a positive, finite number"),
    "runner --instrument crewai": (
        ("runner", "tests/fault_agents.py:quick", "--instrument", "crewai"),
        {},
        2,
        "'crewai' is not one of 'openai', 'openai_agents', 'langchain', 'all'",
    ),
    "replay: --out x.csv": (("replay", "--out", "{tmp}/x.csv"), {}, 2, "expected a .jsonl or .parquet file"),
    "replay: no folder": (("replay", "--out", "{tmp}/no/such/x.jsonl"), {}, 2, "no folder"),
    "replay: --out a folder": (("replay", "--out", "{tmp}"), {}, 2, "is a folder"),
    "replay: --out where no file can be made": (("replay", "--out", "/proc/x.jsonl"), {}, 2, "cannot write it"),
    "replay: unknown adapter": (("replay", "-o", "{tmp}/x.jsonl", "-a", "nosuch"), {}, 2, "unknown adapter 'nosuch'"),
    "replay: adapter module missing": (
        ("replay", "-o", "{tmp}/x.jsonl", "-a", "nosuchmod:fn"),
        {},
        2,
        "No module named 'nosuchmod'",
    ),
    "replay: --since yesterday": (
        ("replay", "-o", "{tmp}/x.jsonl", "--since", "yesterday"),
        {},
        2,
        "neither a log position",
    ),
    "replay: --since \u00b2": (("replay", "-o", "{tmp}/x.jsonl", "--since", "\u00b2"), {}, 2, "neither a log position"),
    "replay: --status typo": (
        ("replay", "-o", "{tmp}/x.jsonl", "--status", "succeded"),
        {},
        2,
        "Invalid value for '--status': Value error, 'succeded' is not one of",
    ),
    "replay: --mode typo": (("replay", "-o", "{tmp}/x.jsonl", "--mode", "training"), {}, 2, "'training' is not one of"),
    "replay: --min-reward abc": (("replay", "-o", "{tmp}/x.jsonl", "--min-reward", "abc"), {}, 2, "valid number"),
    "replay: --swap alone": (("replay", "--swap"), {}, 2, "--swap goes with --rebuild"),
    "replay: --rebuild with --out": (("replay", "--rebuild", "-o", "{tmp}/x.jsonl"), {}, 2, "drop --out"),
    "export: no --out": (("export",), {}, 2, "Missing option '--out'"),
    "export: --since -5": (("export", "-o", "{tmp}/e.jsonl", "--since", "-5"), {}, 2, "greater than or equal to 0"),
    "export: --until before --since": (
        ("export", "-o", "{tmp}/e.jsonl", "--since", "10", "--until", "5"),
        {},
        2,
        "--until 5 is before --since 10",
    ),
    "export: no folder": (("export", "-o", "{tmp}/no/such/e.jsonl"), {}, 2, "no folder"),
    "export: --out where no file can be made": (("export", "-o", "/proc/e.jsonl"), {}, 2, "cannot write it"),
    "import: no file": (("import", "{tmp}/nosuch.jsonl"), {}, 2, "no file"),
    "import: non-UTF-8 file": (("import", "{tmp}/binary.jsonl"), {}, 2, "is not an eventlight export"),
    "import: not an export": (("import", "{tmp}/other.jsonl"), {}, 2, "is not an eventlight export"),
}

DOWN: dict[str, Case] = {
    "status, NATS down": (("status",), {"EVENTLIGHT_NATS_URL": "{dead_nats}"}, 1, "cannot reach EVENTLIGHT_NATS_URL"),
    "status, every cluster URL down": (
        ("status",),
        {"EVENTLIGHT_NATS_URL": "{dead_nats},{dead_nats}"},
        1,
        "nothing answers at 127.0.0.1",
    ),
    "sql, Postgres down": (("sql", "SELECT 1"), {"EVENTLIGHT_PG_DSN": "{dead_pg}"}, 1, "postgres:***@127.0.0.1"),
    "export, NATS down": (("export", "-o", "{tmp}/e.jsonl"), {"EVENTLIGHT_NATS_URL": "{dead_nats}"}, 1, "NATS"),
    "runner, NATS down": (
        ("runner", "tests/fault_agents.py:quick"),
        {"EVENTLIGHT_NATS_URL": "{dead_nats}"},
        1,
        "cannot reach EVENTLIGHT_NATS_URL",
    ),
    "no servers at all": (
        ("status",),
        {"EVENTLIGHT_NATS_URL": "", "EVENTLIGHT_PG_DSN": "", "EVENTLIGHT_STATE_DIR": "{tmp}/empty-state"},
        1,
        "no eventlight servers are running",
    ),
    "EVENTLIGHT_NATS_URL names no server": (("status",), {"EVENTLIGHT_NATS_URL": " , "}, 2, "no NATS server in"),
    "status, NATS refuses": (  # the reason once, and no timeout claimed for a refused connection
        ("status",),
        {"EVENTLIGHT_NATS_URL": "nats://127.0.0.1:1"},
        1,
        "cannot reach EVENTLIGHT_NATS_URL nats://127.0.0.1:1: NATS is not reachable: nothing answers at 127.0.0.1:1",
    ),
    "EVENTLIGHT_NATS_URL port out of range": (
        ("status",),
        {"EVENTLIGHT_NATS_URL": "nats://127.0.0.1:99999"},
        2,
        "nats://127.0.0.1:99999 is not a NATS URL: Port out of range",
    ),
    "EVENTLIGHT_PG_DSN not a URL": (
        ("sql", "SELECT 1"),
        {"EVENTLIGHT_PG_DSN": "notadsn"},
        2,
        "must be a postgresql://",
    ),
    # said in Python's words: "invalid literal for int() with base 10: 'notaport'" (fresh-user run)
    "EVENTLIGHT_PG_DSN port not a number": (
        ("sql", "SELECT 1"),
        {"EVENTLIGHT_PG_DSN": "postgresql://u:pw@127.0.0.1:notaport/db"},
        2,
        "postgresql://u:***@127.0.0.1:notaport/db is not a Postgres DSN: its port 'notaport' is not a number",
    ),
    "EVENTLIGHT_PG_DSN port not a number, no user": (  # the port may be a password: not shown
        ("sql", "SELECT 1"),
        {"EVENTLIGHT_PG_DSN": "postgresql://127.0.0.1:notaport/db"},
        2,
        "postgresql://*** is not a Postgres DSN: its port is not a number (the address is not shown",
    ),
    # asyncpg took it and its socket call failed: "internal error: OverflowError", exit 1
    "EVENTLIGHT_PG_DSN port out of range": (
        ("sql", "SELECT 1"),
        {"EVENTLIGHT_PG_DSN": "postgresql://u:pw@127.0.0.1:99999/db"},
        2,
        "postgresql://u:***@127.0.0.1:99999/db is not a Postgres DSN: Port out of range 0-65535",
    ),
    "EVENTLIGHT_PG_DSN second host's port out of range": (
        ("status",),
        {"EVENTLIGHT_PG_DSN": "postgresql://u:pw@127.0.0.1:5432,127.0.0.1:70000/db"},
        2,
        "is not a Postgres DSN: Port out of range 0-65535",
    ),
    "EVENTLIGHT_STREAM_REPLICAS=x": (("status",), {"EVENTLIGHT_STREAM_REPLICAS": "x"}, 2, "must be a whole number"),
    # the host forgotten: the password reads as a port, which the parser's error quoted
    "EVENTLIGHT_NATS_URL nats://user:secret": (
        ("status",),
        {"EVENTLIGHT_NATS_URL": "nats://user:secret"},
        2,
        "nats://*** is not a NATS URL",
    ),
    "EVENTLIGHT_PG_DSN postgresql://user:secret/db": (
        ("sql", "SELECT 1"),
        {"EVENTLIGHT_PG_DSN": "postgresql://user:secret/db"},
        2,
        "postgresql://*** is not a Postgres DSN",
    ),
    "up, EVENTLIGHT_STATE_DIR a file": (  # was "internal error: FileExistsError", exit 1
        ("up",),
        {"EVENTLIGHT_STATE_DIR": "{tmp}/other.jsonl"},
        2,
        "other.jsonl as the state folder (EVENTLIGHT_STATE_DIR): it is a file, not a folder",
    ),
    "up, EVENTLIGHT_STATE_DIR under a file": (
        ("up",),
        {"EVENTLIGHT_STATE_DIR": "{tmp}/other.jsonl/state"},
        2,
        "state as the state folder (EVENTLIGHT_STATE_DIR): Not a directory",
    ),
    "up, EVENTLIGHT_NATS_URL without a scheme": (  # `up` named it as given, `status` hid it
        ("up",),
        {"EVENTLIGHT_NATS_URL": "user:secret@127.0.0.1:1", "EVENTLIGHT_STATE_DIR": "{tmp}/empty-state"},
        1,
        "cannot reach ***: NATS is not reachable",
    ),
}


def _fill(value: str | bytes, slots: dict[str, str]) -> str | bytes:
    return value.format(**slots) if isinstance(value, str) and "{" in value and "}" in value else value


def _run_all(
    cases: dict[str, Case], ns: Settings, tmp: Path, entry: str, table: BadInputRows, **more: str
) -> dict[str, subprocess.CompletedProcess[str]]:
    slots = {
        **more,
        "tmp": str(tmp),
        "dead_nats": f"nats://127.0.0.1:{free_port()}",
        "dead_pg": f"postgresql://postgres:secret@127.0.0.1:{free_port()}/postgres",
    }
    (tmp / "binary.jsonl").write_bytes(b"\xff\xfe\x00{not json")
    (tmp / "other.jsonl").write_text('{"some": "json"}\n')

    def one(case: Case) -> subprocess.CompletedProcess[str]:
        args, env, _, _ = case
        filled = tuple(_fill(a, slots) for a in args)
        return cli(*filled, env={**env_of(ns), **{k: str(_fill(v, slots)) for k, v in env.items()}})

    with ThreadPoolExecutor(max_workers=3) as pool:  # two shared cores: a few at a time
        results = dict(zip(cases, pool.map(one, cases.values()), strict=True))
    for name, result in results.items():
        table.append((entry, name, f"exit {result.returncode}: {result.stderr.strip()}"[:160]))
    return results


def _check(cases: dict[str, Case], results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    failed = []
    for name, (_, _, code, says) in cases.items():
        try:
            line = assert_one_line_error(results[name], code, says)
            assert "secret" not in line
        except AssertionError as e:
            failed.append(f"{name}: {e}")
    assert not failed, "\n".join(failed)


def _still_serving(ns: Settings) -> None:
    status = cli("status", env=env_of(ns))
    assert status.returncode == 0 and ns.stream_name in status.stdout, status.stderr
    count = cli("sql", "SELECT count(*) AS n FROM rollouts", "-f", "csv", env=env_of(ns))
    assert count.returncode == 0 and count.stdout.split() == ["n", "0"], count.stderr


async def test_sql_bad_inputs_are_one_line_errors(
    namespace: Settings, tmp_path: Path, bad_input_table: BadInputRows
) -> None:
    assert namespace.pg_dsn is not None
    victim = await asyncpg.connect(namespace.pg_dsn)  # a superuser's session the reader must not end
    try:
        pid = str(await victim.fetchval("SELECT pg_backend_pid()"))
        results = await asyncio.to_thread(
            _run_all, SQL, namespace, tmp_path, "eventlight sql", bad_input_table, victim=pid
        )
        assert await victim.fetchval("SELECT 1") == 1  # still alive
    finally:
        await victim.close()
    _check(SQL, results)
    _still_serving(namespace)


def test_cli_bad_arguments_are_one_line_errors(
    namespace: Settings, tmp_path: Path, bad_input_table: BadInputRows
) -> None:
    _check(CLI, _run_all(CLI, namespace, tmp_path, "eventlight CLI", bad_input_table))
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "e.jsonl").exists()  # nothing written
    _still_serving(namespace)


def test_cli_with_servers_down_names_them(namespace: Settings, tmp_path: Path, bad_input_table: BadInputRows) -> None:
    (tmp_path / "empty-state").mkdir()
    _check(DOWN, _run_all(DOWN, namespace, tmp_path, "eventlight CLI (servers down)", bad_input_table))
    _still_serving(namespace)
