"""`eventlight sql` is not a sandbox escape: queries run as the namespace's read-only role with a statement
timeout, and read no other namespace."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.parse
from typing import Any

import asyncpg
import pytest
from conftest import fresh_namespace
from test_cli import ENV_VARS, ROOT, assert_one_line_error, cli, env_of

from eventlight.settings import Settings
from eventlight.sql_reader import MAX_ROLE_BYTES, ensure_reader, reader_dsn, reader_role


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("COPY (SELECT 1) TO PROGRAM 'touch /eventlight-pwned'", "pg_execute_server_program"),
        ("SELECT pg_read_file('/etc/passwd')", "permission denied"),
        ("SELECT lo_import('/etc/passwd')", "permission denied"),
        ("SELECT set_config('role', 'postgres', false), pg_read_file('/etc/hostname')", "permission denied"),
        ("SELECT count(*) FROM pg_authid", "permission denied"),
        ("CREATE TABLE t (x int)", "read-only"),
    ],
)
def test_dangerous_statements_are_refused_in_one_line(namespace: Settings, query: str, says: str) -> None:
    line = assert_one_line_error(cli("sql", query, env=env_of(namespace)), 2, "SQL error")
    assert says in line


async def test_other_sessions_cannot_be_terminated(namespace: Settings) -> None:
    assert namespace.pg_dsn is not None
    victim = await asyncpg.connect(namespace.pg_dsn)
    try:
        pid = await victim.fetchval("SELECT pg_backend_pid()")
        result = cli("sql", f"SELECT pg_terminate_backend({pid})", env=env_of(namespace))
        assert_one_line_error(result, 2, "SQL error", "must be a superuser")
        assert await victim.fetchval("SELECT 1") == 1  # still alive
    finally:
        await victim.close()


def test_a_long_query_is_cancelled_at_the_timeout(namespace: Settings) -> None:
    result = cli("sql", "SELECT pg_sleep(20)", "--timeout-s", "0.5", env=env_of(namespace))
    assert_one_line_error(result, 2, "longer than --timeout-s 0.5 s")


def test_the_reader_sees_the_projections(namespace: Settings) -> None:
    result = cli("sql", "SELECT count(*) AS n FROM rollouts", "--format", "json", env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '{"n":0}' or result.stdout.strip() == '{"n": 0}'
    who = cli("sql", "SELECT current_user AS u, session_user AS s", "--format", "csv", env=env_of(namespace))
    role = reader_role(namespace.pg_schema)
    assert who.stdout.strip().splitlines()[-1] == f"{role},{role}"


async def test_another_namespaces_tables_are_refused(namespace: Settings, services: tuple[Settings, Any]) -> None:
    async with fresh_namespace(services) as other:
        for query in (f"SELECT * FROM {other.pg_schema}.rollouts", f"SELECT * FROM {other.pg_schema}.v_rollouts"):
            result = cli("sql", query, env=env_of(namespace))
            assert_one_line_error(result, 2, "SQL error", "permission denied", other.pg_schema)
        own = cli(
            "sql", f"SELECT count(*) AS n FROM {namespace.pg_schema}.v_rollouts", "-f", "csv", env=env_of(namespace)
        )
        assert own.returncode == 0 and own.stdout.split() == ["n", "0"], own.stderr


async def test_the_namespace_reader_role_is_dropped_with_the_namespace(services: tuple[Settings, Any]) -> None:
    async with fresh_namespace(services) as ns:
        assert cli("sql", "SELECT 1", env=env_of(ns)).returncode == 0
        role = reader_role(ns.pg_schema)
        assert await _role_exists(ns, role)
    assert not await _role_exists(ns, role)


async def test_the_reader_loses_usage_granted_on_another_schema(
    namespace: Settings, services: tuple[Settings, Any]
) -> None:
    assert namespace.pg_dsn is not None
    owner = await asyncpg.connect(namespace.pg_dsn)
    try:
        async with fresh_namespace(services) as other:
            role = await ensure_reader(owner, namespace.pg_schema)
            await owner.execute(f'GRANT USAGE ON SCHEMA "{other.pg_schema}" TO "{role}"')  # say, a swapped-out rebuild
            await ensure_reader(owner, namespace.pg_schema)
            assert not await owner.fetchval("SELECT has_schema_privilege($1, $2, 'USAGE')", role, other.pg_schema)
            assert await owner.fetchval("SELECT has_schema_privilege($1, $2, 'USAGE')", role, namespace.pg_schema)
    finally:
        await owner.close()


async def test_a_role_of_the_readers_name_with_more_powers_is_not_used(namespace: Settings) -> None:
    assert namespace.pg_dsn is not None
    role = reader_role(namespace.pg_schema)
    owner = await asyncpg.connect(namespace.pg_dsn)
    try:
        await owner.execute(f'CREATE ROLE "{role}" LOGIN CREATEDB')
        assert_one_line_error(cli("sql", "SELECT 1", env=env_of(namespace)), 2, f"role {role} exists with more powers")
    finally:
        await owner.execute(f'DROP ROLE IF EXISTS "{role}"')
        await owner.close()


async def _role_exists(ns: Settings, role: str) -> bool:
    assert ns.pg_dsn is not None
    conn = await asyncpg.connect(ns.pg_dsn)
    try:
        return bool(await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role))
    finally:
        await conn.close()


def test_reader_role_names_fit_postgres_and_stay_apart() -> None:
    assert reader_role("el_default") == "el_default_reader"
    long_a, long_b = "el_" + "a" * 60 + "x", "el_" + "a" * 60 + "y"
    assert len(reader_role(long_a).encode()) <= MAX_ROLE_BYTES
    assert reader_role(long_a) != reader_role(long_b)
    assert reader_role(long_a) == reader_role(long_a)


def test_reader_dsn_keeps_host_and_database() -> None:
    assert reader_dsn("postgresql://admin:secret@db.example:6543/app?sslmode=require", "el_x_reader") == (
        "postgresql://el_x_reader@db.example:6543/app?sslmode=require"
    )
    assert (
        reader_dsn("postgresql:///postgres?host=/run/pg", "el_x_reader", "pw")
        == "postgresql://el_x_reader:pw@/postgres?host=/run/pg"
    )
    with pytest.raises(ValueError):
        reader_dsn("mysql://x@y/z", "el_x_reader")


async def test_the_shared_reader_of_migration_005_reads_nothing_of_a_namespace(namespace: Settings) -> None:
    assert namespace.pg_dsn is not None
    conn = await asyncpg.connect(namespace.pg_dsn)
    try:
        schema = namespace.pg_schema
        assert await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = 'eventlight_reader'")  # 005 made it
        assert not await conn.fetchval("SELECT has_schema_privilege('eventlight_reader', $1, 'USAGE')", schema)
        assert not await conn.fetchval(
            "SELECT has_table_privilege('eventlight_reader', format('%I.rollouts', $1::text), 'SELECT')", schema
        )
        default_acl = await conn.fetchval(
            "SELECT count(*) FROM pg_default_acl d JOIN pg_namespace n ON n.oid = d.defaclnamespace,"
            " aclexplode(d.defaclacl) a WHERE n.nspname = $1 AND a.grantee = 'eventlight_reader'::regrole",
            schema,
        )
        assert default_acl == 0  # tables added later are not granted to it either
    finally:
        await conn.close()


@pytest.mark.parametrize("timeout", ["inf", "1e7", "nan"])
def test_a_timeout_postgres_cannot_take_is_a_usage_error(namespace: Settings, timeout: str) -> None:
    """Before: ``inf`` was an OverflowError and ``1e7`` Postgres' ``statement_timeout`` error, both
    "internal error", exit 1 (a reviewer)."""
    result = cli("sql", "SELECT 1", "--timeout-s", timeout, env=env_of(namespace))
    assert result.returncode == 2, result.stderr
    assert "--timeout-s" in result.stderr and "internal error" not in result.stderr


@pytest.mark.parametrize(
    "query",
    [
        "copy rollouts TO STDOUT",
        "/* a /* nested */ note */ -- and a line\n COPY (select 1) TO stdout",
        "COPY (select 1) TO/**/STDOUT",
        "COPY (select 1) TO -- c\n STDOUT",
        ";COPY (select 1) TO STDOUT",
    ],
)
def test_copy_is_refused_not_answered_with_nothing(namespace: Settings, query: str) -> None:
    assert_one_line_error(cli("sql", query, env=env_of(namespace)), 2, "is not run here")


def test_a_query_cancelled_by_itself_is_not_called_a_timeout(namespace: Settings) -> None:
    result = cli("sql", "SELECT pg_cancel_backend(pg_backend_pid()), pg_sleep(2)", env=env_of(namespace))
    line = assert_one_line_error(result, 2, "SQL error", "user request")
    assert "--timeout-s" not in line


def test_the_table_shows_values_as_text_never_as_markup(namespace: Settings) -> None:
    """A prompt holding ``[/INST]`` crashed the table (Rich's MarkupError), and ``[bold]x[/bold]``
    lost its brackets (a second reviewer)."""
    value = "[INST] hi [/INST] [bold]x[/bold]"
    query = "SELECT $1 AS \"[/x]\", ARRAY[now()] AS times, 'NaN'::numeric AS start_time"
    result = cli("sql", query, "--param", value, env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert value in result.stdout and "[/x]" in result.stdout and "+00:00" in result.stdout and "NaN" in result.stdout
    csv = cli("sql", "SELECT ARRAY['NaN'::float8, 1.5] AS a, ROW(1, 'x') AS r", "-f", "csv", env=env_of(namespace))
    assert csv.stdout.splitlines()[1] == '"[""NaN"",1.5]","[1,""x""]"', csv.stdout


def test_a_query_that_ends_its_own_session_is_a_sql_error(namespace: Settings) -> None:
    result = cli("sql", "SELECT pg_terminate_backend(pg_backend_pid())", env=env_of(namespace))
    assert_one_line_error(result, 2, "SQL error", "connection to Postgres closed")


def test_json_lines_are_strict_json_and_keep_every_column(namespace: Settings) -> None:
    query = (
        "SELECT 'NaN'::float8 AS f, '-Infinity'::float8 AS g, ARRAY['Infinity'::float8, 1.5] AS h,"
        " 'infinity'::timestamptz AS t, '-infinity'::date AS d, 1 AS a, 2 AS a, 3 AS a_2,"
        " ROW(1, 'NaN'::float8) AS rec, ARRAY[ROW('-Infinity'::float8)] AS ra"
    )
    result = cli("sql", query, "--format", "json", env=env_of(namespace))
    assert result.returncode == 0, result.stderr

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    row = json.loads(result.stdout, parse_constant=no_constants)
    assert row.pop("rec") == [1, "NaN"] and row.pop("ra") == [["-Infinity"]]
    assert row == {
        "f": "NaN",
        "g": "-Infinity",
        "h": ["Infinity", 1.5],
        "t": "infinity",
        "d": "-infinity",
        "a": 1,
        "a_3": 2,
        "a_2": 3,
    }


@pytest.mark.parametrize(("fmt", "before_the_rows"), [("csv", 1), ("json", 0)])
async def test_csv_and_json_print_rows_as_they_are_fetched(namespace: Settings, fmt: str, before_the_rows: int) -> None:
    """A result larger than memory streams: csv and json printed nothing until the whole result
    was held, as Python objects and then as one string (a million rows of 100 bytes: 550-840 MB;
    a reviewer). Now the first 1,000 rows are out while Postgres still computes row 1,500."""
    assert namespace.pg_dsn is not None
    query = "SELECT g, pg_sleep(CASE WHEN g = 1500 THEN 25 ELSE 0 END)::text AS s FROM generate_series(1, 2000) g"
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    command = [sys.executable, "-m", "eventlight.cli", "sql", query, "--format", fmt, "--timeout-s", "30"]
    owner = await asyncpg.connect(namespace.pg_dsn)
    proc = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env={**base, **env_of(namespace)}
    )
    try:
        assert proc.stdout is not None
        lines = [(await proc.stdout.readline()).decode() for _ in range(before_the_rows + 1000)]
        sleeping = await owner.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE $1", f"%{query}%"
        )
        assert sleeping == 1  # Postgres is still at row 1,500
        rows = lines[before_the_rows:]
        first = rows[0].strip() if fmt == "csv" else json.loads(rows[0])
        last = rows[-1].strip() if fmt == "csv" else json.loads(rows[-1])
        assert (first, last) == (("1,", "1000,") if fmt == "csv" else ({"g": 1, "s": ""}, {"g": 1000, "s": ""}))
    finally:
        proc.kill()
        await proc.wait()
        try:  # the sleeping backend notices its client gone only when it writes
            await owner.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE query LIKE '%generate_series(1, 2000)%' AND pid <> pg_backend_pid()"
            )
        finally:
            await owner.close()


@pytest.mark.parametrize(
    ("part", "says"), [("user", 'role "eventlight_no_such_role"'), ("db", 'database "no_such_db"')]
)
def test_a_postgres_that_refuses_the_role_or_database_is_not_called_down(
    namespace: Settings, part: str, says: str
) -> None:
    """A DSN naming a role or database the server does not have read "Postgres did not answer (role
    ... does not exist)", as if the server were down (a reviewer)."""
    assert namespace.pg_dsn is not None
    url = urllib.parse.urlsplit(namespace.pg_dsn)
    if part == "user":
        url = url._replace(netloc=f"eventlight_no_such_role@{url.hostname}:{url.port}")
    else:
        url = url._replace(path="/no_such_db")
    env = {**env_of(namespace), "EVENTLIGHT_PG_DSN": urllib.parse.urlunsplit(url)}
    line = assert_one_line_error(cli("sql", "SELECT 1", env=env), 1, "Postgres refused the connection", says)
    assert "did not answer" not in line
