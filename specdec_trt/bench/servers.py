"""OpenAI-compatible servers as processes on 127.0.0.1, for benchmarks: ``specdec-serve``, and llama.cpp's own
``llama-server`` (``specdec_trt.bench.llama_cpp_bin`` finds it).

Each runs in a process of its own, started, waited for until it answers, and stopped (SIGTERM, then SIGKILL)
however the benchmark ends, so no server outlives it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

READY_TIMEOUT_S = 600


class ServerStartError(RuntimeError):
    """A server process ended, or never answered, before it was ready."""


@dataclass(frozen=True)
class Server:
    """A running server: its name in the results and its base URL."""

    name: str
    url: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def specdec_serve_argv(engines: Path, port: int, threads: int, max_batch_size: int) -> list[str]:
    """``specdec-serve`` on ``engines`` with their default draft (requests pick their own draft length)."""
    binary = Path(sys.executable).parent / "specdec-serve"
    return [
        str(binary),
        *("--engines", str(engines), "--port", str(port), "--threads", str(threads)),
        *("--max-batch-size", str(max_batch_size), "--max-queue", "1024", "--log-level", "warning"),
    ]


def llama_server_argv(
    binary: Path, gguf: Path, port: int, threads: int, slots: int, slot_context: int, options: Sequence[str] = ()
) -> list[str]:
    """``llama-server`` on ``gguf`` with ``slots`` parallel slots of ``slot_context`` positions each (one
    unified cache of slots x slot_context), plus ``options`` (its speculative settings)."""
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * slot_context)]
    return argv + list(options)


@contextmanager
def running(name: str, argv: Sequence[str], port: int, ready_path: str, log: Path) -> Iterator[Server]:
    """Run ``argv`` (a server listening on ``port``) until the block ends; ready once ``ready_path`` answers
    200. Its output goes to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        process = subprocess.Popen(list(argv), stdout=output, stderr=subprocess.STDOUT)
        server = Server(name, f"http://127.0.0.1:{port}")
        try:
            _wait_ready(process, server.url + ready_path, log)
            yield server
        finally:
            _stop(process)


def _wait_ready(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(f"{process.args[0]} exited with status {process.returncode}: see {log}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"{url} did not answer within {READY_TIMEOUT_S} s: see {log}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
