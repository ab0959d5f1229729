"""Every public name and import path of Agent-lightning 0.3.0 exists under ``eventlight`` (issue 13).

The names come from Agent-lightning itself, in the peer venv (``bench/.peer-venv``, made by
``bench.peer.ensure_peer`` when missing; the test is skipped when it cannot be made): the public
top-level names (``dir(agentlightning)``: its ``__all__`` is empty) and, for each public submodule,
its ``__all__`` or, without one, the public names it defines (not those it imports from elsewhere).
Each must exist under the same path in ``eventlight``: with the documented behaviour, or, for what
cannot apply, as a name that raises a clear error on use naming what to use instead.
"""

from __future__ import annotations

import importlib
import json
import subprocess

import pytest

SUBMODULES = [
    "store", "adapter", "algorithm", "emitter", "tracer", "types", "semconv",
    "runner", "trainer", "llm_proxy", "reward", "execution", "utils",
]  # fmt: skip

LIST_NAMES = """
import importlib, json, types
import agentlightning as agl

def public(module):
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(names)
    out = []
    for name in dir(module):
        if name.startswith("_"):
            continue
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):
            home = value.__name__
        elif isinstance(value, type) or hasattr(value, "__code__"):
            home = getattr(value, "__module__", None)
        else:
            home = None  # a constant or a typing alias defined here
        if isinstance(home, str) and not home.startswith("agentlightning"):
            continue  # imported from elsewhere (typing, enum, pydantic)
        out.append(name)
    return sorted(out)

names = {"": sorted(n for n in dir(agl) if not n.startswith("_"))}
for sub in SUBMODULES:
    names[sub] = public(importlib.import_module("agentlightning." + sub))
print(json.dumps(names))
"""


@pytest.fixture(scope="module")
def peer_names() -> dict[str, list[str]]:
    from bench.peer import ensure_peer, peer_env

    peer = ensure_peer(log=lambda _line: None)
    if peer.python is None:
        pytest.skip(f"no Agent-lightning 0.3.0 peer venv: {peer.error}")
    code = f"SUBMODULES = {SUBMODULES!r}\n{LIST_NAMES}"
    done = subprocess.run(
        [str(peer.python), "-c", code], env=peer_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return names


def _missing(module_path: str, names: list[str]) -> list[str]:
    try:
        module = importlib.import_module(module_path)
    except ImportError:
        return list(names)
    return [n for n in names if not hasattr(module, n)]


def test_every_top_level_name_exists(peer_names: dict[str, list[str]]) -> None:
    names = peer_names[""]
    missing = _missing("eventlight", names)
    print(f"\n[top-level names] {len(names) - len(missing)}/{len(names)} present")
    assert not missing, f"missing in eventlight: {missing}"


def test_every_submodule_and_its_names_exist(peer_names: dict[str, list[str]]) -> None:
    paths, total, missing = 0, 0, []
    for sub in SUBMODULES:
        try:
            importlib.import_module(f"eventlight.{sub}")
            paths += 1
        except ImportError:
            pass
        total += len(peer_names[sub])
        missing += [f"eventlight.{sub}.{n}" for n in _missing(f"eventlight.{sub}", peer_names[sub])]
    print(f"\n[import paths] {paths}/{len(SUBMODULES)} present; [their names] {total - len(missing)}/{total} present")
    assert paths == len(SUBMODULES) and not missing, f"missing: {missing}"
