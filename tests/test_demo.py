"""``examples/demo.py`` (what ``make demo`` runs): GRPO by default, APO one flag away with its failure behaviour."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from eventlight.net import free_port as closed_port
from eventlight.ops import drop_namespace
from eventlight.settings import Settings

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def run_main_job(services: Any, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``examples/demo.py`` with one runner in a namespace of its own on the session's servers."""
    settings, svc = services
    namespace = f"demo_{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "EVENTLIGHT_NATS_URL": svc.nats_url,
        "EVENTLIGHT_PG_DSN": svc.pg_dsn,
        "EVENTLIGHT_NAMESPACE": namespace,
        "EVENTLIGHT_STATE_DIR": str(settings.state_dir),
    }
    cmd = [sys.executable, str(DEMO), "--n-runners", "1", *args]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=DEMO.parents[1])
    finally:
        asyncio.run(drop_namespace(svc.nats_url, svc.pg_dsn, Settings(namespace=namespace)))


@pytest.mark.e2e
def test_algorithm_apo_runs_the_apo_demo_and_keeps_its_llm_check(services: Any) -> None:
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    done = run_main_job(services, "--algorithm", "apo", "--base-url", dead, "--model", "m", "--tasks", "4")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "LLM unavailable" in errors[0] and dead in errors[0], done.stderr
    assert "val reward, initial prompt" not in done.stdout and "Traceback" not in done.stderr
