"""Leases on a state folder's embedded servers: who uses them now, and which stop when no one does.

Files under ``settings.state_dir`` (the rest: ``eventlight.ops.state``)::

    leases/<pid>-<hex>.json  one per user of the servers for a while (a ``Trainer``'s run,
                             ``use_services``, ``eventlight runner``, ``eventlight serve``):
                             ``{"pid": 123, "what": "Trainer", "since": 1765100000.0}`` (``since``:
                             Unix time it was taken), flock'ed by its holder until it gives the lease up
    stop_when_unused.json    the servers a lease holder started, e.g. ``{"nats-server": 123}``: the
                             last holder to give up its lease stops them. ``eventlight up``,
                             ``ensure_services`` and ``prepare_services`` take the servers they
                             use off it (they then run until ``eventlight down``)

Why flocks rather than pids: the kernel drops a process's locks when it ends, however it ends
(``kill -9`` too), so a lease file no one holds a lock on is stale, whatever process its pid names
by now (pids are reused). Two leases of one process are two open files, whose locks exclude each
other as two processes' do (a demo's ``use_services`` block holds one and the ``Trainer`` inside it
another; ``live_leases`` and ``eventlight status`` list such a process once, ``by_process``); a
child forked (``os.fork``) while a lease is held shares its lock.
Every function here but ``lease_holders`` runs under the state folder's lock (``state_lock``), so
no lease can be taken between the check for leases and the stop; ``lease_holders`` (for ``eventlight
status``) reads without it and removes nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from pathlib import Path
from typing import BinaryIO

import msgspec

from eventlight.core.errors import InvalidInputError

LEASES = "leases"
MARKS = "stop_when_unused.json"


class LeaseHolder(msgspec.Struct, frozen=True):
    """What a lease file says of its holder.

    Attributes:
        pid: The holder's process id.
        what: Who it is (``"Trainer"``: a trainer's run; ``"eventlight runner"``, ``"eventlight serve"``,
            ``"use_services"``, or what a program passed).
        since: When it took the lease, Unix time in seconds; ``None`` in a file an older version wrote.
    """

    pid: int
    what: str
    since: float | None = None


class Lease:
    """One hold on a state folder's embedded servers (``take_lease``); ``close`` gives it up.

    Attributes:
        state: The state folder.
        path: The lease file.
    """

    def __init__(self, state: Path, path: Path, file: BinaryIO) -> None:
        self.state = state
        self.path = path
        self._file = file

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        """Remove the lease file and drop its lock; calling it again does nothing."""
        if self._file.closed:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._file.close()

    def __repr__(self) -> str:
        return f"Lease({str(self.path)!r}{', closed' if self.closed else ''})"


def take_lease(state: Path, what: str) -> Lease:
    """Register this process as a user of ``state``'s servers (the caller holds the state lock).

    Args:
        state: The state folder.
        what: Who holds it, for messages (``"Trainer"``, ``"eventlight runner"``).

    Returns:
        The lease, held until its ``close`` or the end of this process.

    Raises:
        InvalidInputError: The lease file cannot be created (a state folder this user cannot write).
    """
    folder = state / LEASES
    path = folder / f"{os.getpid()}-{secrets.token_hex(4)}.json"
    try:
        folder.mkdir(exist_ok=True)
        file = open(path, "xb")  # closed by Lease.close
    except OSError as e:
        raise InvalidInputError(
            f"cannot use {state} as the state folder (EVENTLIGHT_STATE_DIR): {e.strerror} ({e.filename})"
        ) from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else holds it
        file.write(msgspec.json.encode(LeaseHolder(os.getpid(), what, time.time())))
        file.flush()
    except BaseException:
        file.close()
        path.unlink()
        raise
    return Lease(state, path, file)


def live_leases(state: Path) -> list[str]:
    """Who holds a lease on ``state``'s servers, one entry a process, e.g. ``["pid 123 (Trainer)"]``
    (a process holding several: ``"pid 123 (use_services, Trainer)"``); stale lease files (their
    process ended) are removed. The caller holds the state lock."""
    held: list[tuple[float, str, str]] = []
    for path in sorted((state / LEASES).glob("*.json")):
        try:
            file = open(path, "rb")
        except FileNotFoundError:
            continue
        with file:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(_describe(file.read(), path))
                continue
            path.unlink(missing_ok=True)  # no process holds it any more
    holders: dict[str, list[str]] = {}
    for _, who, what in sorted(held, key=lambda h: h[0]):  # stable: the files' order among equals
        holders.setdefault(who, []).append(what)
    return [f"{who} ({', '.join(whats)})" for who, whats in holders.items()]


def lease_holders(state: Path) -> list[LeaseHolder]:
    """The live lease holders of ``state``'s servers, oldest first, for ``eventlight status``: the
    lease files a process holds a lock on; stale ones (their process ended) and unreadable ones are
    left out, and nothing is removed. Needs no state lock.

    A file still empty is skipped (``take_lease`` writes its holder after it has locked it), so a
    lease being taken is never locked here in its holder's way. Each other one is locked shared for
    an instant to see whether its holder still holds it.

    Returns:
        One ``LeaseHolder`` per live lease (``since`` filled in from the file's time when the file
        lacks it); ``[]`` when there is none or no ``leases`` folder.
    """
    holders = []
    for path in (state / LEASES).glob("*.json"):
        try:
            file = open(path, "rb")
        except OSError:
            continue
        with file:
            raw = file.read()
            if raw and _locked(file):
                with contextlib.suppress(msgspec.DecodeError):
                    holder = msgspec.json.decode(raw, type=LeaseHolder)
                    since = holder.since if holder.since is not None else os.fstat(file.fileno()).st_mtime
                    holders.append(msgspec.structs.replace(holder, since=since))
    return sorted(holders, key=lambda h: (h.since or 0.0, h.pid))


def _locked(file: BinaryIO) -> bool:
    """Whether another open file holds an exclusive lock on ``file``'s lease (its holder lives)."""
    try:
        fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(file, fcntl.LOCK_UN)
    return False


