"""Files eventlight ships with the package: ``streams/`` (JetStream stream and consumer definitions,
JSON) and ``migrations/`` (the read models' numbered SQL files, with the documented SQL views)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["data_dir"]


def data_dir(name: str) -> Path:
    """The packaged folder ``eventlight/_data/<name>`` (``"streams"`` or ``"migrations"``).

    Raises:
        FileNotFoundError: The package was installed without its data.
    """
    folder = Path(__file__).resolve().parent / name
    if not folder.is_dir():
        raise FileNotFoundError(f"no {name}/ folder at {folder}: the eventlight package is incomplete")
    return folder
