"""Credentials come from the environment or files, never from code, and are never shown (issue 16 item 6).

Real servers: a nats-server of the test's own with token auth and one with user/password auth (the
bundled binary), and the session's Postgres with a DSN read from a file. Every message, ``repr``
and ``eventlight status`` output is checked for the secrets.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import gc
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.credentials import NatsAuth, read_secret
from eventlight.net import free_port
from eventlight.ops import apply_migrations, apply_streams, drop_namespace
from eventlight.ops.nats_server import _nats_binary
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats

ROOT = Path(__file__).resolve().parent.parent
NATS_TOKEN = "nats-tok-5b1e77c2"
NATS_PASSWORD = "nats-pw-a09d3f"
PG_PASSWORD = "pg-pw-77e0c1"


# -- read_secret -----------------------------------------------------------------------------------


def test_read_secret_reads_the_variable_or_its_file(tmp_path: Path) -> None:
    f = tmp_path / "s"
    f.write_text("tok\n")
    assert read_secret("X", {"X": "value"}) == "value"
    assert read_secret("X", {"X_FILE": str(f)}) == "tok"  # one trailing newline stripped
    f.write_text("tok\r\n")
    assert read_secret("X", {"X_FILE": str(f)}) == "tok"
    f.write_text(" a b ")
    assert read_secret("X", {"X_FILE": str(f)}) == " a b "  # inner and other spaces are the secret's
    assert read_secret("X", {}) is None and read_secret("X", {"X": ""}) is None


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: None, "cannot read the file (No such file or directory)"),
        (lambda p: p.mkdir(), "cannot read the file (Is a directory)"),
        (lambda p: p.write_text(""), "the file is empty"),
        (lambda p: p.write_text("\n"), "the file is empty"),
        (lambda p: p.write_bytes(b"\xff\xfe"), "the file is not UTF-8 text"),
    ],
)
def test_a_secret_file_that_cannot_be_used_names_the_variable_and_the_file(tmp_path: Path, make, why: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "secret"
    make(path)
    with pytest.raises(InvalidInputError) as info:
        read_secret("EVENTLIGHT_PG_DSN", {"EVENTLIGHT_PG_DSN_FILE": str(path)})
    assert str(info.value) == f"EVENTLIGHT_PG_DSN_FILE={path}: {why}"
    assert "\n" not in str(info.value)


def test_settings_read_every_file_variable_and_mask_them_in_repr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {
        "EVENTLIGHT_PG_DSN": f"postgresql://postgres:{PG_PASSWORD}@127.0.0.1:5432/postgres",
        "EVENTLIGHT_SERVER_TOKEN": "srv-tok-1",
        "EVENTLIGHT_PROXY_TOKEN": "proxy-tok-2",
        "EVENTLIGHT_NATS_PASSWORD": NATS_PASSWORD,
    }
    for name, value in values.items():
        monkeypatch.delenv(name, raising=False)
        (tmp_path / name).write_text(value + "\n")
        monkeypatch.setenv(f"{name}_FILE", str(tmp_path / name))
    monkeypatch.setenv("EVENTLIGHT_NATS_USER", "alice")
    monkeypatch.setenv("EVENTLIGHT_NATS_URL", f"nats://bob:{NATS_PASSWORD}@127.0.0.1:4222")
    s = Settings.from_env()
    assert s.pg_dsn == values["EVENTLIGHT_PG_DSN"]
    assert (s.server_token, s.proxy_token) == ("srv-tok-1", "proxy-tok-2")
    assert s.nats_auth.connect_kwargs() == {"user": "alice", "password": NATS_PASSWORD}
    shown = repr(s) + str(s)
    for secret in (PG_PASSWORD, NATS_PASSWORD, "srv-tok-1", "proxy-tok-2"):
        assert secret not in shown, secret
    assert "postgresql://postgres:***@127.0.0.1:5432/postgres" in shown and "user='alice'" in shown


def test_nats_credentials_that_do_not_go_together_are_refused(tmp_path: Path) -> None:
    cases = {
        "use one of": {"EVENTLIGHT_NATS_TOKEN": "t", "EVENTLIGHT_NATS_USER": "u", "EVENTLIGHT_NATS_PASSWORD": "p"},
        "go together": {"EVENTLIGHT_NATS_USER": "u"},
        "go together: set both": {"EVENTLIGHT_NATS_PASSWORD": "p"},
        f"EVENTLIGHT_NATS_CREDS={tmp_path / 'none.creds'}: cannot read": {
            "EVENTLIGHT_NATS_CREDS": str(tmp_path / "none.creds")
        },
    }
    for why, env in cases.items():
        with pytest.raises(InvalidInputError, match=re.escape(why)) as info:
            NatsAuth.from_env(env)
        assert "\n" not in str(info.value)
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n...\n")
    try:
        auth = NatsAuth.from_env({"EVENTLIGHT_NATS_CREDS": str(creds)})
    except InvalidInputError as e:  # nats-py reads .creds files with the optional nkeys package
        assert "nkeys" in str(e)
    else:
        assert auth.connect_kwargs() == {"user_credentials": str(creds)}


# -- a NATS server with auth, and Postgres from a file ---------------------------------------------


@contextlib.contextmanager
def nats_with(tmp_path: Path, authorization: str) -> Iterator[str]:
    """A nats-server of this test's own with JetStream and ``authorization { ... }``; its URL."""
    port = free_port()
    home = tmp_path / f"nats-{port}"
    home.mkdir()
    conf = home / "nats.conf"
    conf.write_text(
        f'listen: 127.0.0.1:{port}\njetstream {{ store_dir: "{home / "js"}" }}\nauthorization {{ {authorization} }}\n'
    )
    with open(home / "out", "wb") as out:
        proc = subprocess.Popen([_nats_binary(), "-c", str(conf)], stdout=out, stderr=out)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


