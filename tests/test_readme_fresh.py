"""The README's commands work after the README's install: a copy of the repository gets a fresh virtual
environment from ``bash scripts/install.sh`` (PyPI, or pip's cache), then every command of the README's bash
blocks and its Python example runs there, and none may end in a traceback.

The default model is used where the README uses it (its engines built on first use, as a user's are); the
README's own checkpoints (``./my-llama``, ``./my-llama-small``) are tiny random models made here. Commands that
run for minutes on the default model take smaller counts (the benchmark's prompts, repeats and new tokens), the
server listens on a free port (the README's 8000 may be taken) and is stopped once it answered, and the GPU
command, on a machine without one, must refuse in one line.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_model, save_checkpoint
from test_readme import ROOT, bash_commands, ours

from specdec_trt.bench.servers import free_port

pytestmark = pytest.mark.slow
SMALLER = {"--limit": "1", "--repeats": "1", "-n": "8", "-k": "auto"}  # the benchmark's counts, made smaller
# The install itself ran already; llama.cpp's build is a peer's, kept out of CI's install path.
SKIPPED = ("bash scripts/install.sh", "TORCH_SPEC= bash scripts/install.sh", "bash scripts/install_llama_cpp.sh")


def fresh_install(repo: Path) -> dict[str, str]:
    """Copy the repository's tracked files to ``repo`` and install them the README's way, with the README's
    checkpoints beside them; the environment that puts the install's commands first on the PATH."""
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    install = subprocess.run(["bash", "scripts/install.sh"], cwd=repo, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-2000:]
    target = build_model(family="llama", hidden_size=64, head_dim=16, max_position_embeddings=4096)
    save_checkpoint(target, repo / "my-llama")
    draft = build_model(
        family="llama", hidden_size=64, head_dim=16, like=target, noise=0.1, max_position_embeddings=4096
    )
    save_checkpoint(draft, repo / "my-llama-small")
    env = os.environ | {"PATH": f"{repo / '.venv' / 'bin'}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    return env


def smaller(argv: list[str]) -> list[str]:
    """``argv`` with the value after each option of ``SMALLER`` replaced."""
    return [SMALLER.get(before, token) for before, token in zip(["", *argv], argv)]


def run(argv: list[str], repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=900)


def test_every_readme_command_runs_in_a_fresh_install(tmp_path: Path) -> None:
    """One test, so that parallel workers never install twice."""
    repo = tmp_path / "repo"
    env = fresh_install(repo)
    commands = [c for c in bash_commands(ROOT / "README.md") if ours(c) and c not in SKIPPED]
    serve = next(c for c in commands if c.startswith("specdec-serve"))
    ran = []
    for command in commands:
        if command == serve:
            continue
        argv = shlex.split(command)
        if argv[0] == "specdec-bench":
            argv = smaller(argv)
        result = run(argv, repo, env)
        assert "Traceback" not in result.stderr + result.stdout, f"{command}:\n{result.stderr[-3000:]}"
        if "--device cuda" in command:  # no GPU here: one line that says so
            assert result.returncode != 0 and "CUDA" in result.stderr, result.stderr
        else:
            assert result.returncode == 0, f"{command}:\n{result.stderr[-3000:]}"
        ran.append(argv[0])
    assert {"specdec-run", "specdec-build", "specdec-bench"} <= set(ran)
    assert (repo / "results" / "bench_readme.json").is_file()
    serve_and_curl(shlex.split(serve), repo, env)
    python_example(repo, env)


def serve_and_curl(serve: list[str], repo: Path, env: dict[str, str]) -> None:
    """The README's server, on a free port, answers the README's curl, and stops cleanly on SIGTERM."""
    commands = bash_commands(ROOT / "README.md")
    curl = shlex.split(next(c for c in commands if c.startswith("curl")))
    port = free_port()
    server = subprocess.Popen([*serve, "--port", str(port)], cwd=repo, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert server.poll() is None, server.stderr.read()[-3000:]
        curl = [re.sub(r"127\.0\.0\.1:8000", f"127.0.0.1:{port}", token) for token in curl]
        answer = subprocess.run(curl, capture_output=True, text=True, timeout=120)
        assert '"chat.completion"' in answer.stdout, answer.stdout + answer.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        _, errors = server.communicate(timeout=60)
    assert server.returncode == 0 and "Traceback" not in errors, errors[-3000:]


def python_example(repo: Path, env: dict[str, str]) -> None:
    """The README's Python example, on the engines its specdec-build wrote."""
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    result = run([str(repo / ".venv" / "bin" / "python"), "-c", block], repo, env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
