"""Who a runner is: its worker id (``worker_name``) and its heartbeat payload (``system_snapshot``)."""

from __future__ import annotations

import functools
import os
import re
import secrets
import socket
import time
from typing import Any

import psutil


def system_snapshot() -> dict[str, Any]:
    """The heartbeat payload: host, CPU and memory use of this machine and process."""
    vm = psutil.virtual_memory()
    return {
        "timestamp": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpu_usage_pct": psutil.cpu_percent(interval=None),
        "mem_used_gb": round(vm.used / 2**30, 3),
        "mem_total_gb": round(vm.total / 2**30, 3),
        "process_rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
    }


@functools.lru_cache(maxsize=4)
def _process_tag(pid: int) -> str:
    """``<host>-<pid>-<4 hex>`` for this process (cached per pid, so a forked child gets its own)."""
    host = re.sub(r"[^A-Za-z0-9_\-]+", "-", socket.gethostname()).strip("-")[:63] or "host"
    return f"{host}-{pid}-{secrets.token_hex(2)}"


def worker_name(index: int | None) -> str:
    """The worker id of runner ``index`` in this process: ``Worker-<index>@<host>-<pid>-<tag>``.

    Unique across processes and machines (two containers may share a host name and a pid; the
    random tag tells them apart) and a valid id (letters, digits, ``_-:@+=``; no dots). Agent-
    lightning names workers ``Worker-<index>``, which every process shares.
    """
    return f"Worker-{'Unknown' if index is None else index}@{_process_tag(os.getpid())}"