async def wait_listening(url: str) -> None:
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    for _ in range(200):
        with contextlib.suppress(OSError):
            _, w = await asyncio.open_connection(host, int(port))
            w.close()
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"nats-server at {url} did not start")


@contextlib.asynccontextmanager
async def namespace_with(settings: Settings) -> AsyncIterator[Settings]:
    s = Settings(
        nats_url=settings.nats_url,
        pg_dsn=settings.pg_dsn,
        nats_auth=settings.nats_auth,
        namespace=f"c{uuid.uuid4().hex[:10]}",
    )
    assert s.nats_url is not None and s.pg_dsn is not None
    nc = await connect_nats(s.nats_url, auth=s.nats_auth)
    try:
        await apply_streams(nc, s)
    finally:
        await nc.close()
    await apply_migrations(s.pg_dsn, s.pg_schema)
    try:
        yield s
    finally:
        await drop_namespace(s.nats_url, s.pg_dsn, s)


async def a_rollout_round_trip(settings: Settings) -> None:
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        queued = await store.enqueue_rollout(input={"q": 1})
        claimed = await store.dequeue_rollout()
        assert claimed is not None and claimed.rollout_id == queued.rollout_id


def pg_dsn_with_password(services: tuple[Settings, object]) -> str:
    """The session's Postgres DSN with a password added (ignored by trust auth, kept by ours)."""
    dsn = str(services[1].pg_dsn)  # type: ignore[attr-defined]
    if not dsn.startswith("postgresql://") or "@" not in dsn or ":" in dsn.split("://", 1)[1].split("@", 1)[0]:
        pytest.skip("needs a URL DSN with a user and no password (EVENTLIGHT_PG_DSN=postgresql://user@host/db)")
    scheme, rest = dsn.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{PG_PASSWORD}@{host}"


