"""Python files imported by path (``eventlight runner path/to/random.py:agent``) under module names
that cannot clash, and that other processes can import again.

A file is imported as ``eventlight.file_modules.<stem>_<hex of its absolute path>``, never as its
bare stem: a file named like a module already imported (``random.py``, ``json.py``) or one of the
standard library would otherwise give that module instead of the file. The path is in the name, so
a runner process that unpickles an agent defined in the file (multiprocessing's ``forkserver`` or
``spawn``) imports the same file again through ``FileModuleFinder``, which importing this package
installs, without any state passed to it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["import_file", "module_name_for"]

_PREFIX = __name__ + "."


def module_name_for(path: str | os.PathLike[str]) -> str:
    """The module name ``import_file`` gives the Python file ``path`` (made absolute)."""
    absolute = Path(path).absolute()
    stem = re.sub(r"\W", "_", absolute.stem)
    return f"{_PREFIX}{stem}_{os.fsencode(absolute).hex()}"


def import_file(path: str | os.PathLike[str]) -> ModuleType:
    """Import the Python file ``path`` under ``module_name_for(path)`` (once per process).

    Raises:
        Exception: Whatever executing the file raised (``SyntaxError``, ``ImportError``, …); the
            half-made module is not kept.
    """
    return importlib.import_module(module_name_for(path))


def _path_of(name: str) -> str | None:
    """The file a name ``module_name_for`` made stands for; ``None`` for any other name."""
    if not name.startswith(_PREFIX):
        return None
    _stem, _, hexed = name[len(_PREFIX) :].rpartition("_")
    try:
        return os.fsdecode(bytes.fromhex(hexed))
    except ValueError:
        return None


class FileModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the names ``module_name_for`` makes (on ``sys.meta_path`` once this package is imported)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = _path_of(fullname)
        if file is None or not os.path.isfile(file):
            return None
        return importlib.util.spec_from_file_location(fullname, file)


if not any(isinstance(f, FileModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(FileModuleFinder())
