"""Run a demo script as a user would, in a namespace of its own on the test session's servers."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from eventlight.ops import drop_namespace
from eventlight.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def run_script(services: Any, script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT --n-runners 1 ARGS`` with the session's NATS and Postgres, a namespace and a state
    folder of its own (the script records the servers it used there: never over the session's record);
    both are dropped after."""
    _, svc = services
    namespace = f"demo_{uuid.uuid4().hex[:8]}"
    state = tempfile.mkdtemp(prefix="eventlight-demo-")
    env = {
        **os.environ,
        "EVENTLIGHT_NATS_URL": svc.nats_url,
        "EVENTLIGHT_PG_DSN": svc.pg_dsn,
        "EVENTLIGHT_NAMESPACE": namespace,
        "EVENTLIGHT_STATE_DIR": state,
    }
    cmd = [sys.executable, str(script), "--n-runners", "1", *args]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    finally:
        asyncio.run(drop_namespace(svc.nats_url, svc.pg_dsn, Settings(namespace=namespace)))
        shutil.rmtree(state, ignore_errors=True)