async def test_nats_token_from_a_file_and_pg_dsn_from_a_file_run_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: tuple[Settings, object]
) -> None:
    with nats_with(tmp_path, f'token: "{NATS_TOKEN}"') as url:
        await wait_listening(url)
        (tmp_path / "nats_token").write_text(NATS_TOKEN + "\n")
        (tmp_path / "pg_dsn").write_text(pg_dsn_with_password(services) + "\n")
        monkeypatch.setenv("EVENTLIGHT_NATS_URL", url)
        monkeypatch.setenv("EVENTLIGHT_NATS_TOKEN_FILE", str(tmp_path / "nats_token"))
        monkeypatch.delenv("EVENTLIGHT_PG_DSN", raising=False)
        monkeypatch.setenv("EVENTLIGHT_PG_DSN_FILE", str(tmp_path / "pg_dsn"))
        settings = Settings.from_env()
        assert settings.pg_dsn is not None and PG_PASSWORD in settings.pg_dsn
        async with namespace_with(settings) as ns:
            await a_rollout_round_trip(ns)
            status = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "eventlight.cli", "status", "-N", ns.namespace],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
                env={**os.environ, "COLUMNS": "200"},
            )
        for refused in (NatsAuth(), NatsAuth(token="not-the-token")):
            with pytest.raises(ServiceUnavailableError) as info:
                await connect_nats(url, auth=refused, reconnect=False, quiet=True)
            assert "Authorization Violation" in str(info.value) and NATS_TOKEN not in str(info.value)
        with pytest.raises(ServiceUnavailableError) as in_url:  # a token in the URL is masked
            await connect_nats(f"nats://wrong-{NATS_TOKEN}@{url.removeprefix('nats://')}", reconnect=False, quiet=True)
        assert NATS_TOKEN not in str(in_url.value) and "nats://***@127.0.0.1" in str(in_url.value)
    out = status.stdout + status.stderr
    assert status.returncode == 0, out
    assert "postgresql://" in out and ":***@" in out, out
    for secret in (PG_PASSWORD, NATS_TOKEN):
        assert secret not in out, secret


async def test_nats_user_and_password_from_the_environment_or_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services: tuple[Settings, object]
) -> None:
    pg = str(services[1].pg_dsn)  # type: ignore[attr-defined]
    with nats_with(tmp_path, f'user: "alice", password: "{NATS_PASSWORD}"') as url:
        await wait_listening(url)
        (tmp_path / "pw").write_text(NATS_PASSWORD)
        monkeypatch.setenv("EVENTLIGHT_NATS_URL", url)
        monkeypatch.setenv("EVENTLIGHT_NATS_USER", "alice")
        monkeypatch.setenv("EVENTLIGHT_NATS_PASSWORD_FILE", str(tmp_path / "pw"))
        settings = Settings.from_env(pg_dsn=pg)
        async with namespace_with(settings) as ns:
            await a_rollout_round_trip(ns)
        in_url = f"nats://alice:{NATS_PASSWORD}@{url.removeprefix('nats://')}"
        async with namespace_with(Settings(nats_url=in_url, pg_dsn=pg)) as ns:
            await a_rollout_round_trip(ns)
        wrong = NatsAuth(user="alice", password="wrong-pw-0e1")
        with pytest.raises(ServiceUnavailableError) as info:
            await connect_nats(url, auth=wrong, reconnect=False, quiet=True)
        assert "Authorization Violation" in str(info.value) and "wrong-pw-0e1" not in str(info.value)
        with pytest.raises(ServiceUnavailableError) as info:
            await connect_nats(in_url.replace(NATS_PASSWORD, "wrong-pw-0e1"), reconnect=False, quiet=True)
        assert "wrong-pw-0e1" not in str(info.value) and "nats://alice:***@" in str(info.value)


async def test_a_postgres_error_never_shows_the_password() -> None:
    port = free_port()
    dsn = f"postgresql://postgres:{PG_PASSWORD}@127.0.0.1:{port}/postgres"
    with pytest.raises(ServiceUnavailableError) as info:
        await apply_migrations(dsn, "el_never_created")
    assert PG_PASSWORD not in str(info.value) and "postgres:***@" in str(info.value)


# -- no credential literal in the package ------------------------------------------------------------

