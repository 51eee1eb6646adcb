"""Replicas on Ray Serve against one replica with more threads, on the default model under closed-loop load.

Each layout serves the default engines (lookup-first with the int4 self-draft, auto draft length) through
``specdec-serve``, one layout at a time on the whole machine:

- one server without Ray, with all the threads (the baseline the proxy's cost is read against);
- ``--ray`` with one replica of one thread, one replica of all the threads, and one replica per thread.

At each concurrency, clients send the bench suites' code, chat and summarisation prompts (greedy,
``--max-tokens`` each, EOS ignored); total tokens/s is counted from ``usage``, with time to first token and
end-to-end latency p50/p99. With ``--rounds 2`` the layouts run again in reverse order, so drifting machine
load hits them alike; every figure is then over both rounds. A table is printed and the JSON written.

    .venv/bin/python scripts/bench_replicas.py --out results/bench_replicas.json
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from benchlib.load import RequestTiming, closed_loop, load_summary
from benchlib.openai_client import stream_completion
from specdec_trt.bench.environment import environment
from specdec_trt.bench.servers import ServerStartError, free_port, running, specdec_serve_argv
from specdec_trt.bench.suites import interleaved_prompt_texts
from specdec_trt.build_progress import default_engines_shown

READY_TIMEOUT_S = 600


@dataclass(frozen=True)
class Layout:
    """One way of deploying the server: Ray replicas (0: no Ray) and threads per replica."""

    replicas: int
    threads: int

    @property
    def name(self) -> str:
        if not self.replicas:
            return f"no Ray, {self.threads} threads"
        replicas, threads = "replica" + "s" * (self.replicas > 1), "thread" + "s" * (self.threads > 1)
        return f"{self.replicas} {replicas} x {self.threads} {threads}"

    def argv(self, engines: Path, port: int, max_batch_size: int) -> list[str]:
        argv = specdec_serve_argv(engines, port, self.threads, max_batch_size)
        return argv + (["--ray", "--replicas", str(self.replicas)] if self.replicas else [])


@click.command(context_settings={"show_default": True})
@click.option(
    "--engines", type=click.Path(exists=True, file_okay=False, path_type=Path), help="[default: the default engines]"
)
@click.option("--concurrency", default="1,2,4,8", help="Closed-loop clients, comma-separated.")
@click.option("--requests", default=12, help="Requests per layout at each concurrency and round.")
@click.option("--max-tokens", default=64, help="Tokens each request generates.")
@click.option("--max-batch-size", default=8, help="Slots of each replica.")
@click.option("--cpus", default=os.cpu_count() or 1, help="Threads to share out: the machine's cores.")
@click.option("--rounds", default=1, help="Passes over the layouts, every other one in reverse order.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench_replicas.json"))
def main(
    engines: Path | None,
    concurrency: str,
    requests: int,
    max_tokens: int,
    max_batch_size: int,
    cpus: int,
    rounds: int,
    out: Path,
) -> None:
    """1 and N replicas of one thread against one replica of N threads, at several concurrencies."""
    console = Console(stderr=True)
    directory = engines or default_engines_shown(console)
    tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
    prompts = interleaved_prompt_texts(tokenizer)
    levels = [int(c) for c in concurrency.split(",")]
    layouts = [Layout(0, cpus), Layout(1, 1), Layout(1, cpus), Layout(cpus, 1)]
    logs = Path(tempfile.mkdtemp(prefix="bench_replicas_"))  # each server's output, named when one fails
    timings: dict[tuple[str, int], list[tuple[list[RequestTiming], float]]] = {}
    for round_index in range(rounds):
        for layout in layouts if round_index % 2 == 0 else layouts[::-1]:
            log = logs / f"{layout.replicas}x{layout.threads}-{round_index}.log"
            console.print(f"Round {round_index + 1}: {layout.name}")
            for level, run in measure(layout, directory, prompts, levels, requests, max_tokens, max_batch_size, log):
                timings.setdefault((layout.name, level), []).append(run)
    results = [
        {"layout": layout.name, "replicas": layout.replicas, "threads": layout.threads, "clients": level}
        | pooled(timings[(layout.name, level)])
        for layout in layouts
        for level in levels
    ]
    console.print(table(results, levels, [layout.name for layout in layouts]))
    data = {
        "command": "scripts/bench_replicas.py",
        "environment": environment("cpu", cpus),
        "settings": {
            "requests": requests,
            "max_tokens": max_tokens,
            "max_batch_size": max_batch_size,
            "rounds": rounds,
        },
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"Wrote {out}")


def measure(
    layout: Layout,
    engines: Path,
    prompts: list[str],
    levels: list[int],
    requests: int,
    max_tokens: int,
    max_batch_size: int,
    log: Path,
) -> list[tuple[int, tuple[list[RequestTiming], float]]]:
    """Start ``layout``, warm every replica up, then serve ``requests`` at each level of closed-loop clients."""
    port = free_port()
    with running(layout.name, layout.argv(engines, port, max_batch_size), port, "/health", log) as server:
        wait_for_replicas(server.url, layout.replicas, log)
        with httpx.Client(base_url=server.url, timeout=600) as client:

            def send(prompt: str) -> RequestTiming:
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                return stream_completion(client, body | {"stream_options": {"include_usage": True}})[0]

            warm = 2 * max(1, layout.replicas)  # first requests pay for allocations and thread pools
            closed_loop(send, prompts[:warm], warm)
            runs = []
            for turn, level in enumerate(levels):
                batch = [prompts[(turn * requests + i) % len(prompts)] for i in range(requests)]
                runs.append((level, closed_loop(send, batch, level)))
            return runs


def wait_for_replicas(url: str, replicas: int, log: Path) -> None:
    """Wait until /metrics lists ``replicas`` replicas: /health answers as soon as the first one is up."""
    if replicas < 2:
        return
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if len(metric_replicas(url)) >= replicas:
            return
        time.sleep(1)
    raise ServerStartError(f"{replicas} replicas were not up within {READY_TIMEOUT_S} s: see {log}")


def metric_replicas(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.split('replica="', 1)[1].split('"', 1)[0] for line in text.splitlines() if 'replica="' in line}


def pooled(runs: list[tuple[list[RequestTiming], float]]) -> dict:
    """One summary over the rounds: their requests pooled, their wall times added."""
    return load_summary([t for run, _ in runs for t in run], sum(wall for _, wall in runs))


def table(results: list[dict], levels: list[int], names: list[str]) -> Table:
    out = Table(title="tokens/s (p99 end-to-end latency, s)")
    out.add_column("layout")
    for level in levels:
        out.add_column(f"{level} client{'s' * (level > 1)}", justify="right")
    for name in names:
        cells = {r["clients"]: r for r in results if r["layout"] == name}
        out.add_row(name, *(f"{cells[c]['tokens_per_s']:.1f} ({cells[c]['e2e']['p99_ms'] / 1e3:.1f})" for c in levels))
    return out


if __name__ == "__main__":
    main()