def _describe(raw: bytes, path: Path) -> tuple[float, str, str]:
    """(since when, the holder, what it is) of a lease file: ``(1765100000.0, "pid 123", "Trainer")``;
    since ``0.0`` when the file does not say."""
    try:
        holder = msgspec.json.decode(raw, type=LeaseHolder)
    except msgspec.DecodeError:
        return 0.0, path.name, "unreadable"
    return holder.since or 0.0, f"pid {holder.pid}", holder.what


def by_process(holders: list[LeaseHolder]) -> list[list[LeaseHolder]]:
    """``holders`` (``lease_holders``) grouped by pid, in the order of each process's first lease:
    a process may hold several (a program's ``use_services`` block around a ``Trainer``'s run, which
    takes its own lease), and is one user of the servers all the same."""
    groups: dict[int, list[LeaseHolder]] = {}
    for holder in holders:
        groups.setdefault(holder.pid, []).append(holder)
    return list(groups.values())


def marked(state: Path) -> dict[str, int]:
    """The servers to stop when no one holds a lease, by name (``"nats-server"``, ``"postgres"``)
    to pid; empty when there is none or the file is unreadable."""
    try:
        return msgspec.json.decode((state / MARKS).read_bytes(), type=dict[str, int])
    except (OSError, msgspec.DecodeError):
        return {}


def mark(state: Path, servers: dict[str, int]) -> None:
    """Add ``servers`` (name to pid, as ``marked``) to those stopped when no one holds a lease."""
    if servers:
        _write_marks(state, {**marked(state), **servers})


def unmark(state: Path, pids: set[int]) -> None:
    """Take the servers with these pids off ``marked``: they run until ``eventlight down``."""
    marks = marked(state)
    if any(pid in pids for pid in marks.values()):
        _write_marks(state, {name: pid for name, pid in marks.items() if pid not in pids})


def _write_marks(state: Path, marks: dict[str, int]) -> None:
    if not marks:
        (state / MARKS).unlink(missing_ok=True)
        return
    tmp = state / f"{MARKS}.{os.getpid()}"
    tmp.write_bytes(msgspec.json.encode(marks))
    tmp.replace(state / MARKS)


def clear_marks(state: Path) -> None:
    """Forget every mark (``eventlight down`` stopped the servers)."""
    (state / MARKS).unlink(missing_ok=True)
