"""The built wheel works outside the checkout: streams/ and migrations/ ship as package data.

Builds the wheel (``pip wheel --no-deps .``), installs it with ``-c constraints.txt`` into a fresh
venv in a temporary folder, and from that folder (not the checkout) runs ``eventlight up``, a store
round trip (enqueue, dequeue, update_attempt, wait_for_rollouts), ``eventlight sql`` and
``eventlight down``. The embedded nats-server is the one the new venv installed; Postgres is the
test session's. Skipped, with the reason, only when pip can reach neither an index nor a local
source of packages.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from eventlight.ops import Services, drop_namespace
from eventlight.settings import Settings

ROOT = Path(__file__).resolve().parent.parent

ROUND_TRIP = """
import asyncio, sys
import eventlight as agl

assert "{root}" not in agl.__file__, agl.__file__  # the installed copy, not the checkout


async def main() -> None:
    settings = agl.Settings.from_env()
    services = await agl.prepare_services(settings)
    async with agl.JetStreamLightningStore(settings, nats_url=services.nats_url, pg_dsn=services.pg_dsn) as store:
        rollout = await store.enqueue_rollout(input={{"question": "2 + 2?"}})
        claimed = await store.dequeue_rollout(worker_id="wheel-worker")
        assert claimed is not None and claimed.rollout_id == rollout.rollout_id
        await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
        [done] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=30)
        assert done.status == "succeeded", done.status
        print(done.rollout_id)


asyncio.run(main())
"""


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme == "file":
        return Path(parts.path).is_dir() and any(Path(parts.path).iterdir())
    try:
        with socket.create_connection((parts.hostname or "", parts.port or 443), timeout=3):
            return True
    except OSError:
        return False


def _package_source() -> str | None:
    """Why pip can get packages (a reachable index, local links or a non-empty cache), else ``None``."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    indexes = ["https://pypi.org/simple"]
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(("index-url", "find-links")):
            indexes += [v.strip("'\" ") for v in value.strip("'\"").split()]
    for url in indexes:
        if _reachable(url if "://" in url else f"file://{url}"):
            return url
    cache = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if cache and Path(cache).is_dir() and any(Path(cache).rglob("*")):
        return f"pip cache {cache}"
    return None


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 300) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(900)
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path, services: tuple[Settings, Services]) -> None:
    if (source := _package_source()) is None:
        pytest.skip("no package index reachable and no pip cache: cannot install the wheel's dependencies")
    _, svc = services
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EVENTLIGHT_", "VIRTUAL_ENV", "PYTHON"))}
    namespace = f"wheel{uuid.uuid4().hex[:8]}"
    env.update(
        EVENTLIGHT_PG_DSN=svc.pg_dsn,
        EVENTLIGHT_STATE_DIR=str(tmp_path / "state"),
        EVENTLIGHT_NAMESPACE=namespace,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)], tmp_path, env)
    [wheel] = wheels.glob("eventlight-*.whl")
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    py, cli = str(venv / "bin" / "python"), str(venv / "bin" / "eventlight")
    _run([py, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheel)], tmp_path, env, 600)
    try:
        _run([cli, "up"], tmp_path, env)
        rollout_id = _run([py, "-c", ROUND_TRIP.format(root=ROOT)], tmp_path, env).strip().splitlines()[-1]
        table = _run([cli, "sql", "SELECT rollout_id, status FROM rollouts", "--format", "csv"], tmp_path, env)
        assert f"{rollout_id},succeeded" in table, f"{source}: {table}"
    finally:
        _run([cli, "down"], tmp_path, env)
        import asyncio

        asyncio.run(drop_namespace(None, svc.pg_dsn, Settings(namespace=namespace)))
