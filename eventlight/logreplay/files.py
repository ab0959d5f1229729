"""Output files written whole or not at all: a temporary file beside the target, renamed over it
only once complete.

A replay or an export that fails or is interrupted (Ctrl-C, a cancelled task) leaves the target as
it was (an existing file untouched, a new one never made) and no temporary file behind. The
rename (``os.replace``) is atomic on POSIX, so a reader sees the old file or the new one, never a
part of it; the data is flushed to disk before it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PART_SUFFIX = ".part"


def temporary_beside(target: Path) -> Path:
    """Make an empty file in ``target``'s folder, named ``.<name>.<random>.part``, with the
    permissions a new file gets there (``0o666`` less the umask).

    Raises:
        OSError: The folder takes no new file.
    """
    folder = target.absolute().parent
    while True:
        path = folder / f".{target.name}.{secrets.token_hex(4)}{PART_SUFFIX}"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:  # pragma: no cover - 32 random bits taken
            continue
        return path


@contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A temporary path beside ``target`` for the block to write; renamed over ``target`` when the
    block ends without an exception, removed when it raises (``KeyboardInterrupt`` and
    cancellation included).

    Raises:
        OSError: The temporary file cannot be made or the rename fails (it is removed then).
    """
    part = temporary_beside(target)
    try:
        yield part
        _sync(part)
        os.replace(part, target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _sync(path: Path) -> None:
    """Flush ``path``'s data to disk, so the rename never puts an empty file in place after a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
