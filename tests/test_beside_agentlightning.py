"""eventlight installs beside ``agentlightning`` 0.3.0 in one environment without breaking either (issue 13).

Builds a fresh venv from ``bench/agentlightning-0.3.0.requirements.txt`` (0.3.0 and its pins as on
its release day), builds eventlight's wheel from the checkout, installs it there with pip's real
resolver (no ``--no-deps``, no constraints), and checks:

* no package of the 0.3.0 environment is downgraded or removed, ``agentlightning`` is 0.3.0 and its
  pinned ``opentelemetry-sdk`` is unchanged, and ``pip check`` finds nothing broken;
* ``import agentlightning`` and ``import eventlight`` work in one interpreter, with a store round
  trip on each (0.3.0's ``InMemoryLightningStore``; eventlight's ``JetStreamLightningStore`` on the
  test session's servers, and a traced rollout through ``LitAgentRunner`` with ``OtelTracer`` on
  the peer's OpenTelemetry).

What the install changed is printed and written to ``beside-agentlightning.txt`` under pytest's
base temp. Slow (about 2-5 minutes, mostly the 0.3.0 install; faster with a warm pip cache).
Skipped, saying why, when pip cannot fetch ``agentlightning==0.3.0``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from eventlight.ops import Services, drop_namespace
from eventlight.settings import Settings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "bench" / "agentlightning-0.3.0.requirements.txt"
PINNED_OTEL_SDK = "1.39.1"

CHECK = """
import asyncio, importlib.metadata as md

import agentlightning
import eventlight as agl
from opentelemetry.sdk.version import __version__ as otel_sdk

assert md.version("agentlightning") == "0.3.0", md.version("agentlightning")
assert otel_sdk == "{otel}", otel_sdk


async def peer_round_trip() -> None:
    store = agentlightning.InMemoryLightningStore()
    rollout = await store.enqueue_rollout(input={{"q": 1}})
    claimed = await store.dequeue_rollout()
    assert claimed is not None and claimed.rollout_id == rollout.rollout_id


@agl.rollout
def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    return float(task["q"])


async def eventlight_round_trip() -> None:
    settings = agl.Settings.from_env()
    await agl.prepare_services(settings)  # the namespace's streams and tables; the servers answer already
    async with agl.JetStreamLightningStore(settings, nats_url=settings.nats_url, pg_dsn=settings.pg_dsn) as store:
        await store.add_resources({{"prompt_template": agl.PromptTemplate(template="{{q}}", engine="f-string")}})
        rollout = await store.enqueue_rollout(input={{"q": 0.5}})
        runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, heartbeat_interval=0)
        with runner.run_context(agent=agent, store=store):
            await runner.iter()
        [done] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=30)
        assert done.status == "succeeded", done.status
        assert agl.find_final_reward(list(await store.query_spans(rollout.rollout_id))) == 0.5


asyncio.run(peer_round_trip())
asyncio.run(eventlight_round_trip())
print("both work")
"""


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """``cmd``'s outcome; without ``PYTHONPATH`` unless ``env`` is given (a checkout on it, with the
    ``eventlight.egg-info`` a wheel build leaves there, made pip in the new venv take eventlight as
    installed already and skip it)."""
    kwargs.setdefault("env", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload,no-any-return]


def _freeze(python: Path) -> dict[str, str]:
    out = _run([str(python), "-m", "pip", "freeze", "--all"], check=True).stdout
    pins = {}
    for line in out.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[name.lower().replace("_", "-")] = version
        elif " @ " in line:
            pins[line.split(" @ ")[0].lower()] = "(from a file)"
    return pins


def _version_key(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def compare(before: dict[str, str], after: dict[str, str]) -> dict[str, list[str]]:
    """Packages added, upgraded, downgraded and removed between two ``pip freeze`` maps."""
    out: dict[str, list[str]] = {"added": [], "upgraded": [], "downgraded": [], "removed": []}
    for name, version in sorted(after.items()):
        old = before.get(name)
        if old is None:
            out["added"].append(f"{name} {version}")
        elif old != version:
            kind = "upgraded" if _version_key(version) > _version_key(old) else "downgraded"
            out[kind].append(f"{name} {old} -> {version}")
    out["removed"] = [f"{name} {v}" for name, v in sorted(before.items()) if name not in after]
    return out


def test_compare_names_each_kind_of_change() -> None:
    before = {"a": "1.0", "b": "2.0", "c": "3.0", "d": "1.0"}
    after = {"a": "1.0", "b": "2.1", "c": "2.9", "e": "0.1"}
    assert compare(before, after) == {
        "added": ["e 0.1"],
        "upgraded": ["b 2.0 -> 2.1"],
        "downgraded": ["c 3.0 -> 2.9"],
        "removed": ["d 1.0"],
    }


@pytest.mark.timeout(1200)
def test_installs_beside_agentlightning_0_3_0(
    tmp_path: Path, services: tuple[Settings, Services], tmp_path_factory: pytest.TempPathFactory
) -> None:
    probe = _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp_path / "probe"),
                  "agentlightning==0.3.0"], timeout=300)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"pip cannot fetch agentlightning==0.3.0 (no registry reachable): {probe.stderr.strip()[-300:]}")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    peer = _run([str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], timeout=900)
    assert peer.returncode == 0, peer.stderr[-2000:]
    before = _freeze(python)
    assert before["agentlightning"] == "0.3.0" and before["opentelemetry-sdk"] == PINNED_OTEL_SDK

    wheel = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path / "dist")], timeout=300
    )  # fmt: skip  (building eventlight's own wheel; its install below resolves)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    [built] = (tmp_path / "dist").glob("eventlight-*.whl")
    install = _run([str(python), "-m", "pip", "install", str(built)], timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    changes = compare(before, _freeze(python))
    report = "\n".join(f"{kind}: {', '.join(items) or '-'}" for kind, items in changes.items())
    print(report)
    (tmp_path_factory.getbasetemp() / "beside-agentlightning.txt").write_text(report + "\n")

    assert changes["downgraded"] == [] and changes["removed"] == [], report
    assert not any(c.startswith(("agentlightning ", "opentelemetry-")) for c in changes["upgraded"]), report
    broken = _run([str(python), "-m", "pip", "check"])
    assert broken.returncode == 0, broken.stdout

    _, svc = services
    namespace = f"beside{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EVENTLIGHT_", "PYTHONPATH"))}
    env.update(EVENTLIGHT_NATS_URL=svc.nats_url, EVENTLIGHT_PG_DSN=svc.pg_dsn, EVENTLIGHT_NAMESPACE=namespace)
    env["EVENTLIGHT_STATE_DIR"] = str(tmp_path / "state")
    try:
        check = _run([str(python), "-c", CHECK.format(otel=PINNED_OTEL_SDK)], cwd=tmp_path, env=env, timeout=300)
    finally:
        settings = Settings(nats_url=svc.nats_url, pg_dsn=svc.pg_dsn, namespace=namespace)
        asyncio.run(drop_namespace(svc.nats_url, svc.pg_dsn, settings))
    assert check.returncode == 0 and "both work" in check.stdout, check.stdout[-2000:] + check.stderr[-3000:]
