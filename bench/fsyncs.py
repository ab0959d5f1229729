"""fsyncs per atomic batch and per plain publish on the embedded nats-server, and what group commit
saves through the event log: ``python -m bench.fsyncs [BATCHES [SIZE [COMMANDS]]]``.

Starts an embedded nats-server at ``fsync`` durability (``sync_interval: always``) in a temporary
state dir and counts its ``fsync``/``fdatasync`` calls with ``strace -f -c -p <pid>`` (Linux; needs
strace and ptrace rights, e.g. root) while (1) ``BATCHES`` raw atomic batches of ``SIZE`` messages
(ADR-50 headers, each message fenced on its own subject tree), (2) ``5 * BATCHES`` plain publishes,
(3) ``COMMANDS`` rollout creations through ``JetStreamEventLog.append``, 64 concurrent, with group
commit off (every command a plain publish) and on, twice each, are sent. Prints one line each.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from eventlight.core import decider
from eventlight.core.commands import CreateRollout
from eventlight.ops import apply_streams
from eventlight.ops.nats_server import ensure_nats, stop_nats
from eventlight.settings import Settings
from eventlight.store.jetstream.appender import PLAIN_WINDOW
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.jetstream.log import JetStreamEventLog

NOW = 1_800_000_000.0


class Strace:
    """``strace -c`` attached to ``pid`` for the ``with`` block; ``calls``: fsync + fdatasync."""

    def __init__(self, pid: int, out: Path):
        self.pid, self.out, self.calls = pid, out, 0

    def __enter__(self) -> Strace:
        cmd = ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(self.out), "-p", str(self.pid)]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached to every thread
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(10)
        rows = [line.split() for line in self.out.read_text().splitlines()]
        self.calls = sum(int(r[3]) for r in rows if len(r) >= 5 and r[-1] in ("fsync", "fdatasync"))


async def main(batches: int, size: int, commands: int) -> None:
    """The three measurements in a temporary state dir, removed (with the nats-server's data) once the
    server is stopped, whether they succeeded or not."""
    state = Path(tempfile.mkdtemp(prefix="eventlight-fsyncs-"))
    try:
        settings = Settings(state_dir=state, namespace="fsyncs", durability="fsync")
        url, pid, _ = await ensure_nats(settings, state)
        try:
            assert pid, "an embedded nats-server is needed (unset EVENTLIGHT_NATS_URL)"
            await measure(settings, state, url, pid, batches, size, commands)
        finally:
            await stop_nats(state)
    finally:
        shutil.rmtree(state, ignore_errors=True)


async def measure(settings: Settings, state: Path, url: str, pid: int, batches: int, size: int, commands: int) -> None:
    """Print the three lines, counting the fsyncs of the nats-server ``pid`` serving ``url``."""
    nc = await connect_nats(url)
    try:
        await apply_streams(nc, settings)
        cfg = {"name": "FSYNCS", "subjects": ["f.>"], "storage": "file", "allow_atomic": True}
        await nc.request("$JS.API.STREAM.CREATE.FSYNCS", json.dumps(cfg).encode(), timeout=5)
        data = b"x" * 300
        with Strace(pid, state / "batches.strace") as st:
            t = time.perf_counter()
            for b in range(batches):
                bid = uuid.uuid4().hex
                for i in range(1, size + 1):
                    h = {"Nats-Batch-Id": bid, "Nats-Batch-Sequence": str(i)}
                    h["Nats-Expected-Last-Subject-Sequence"] = "0"
                    h["Nats-Expected-Last-Subject-Sequence-Subject"] = f"f.r.{b}.{i}.>"
                    if i < size:
                        await nc.publish(f"f.r.{b}.{i}.q", data, headers=h)
                        continue
                    h["Nats-Batch-Commit"] = "1"
                    reply = json.loads((await nc.request(f"f.r.{b}.{i}.q", data, headers=h, timeout=5)).data)
                    assert "error" not in reply, reply
            dt = time.perf_counter() - t
        rate = batches * size / dt
        per = st.calls / batches
        print(f"atomic batches: {batches} x {size} messages, {rate:,.0f} msg/s, {per:.2f} fsyncs per batch")
        js = nc.jetstream()
        with Strace(pid, state / "plain.strace") as st:
            t = time.perf_counter()
            for i in range(5 * batches):
                await js.publish(f"f.p.{i}", data)
            dt = time.perf_counter() - t
        n = 5 * batches
        print(f"plain publishes: {n}, {n / dt:,.0f} msg/s, {st.calls / n:.2f} fsyncs per publish")
        log = JetStreamEventLog(nc, settings, lambda: NOW)
        for tag, window in [("off", 1 << 30), ("on", PLAIN_WINDOW), ("off", 1 << 30), ("on", PLAIN_WINDOW)]:
            log.appender.plain_window = window
            before = log.appender.stats.batches
            sem = asyncio.Semaphore(64)

            async def create(rid: str, sem: asyncio.Semaphore = sem) -> None:
                async with sem:
                    events = decider.decide(None, CreateRollout(rollout_id=rid, input={"task": rid}), NOW)
                    await log.append(rid, events, 0, uuid.uuid4().hex)

            with Strace(pid, state / f"{tag}.strace") as st:
                t = time.perf_counter()
                await asyncio.gather(*(create(f"{tag}-{uuid.uuid4().hex[:8]}") for _ in range(commands)))
                dt = time.perf_counter() - t
            print(
                f"group commit {tag:3}: {commands} creates, 64 concurrent, {commands / dt:,.0f} commands/s, "
                f"{st.calls / commands:.2f} fsyncs per command, {log.appender.stats.batches - before} batches"
            )
    finally:
        await nc.close()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    asyncio.run(main(*(args + [200, 50, 2000][len(args) :])))
