"""Memory and CPU of a stack's processes, sampled with psutil (imported by both stacks' drivers).

Each role (``algorithm``, ``store``, ``runners``) is a set of root pids; a sample covers the roots and
all their descendants. Every ``interval_s`` the sampler sums RSS (the peak of the sum is reported,
total and per role) and remembers each process's CPU time, so CPU used inside a window is the sum of
``last seen - value at window start`` over every process seen (a process that exits loses at most
its last ``interval_s`` of CPU). PSS, which does not count pages shared between processes (forked
runners, Postgres shared buffers) several times, is read once at the end of the window.

The process tree is re-read (a scan of ``/proc``) every ``refresh_every`` samples and at the window's
edges. The sampler's own CPU (it runs in the driver's process) is measured and taken out of that
process's role, and reported as ``sampler_cpu_s``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import psutil

MB = 1024 * 1024


class ProcessSampler:
    """Samples the processes of named roles in a background thread.

    Args:
        interval_s: Seconds between samples.
    """

    def __init__(self, interval_s: float = 0.5, own_role: str = "algorithm", refresh_every: int = 20):
        self.interval_s = interval_s
        self.own_role = own_role
        self.refresh_every = refresh_every
        self._members_cache: dict[str, list[psutil.Process]] | None = None
        self._samples = 0
        self._own_cpu_s = 0.0
        self.roles: dict[str, set[int]] = {}
        self._cpu: dict[tuple[int, float], tuple[str, float]] = {}
        self._base: dict[tuple[int, float], float] = {}
        self._procs: dict[tuple[int, float], psutil.Process] = {}
        self.peak_rss_mb: dict[str, float] = {}
        self.window_open = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, role: str, pid: int) -> None:
        with self._lock:
            self.roles.setdefault(role, set()).add(pid)
            self._members_cache = None

    def _members(self) -> dict[str, list[psutil.Process]]:
        out: dict[str, list[psutil.Process]] = {}
        seen: set[int] = set()
        # the driver (``algorithm``) last: its descendants that belong to another role count there
        for role, pids in sorted(self.roles.items(), key=lambda kv: kv[0] == "algorithm"):
            procs: list[psutil.Process] = []
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    root = psutil.Process(pid)
                    for p in [root, *root.children(recursive=True)]:
                        if p.pid not in seen:
                            seen.add(p.pid)
                            procs.append(p)
            out[role] = procs
        return out

    def sample(self, refresh: bool = False) -> dict[str, float]:
        """Take one sample now; returns the RSS sum per role in MB."""
        t0 = time.thread_time()
        try:
            return self._sample(refresh)
        finally:
            if self.window_open:
                self._own_cpu_s += time.thread_time() - t0

    def _sample(self, refresh: bool) -> dict[str, float]:
        with self._lock:
            self._samples += 1
            if refresh or self._members_cache is None or self._samples % self.refresh_every == 0:
                self._members_cache = self._members()
            members = self._members_cache
            rss: dict[str, float] = {}
            for role, procs in members.items():
                total = 0.0
                for p in procs:
                    try:
                        key = (p.pid, p.create_time())
                        cached = self._procs.setdefault(key, p)
                        with cached.oneshot():
                            total += cached.memory_info().rss
                            t = cached.cpu_times()
                        self._cpu[key] = (role, t.user + t.system)
                    except psutil.Error:
                        continue
                rss[role] = total / MB
            if self.window_open:
                rss["total"] = sum(rss.values())
                for role, value in rss.items():
                    self.peak_rss_mb[role] = max(self.peak_rss_mb.get(role, 0.0), value)
            return rss

    def pss(self) -> dict[str, float]:
        """PSS per role in MB now (shared pages split between the processes sharing them, so
        Postgres' shared buffers and forked runners are not counted many times as in RSS)."""
        with self._lock:
            return self._pss()

    def _pss(self) -> dict[str, float]:
        pss: dict[str, float] = {}
        for role, procs in self._members().items():
            total = 0.0
            for p in procs:
                with contextlib.suppress(psutil.Error, AttributeError):
                    total += p.memory_full_info().pss
            pss[role] = total / MB
        pss["total"] = sum(pss.values())
        return pss

    def open_window(self) -> None:
        """Start counting: CPU from now, peaks from now."""
        self.sample(refresh=True)
        with self._lock:
            self._base = {k: v for k, (_, v) in self._cpu.items()}
            self.peak_rss_mb = {}
            self._own_cpu_s = 0.0
            self.window_open = True
        self.sample()

    def close_window(self) -> dict[str, Any]:
        """Stop counting; returns CPU seconds and peak RSS (MB) per role and in total, and PSS now."""
        self.sample(refresh=True)
        with self._lock:
            self.window_open = False
            cpu: dict[str, float] = {}
            for key, (role, value) in self._cpu.items():
                cpu[role] = cpu.get(role, 0.0) + value - self._base.get(key, 0.0)
            if self.own_role in cpu:
                cpu[self.own_role] = max(0.0, cpu[self.own_role] - self._own_cpu_s)
            cpu["total"] = sum(cpu.values())
            pss = self._pss()
            counts = {role: len(procs) for role, procs in self._members().items()}
        return {
            "cpu_s": cpu,
            "peak_rss_mb": dict(self.peak_rss_mb),
            "pss_at_end_mb": pss,
            "processes": counts,
            "sampler_cpu_s": round(self._own_cpu_s, 3),
        }

    def start(self) -> ProcessSampler:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                with contextlib.suppress(Exception):
                    self.sample()

        self._thread = threading.Thread(target=loop, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def self_pid() -> int:
    return os.getpid()


def wait_files(folder: Any, names: list[str], timeout_s: float, alive: Any = None) -> list[str]:
    """Wait until every file in ``names`` exists under ``folder``; returns the missing ones on timeout.

    Args:
        alive: Optional callable returning ``False`` when waiting is pointless (a process died).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [n for n in names if not (folder / n).exists()]
        if not missing or time.monotonic() > deadline or (alive is not None and not alive()):
            return missing
        time.sleep(0.1)