_KEYS = r"password|passwd|pwd|secret|token|api_key|apikey"
CREDENTIAL_PATTERNS = [
    re.compile(rf"(?i)\b(?:{_KEYS})\s*=\s*['\"]?(?P<v>[^\s'\"&,;)`]{{3,}})"),  # password=hunter2
    re.compile(r"(?i)\b[a-z][\w+.-]*://[^/\s:@'\"]+:(?P<v>[^@\s/'\"]{3,})@"),  # scheme://user:pass@host
]
CREDENTIAL_KEYWORDS = re.compile(rf"(?i)^({_KEYS}|user_credentials)$")
PLACEHOLDERS = {"pass", "password", "secret", "token", "local", "dummy", "empty"}
"""Values that hold no secret: the words docs use for one, and the key a local server ignores (vLLM's
docs write ``EMPTY``)."""


def _secret(value: str) -> bool:
    return value.lower() not in PLACEHOLDERS and not value.startswith(("*", "<", "{", "$", "%"))


def credential_literals(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` writes a credential as a literal: in a string (``password=x``, ``user:pw@``),
    as a keyword argument (``token="x"``) or as a dict entry (``{"password": "x"}``)."""
    # the collector off: CPython 3.11's ast.parse fails with "AST constructor recursion depth mismatch"
    # when a collection inside it runs finalizers (here: the earlier tests' asyncio objects)
    gc.collect()
    gc.disable()
    try:
        tree = ast.parse(source, filename)
    finally:
        gc.enable()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if any(_secret(m["v"]) for p in CREDENTIAL_PATTERNS for m in p.finditer(node.value)):
                found.append(f"{filename}:{node.lineno}: {node.value[:60]!r}")
        pairs: list[tuple[str | None, ast.expr]] = []
        if isinstance(node, ast.Call):
            pairs += [(k.arg, k.value) for k in node.keywords]
        if isinstance(node, ast.Dict):
            pairs += [
                (k.value, v)
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            ]
        for key, value in pairs:
            if not (key and CREDENTIAL_KEYWORDS.match(key)):
                continue
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and _secret(value.value):
                found.append(f"{filename}:{value.lineno}: {key}={value.value!r}")
    return found


def test_the_credential_scanner_finds_literals() -> None:
    planted = """
dsn = "postgresql://app:hunter22@db:5432/app"
conn = connect(host="db", password="hunter22")
nats = {"token": "s3cr3t-tok"}
kv = "host=db password=hunter22"
ok = ["postgresql://app:***@db/app", "password=***", "nats://127.0.0.1:4222", "{token}", "nats://u:pass@h"]
fine = connect(token=token, password=os.environ["PW"], api_key="local")
url = f"nats://{user}:{password}@host"
"""
    found = credential_literals(planted)
    assert [f.split(":", 2)[1] for f in found] == ["2", "3", "4", "5"], found


def test_no_credential_literal_in_the_package() -> None:
    files = sorted((ROOT / "eventlight").rglob("*.py"))
    assert len(files) > 100  # the package, not an empty folder
    found = [f for path in files for f in credential_literals(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert found == [], found


def test_a_configured_value_that_is_not_a_url_is_never_printed() -> None:
    """A password-only file or a DSN without a scheme cannot be parsed for its secret: the value and
    its parts are hidden wherever an error message repeats them (found by a fresh user)."""
    from eventlight.net import redact_configured

    for value, text in (
        ("Hunter2Secret", "EVENTLIGHT_PG_DSN Hunter2Secret: invalid DSN"),
        ("postgres:Hunter2Secret@localhost", 'database "Hunter2Secret@localhost" does not exist'),
        ("Hunter2Secret", "nothing answers at hunter2secret:4222"),
    ):
        shown = redact_configured(value, text)
        assert "hunter2secret" not in shown.lower() and "***" in shown, shown
    url = "postgresql://app:Hunter2Secret@db:5432/app"
    assert redact_configured(url, f"cannot reach {url}") == "cannot reach postgresql://app:***@db:5432/app"
