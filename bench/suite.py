"""Run the whole comparison: ceiling, micro benchmarks and scenarios, each stack in its own process.

``run_suite`` is what ``eventlight bench`` calls. Order: the peer's venv (created on first use),
the ceiling probe, the micro benchmarks (eventlight, then the peer), then each scenario on
eventlight and right after it on the peer, so both see the same machine at nearly the same time.
Every measurement is a subprocess: eventlight's in this interpreter's venv, the peer's in
``bench/.peer-venv``; the stacks never share a process. Output goes to ``out_dir``: one JSON per
run, ``logs/``, and from ``bench.report`` ``results.json``, ``table.md`` and ``chart.png``.
A peer that cannot be installed, or a run that fails, becomes a failed entry with its reason.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bench_durability
from bench import peer as peer_venv
from bench.workload import SCENARIOS

REPO = Path(__file__).resolve().parent.parent
EVENTLIGHT = "eventlight"
PEER = "agentlightning"
STARTUP_SLACK_S = 420.0


@dataclass
class SuiteConfig:
    """What to run.

    Attributes:
        scenarios: Names from ``SCENARIOS`` and/or ``"micro"``.
        vs: ``"agentlightning"`` to run the peer too, else ``None``.
        scale: Factor on every scenario's task count.
        out_dir: Where results go.
        seed: Workload seed (both stacks).
        micro_seconds: Seconds per micro operation.
        timeout_s: Limit of each scenario's measured part.
        ceiling: Run the ceiling probe.
    """

    scenarios: list[str]
    vs: str | None
    scale: float
    out_dir: Path
    seed: int = 1
    micro_seconds: float = 3.0
    timeout_s: float = 300.0
    ceiling: bool = True
    log: Callable[[str], None] = field(default=print)


def _env(stack: str, cfg: SuiteConfig) -> dict[str, str]:
    return peer_venv.peer_env()


def _run(argv: list[str], out: Path, log_path: Path, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run one measurement process; its JSON, or a failed entry saying why there is none."""
    t0 = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as logf:
        try:
            proc = subprocess.run(
                argv, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            )
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = round(time.perf_counter() - t0, 1)
    if out.exists():
        data = json.loads(out.read_text())
        data["process_wall_s"] = wall
        return data
    tail = "\n".join(log_path.read_text(errors="replace").strip().splitlines()[-12:])
    why = f"no result after {timeout_s:.0f} s" if rc is None else f"exited with {rc} and no result"
    return {"ok": False, "error": f"{why}; log {log_path}: {tail}", "process_wall_s": wall}


def _failed(stack: str, why: str) -> dict[str, Any]:
    return {"stack": stack, "ok": False, "error": why}


def run_suite(cfg: SuiteConfig) -> dict[str, Any]:
    """Run everything ``cfg`` asks for; returns the combined results (also written by the report)."""
    from bench import report

    t0 = time.perf_counter()
    unknown = [s for s in cfg.scenarios if s != "micro" and s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)} or 'micro'")
    if cfg.vs not in (None, PEER):
        raise ValueError(f"--vs {cfg.vs!r}: only {PEER!r} is supported")
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "scale": cfg.scale,
            "seed": cfg.seed,
            "vs": cfg.vs,
            "scenarios": cfg.scenarios,
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_at_start": list(os.getloadavg()),
            "durability": bench_durability(),
            "runners_per_process": os.environ.get("BENCH_RUNNERS_PER_PROCESS") or "one process per core",
        },
        "ceiling": None,
        "micro": {},
        "scenarios": {},
    }
    stacks: dict[str, Path | None] = {EVENTLIGHT: Path(sys.executable)}
    peer_error = None
    if cfg.vs == PEER:
        cfg.log("checking the peer venv (bench/.peer-venv)")
        got = peer_venv.ensure_peer(cfg.log)
        stacks[PEER] = got.python
        peer_error = got.error and f"peer unavailable: {got.error}"
        results["meta"]["peer"] = {"venv": str(peer_venv.VENV), "error": got.error, "how": got.detail}
        if peer_error:
            cfg.log(peer_error)
    logs = cfg.out_dir / "logs"

    if cfg.ceiling:
        cfg.log("ceiling: raw JetStream publish/consume + Postgres COPY")
        out = cfg.out_dir / "ceiling.json"
        argv = [sys.executable, "-m", "bench.ceiling", "--out", str(out)]
        results["ceiling"] = _run(argv, out, logs / "ceiling.log", _env(EVENTLIGHT, cfg), 600)

    for name in cfg.scenarios:
        for stack, python in stacks.items():
            if python is None:
                entry = _failed(stack, peer_error or "stack unavailable")
            else:
                cfg.log(f"{name}: {stack}")
                out = cfg.out_dir / f"{name}-{stack}.json"
                if name == "micro":
                    argv = [str(python), "-m", "bench.micro", "--stack", stack, "--seconds", str(cfg.micro_seconds)]
                    limit = cfg.micro_seconds * 14 + STARTUP_SLACK_S + 120  # each operation and its raw twin
                else:
                    argv = [str(python), "-m", "bench.driver", "--stack", stack, name, "--scale", str(cfg.scale)]
                    argv += ["--seed", str(cfg.seed), "--timeout-s", str(cfg.timeout_s)]
                    limit = cfg.timeout_s + STARTUP_SLACK_S
                entry = _run([*argv, "--out", str(out)], out, logs / f"{name}-{stack}.log", _env(stack, cfg), limit)
            cfg.log(f"  -> {report.one_line(entry)}")
            if name == "micro":
                results["micro"][stack] = entry
            else:
                results["scenarios"].setdefault(name, {})[stack] = entry
    results["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    results["meta"]["load_avg_at_end"] = list(os.getloadavg())
    report.write(results, cfg.out_dir)
    return results
