"""The peer's virtual environment: Agent-lightning 0.3.0 with its release-day pins, in ``bench/.peer-venv``.

Created on first use with ``python -m venv`` and ``pip install -r <requirements>`` (default
``bench/agentlightning-0.3.0.requirements.txt`` beside this file, or ``$BENCH_PEER_REQUIREMENTS``), and
checked every time: ``agentlightning`` must import as 0.3.0 and ``opentelemetry-sdk`` must be the
pinned version (an unpinned OpenTelemetry makes the peer's runners lose every span and reward, see
the peer's README). A marker file holds the hash of the requirements it was built from, so a changed
file rebuilds the venv.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
VENV = BENCH_DIR / ".peer-venv"
MARKER = VENV / ".bench-requirements.sha256"
DEFAULT_REQUIREMENTS = BENCH_DIR / "agentlightning-0.3.0.requirements.txt"
EXPECTED_VERSION = "0.3.0"
INSTALL_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Peer:
    """A usable peer venv (``python`` set) or why there is none (``error``)."""

    python: Path | None
    error: str | None = None
    detail: str = ""


def requirements_path() -> Path:
    return Path(os.environ.get("BENCH_PEER_REQUIREMENTS", str(DEFAULT_REQUIREMENTS)))


def peer_env() -> dict[str, str]:
    """Environment for the peer's processes (the repo root on the path, LiteLLM's offline cost map)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR.parent), env.get("PYTHONPATH", "")) if p)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env.pop("VIRTUAL_ENV", None)
    return env


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pinned_otel(reqs: Path) -> str | None:
    m = re.search(r"^opentelemetry-sdk==([^\s#]+)", reqs.read_text(), re.MULTILINE)
    return m.group(1) if m else None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _check(python: Path, reqs: Path) -> str | None:
    code = (
        "import agentlightning, opentelemetry.sdk.version as o; "
        "from importlib.metadata import version; print(version('agentlightning'), o.__version__)"
    )
    try:
        out = subprocess.run(
            [str(python), "-c", code], env=peer_env(), capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired:
        return "importing agentlightning took more than 300 s"
    if out.returncode != 0:
        return f"agentlightning does not import: {_tail(out.stderr, 5)}"
    agl_version, otel_version = out.stdout.split()[-2:]
    if agl_version != EXPECTED_VERSION:
        return f"agentlightning {agl_version} installed, expected {EXPECTED_VERSION}"
    pinned = _pinned_otel(reqs)
    if pinned and otel_version != pinned:
        return f"opentelemetry-sdk {otel_version} installed, the pin is {pinned} (its runners would lose rewards)"
    return None


def ensure_peer(log: Callable[[str], None] = print) -> Peer:
    """Create or reuse ``bench/.peer-venv``; never raises (a failure is in ``Peer.error``)."""
    reqs = requirements_path()
    if not reqs.is_file():
        return Peer(None, f"peer requirements file not found: {reqs}")
    python = VENV / "bin" / "python"
    if python.exists() and MARKER.exists() and MARKER.read_text().strip() == _sha(reqs):
        why = _check(python, reqs)
        return Peer(python if why is None else None, why, "reused")
    log(f"creating the peer venv {VENV} from {reqs} (a few minutes, once)")
    shutil.rmtree(VENV, ignore_errors=True)
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [str(python), "-m", "pip", "install", "--quiet", "-r", str(reqs)],
    ]
    for argv in steps:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return Peer(None, f"`{' '.join(argv[-3:])}` took more than {INSTALL_TIMEOUT_S} s")
        if out.returncode != 0:
            return Peer(None, f"`{' '.join(argv[-3:])}` failed (rc {out.returncode}): {_tail(out.stderr)}")
    why = _check(python, reqs)
    if why is None:
        MARKER.write_text(_sha(reqs))
    return Peer(python if why is None else None, why, "installed")
