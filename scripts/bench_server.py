"""specdec-serve under load, against llama-cpp-python's OpenAI server on the same weights.

One ``specdec-serve`` on the default engines (lookup-first with the int4 self-draft) serves every draft length
compared (plain k=0, fixed k, auto: each request names its own through ``"speculative"``). Beside it run
``llama_cpp.server`` on an F32 GGUF of the same model written with the ``gguf`` package, plain and with its
prompt-lookup draft (the ``peers`` extra; skipped, saying so, where it is not installed). Each server gets the
same threads, and only one is loaded at a time: at every load the methods take turns, ``--repeats`` times, so
drifting machine load hits them alike, and each method's repeat with the median tokens/s is reported.

Loads: closed-loop clients at each concurrency, and Poisson arrivals at each rate. Requests are the bench
suites' code, chat and summarisation prompts (rendered with the chat template where they are chats), greedy,
``--max-tokens`` each with the end-of-sequence token banned on both servers so every method makes as many.
For each: total tokens/s (counted from ``usage``, or for llama_cpp.server, which sends none when streaming,
from its text with the same tokenizer), time to first token, inter-token and end-to-end latency p50/p99.
A table is printed, the JSON written and tokens/s and p99 latency plotted against load.

    .venv/bin/python scripts/bench_server.py --out results/bench_server.json --plot docs/serving_load.png
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from benchlib.load import RequestTiming, against_best, closed_loop, load_summary, median_run, open_loop
from benchlib.openai_client import stream_completion
from specdec_trt.bench.environment import environment
from specdec_trt.bench.gguf_f32 import default_model_f32
from specdec_trt.bench.servers import (
    free_port,
    llama_cpp_argv,
    llama_cpp_available,
    running,
    specdec_serve_argv,
)
from specdec_trt.bench.suites import interleaved_prompt_texts
from specdec_trt.build_progress import default_engines_shown
from specdec_trt.policy import default_engine_dir

LLAMA, LLAMA_LOOKUP = "llama.cpp", "llama.cpp lookup"
OURS = "specdec"


@dataclass(frozen=True)
class Method:
    """One way of serving: which server, and what its requests add to the body."""

    name: str
    server: str
    extra: dict


def ours(k: int | str) -> Method:
    extra = {"ignore_eos": True, "speculative": {"num_draft_tokens": k}, "stream_options": {"include_usage": True}}
    return Method(f"{OURS} k={k}", OURS, extra)


def peer(name: str, eos: int) -> Method:
    return Method(name, name, {"logit_bias": {str(eos): -100}})  # no ignore_eos there: ban the token instead


def parse_list(text: str, kind: Callable) -> list:
    return [kind(item) for item in text.split(",") if item]


def draft_length(text: str) -> int | str:
    return text if text == "auto" else int(text)


@click.command(context_settings={"show_default": True})
@click.option(
    "--engines", type=click.Path(exists=True, file_okay=False, path_type=Path), help="[default: the default engines]"
)
@click.option(
    "--peer-gguf",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="GGUF that llama_cpp.server runs: the same weights as --engines. [default: the default model as F32]",
)
@click.option("--peers/--no-peers", default=None, help="Run llama_cpp.server too. [default: where it is installed]")
@click.option("--concurrency", default="1,2,4,8", help="Closed-loop clients, comma-separated.")
@click.option("--rates", default="0.5,1,2", help="Poisson arrival rates in requests/s, comma-separated.")
@click.option("--draft-lengths", default="0,2,4,auto", help="specdec-serve's draft lengths (0: plain).")
@click.option("--requests", default=12, help="Requests per method at each load.")
@click.option("--repeats", default=2, help="Turns of every method at each load; the median tokens/s is reported.")
@click.option("--max-tokens", default=64, help="Tokens each request generates.")
@click.option("--lookup-tokens", default=10, help="llama_cpp.server's prompt-lookup draft length.")
@click.option("--threads", default=os.cpu_count() or 1, help="CPU threads of each server.")
@click.option("--max-batch-size", default=8, help="specdec-serve's slots.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench_server.json"))
@click.option("--plot", type=click.Path(path_type=Path), default=Path("docs/serving_load.png"))
def main(
    engines: Path | None,
    peer_gguf: Path | None,
    peers: bool | None,
    concurrency: str,
    rates: str,
    draft_lengths: str,
    requests: int,
    repeats: int,
    max_tokens: int,
    lookup_tokens: int,
    threads: int,
    max_batch_size: int,
    out: Path,
    plot: Path,
) -> None:
    """Closed-loop and Poisson load on specdec-serve (plain, fixed k, auto) and llama_cpp.server."""
    console = Console(stderr=True)
    if peers is None:
        peers = llama_cpp_available()
        if not peers:
            console.print("llama_cpp is not installed: pip install 'specdec-trt[peers]' to compare with it")
    elif peers and not llama_cpp_available():
        raise click.UsageError("--peers needs llama-cpp-python: pip install 'specdec-trt[peers]'")
    if peers and engines is not None and peer_gguf is None:
        raise click.UsageError("--engines with --peers needs --peer-gguf: the same weights as a GGUF file")
    directory = engines or default_engines_shown(console)
    tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
    prompts = interleaved_prompt_texts(tokenizer)
    methods = [ours(draft_length(k)) for k in draft_lengths.split(",")]
    if peers:
        methods += [peer(LLAMA, tokenizer.eos_token_id), peer(LLAMA_LOOKUP, tokenizer.eos_token_id)]
    logs = Path(tempfile.mkdtemp(prefix="bench_server_"))  # each server's output, named when one fails
    n_ctx = 2048
    with ExitStack() as stack:
        urls = {}
        port = free_port()
        argv = specdec_serve_argv(directory, port, threads, max_batch_size)
        with console.status("Starting specdec-serve…"):
            urls[OURS] = stack.enter_context(running(OURS, argv, port, "/health", logs / "specdec.log")).url
        if peers:
            gguf = peer_gguf or default_model_f32(default_engine_dir().parent / "smollm2-135m-f32.gguf")
            for name, lookup in ((LLAMA, None), (LLAMA_LOOKUP, lookup_tokens)):
                port = free_port()
                argv = llama_cpp_argv(gguf, port, threads, lookup, n_ctx)
                with console.status(f"Starting {name}…"):
                    log = logs / f"{name.replace(' ', '_')}.log"
                    urls[name] = stack.enter_context(running(name, argv, port, "/v1/models", log)).url
        clients = {name: stack.enter_context(httpx.Client(base_url=url, timeout=600)) for name, url in urls.items()}

        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        def sender(method: Method) -> Callable[[str], RequestTiming]:
            def send(prompt: str) -> RequestTiming:
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **method.extra}
                return stream_completion(clients[method.server], body, count_tokens)[0]

            return send

        for method in methods:  # warm-up: first requests pay for allocations and thread pools
            closed_loop(sender(method), prompts[:2], 2)
        loads = [("concurrency", c) for c in parse_list(concurrency, int)]
        loads += [("rate", r) for r in parse_list(rates, float)]
        results = []
        for turn, (kind, level) in enumerate(loads):
            batch = [prompts[(turn * requests + i) % len(prompts)] for i in range(requests)]
            runs: dict[str, list[dict]] = {method.name: [] for method in methods}
            for repeat in range(repeats):
                start = (turn + repeat) % len(methods)
                for method in methods[start:] + methods[:start]:
                    with console.status(f"{kind} {level}: {method.name} ({repeat + 1}/{repeats})…"):
                        send = sender(method)
                        if kind == "concurrency":
                            timings, wall = closed_loop(send, batch, level)
                        else:
                            timings, wall = open_loop(send, batch, level, seed=turn)
                    runs[method.name].append(load_summary(timings, wall))
            row = {"load": kind, "level": level, "methods": {name: median_run(r) for name, r in runs.items()}}
            results.append(row)
            console.print(table(row, [m.name for m in methods]))
    data = {
        "command": "scripts/bench_server.py",
        "environment": environment("cpu", threads),
        "settings": {
            "requests": requests,
            "repeats": repeats,
            "max_tokens": max_tokens,
            "threads": threads,
            "max_batch_size": max_batch_size,
            "lookup_tokens": lookup_tokens,
            "peers": peers,
        },
        "loads": results,
        "summary": summary(results, [m.name for m in methods]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    draw(results, [m.name for m in methods], plot)
    console.print(json.dumps(data["summary"], indent=2))
    console.print(f"Wrote {out} and {plot}")


def table(row: dict, names: list[str]) -> Table:
    unit = "clients" if row["load"] == "concurrency" else "requests/s"
    out = Table(title=f"{row['level']} {unit}")
    for column in ("method", "tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 ms"):
        out.add_column(column, justify="left" if column == "method" else "right")
    for name in names:
        m = row["methods"][name]
        out.add_row(
            name,
            f"{m['tokens_per_s_median']:.1f}",
            *(f"{m[key]['p50_ms']:.0f} / {m[key]['p99_ms']:.0f}" for key in ("ttft", "itl", "e2e")),
        )
    return out


def summary(results: list[dict], names: list[str]) -> dict:
    """At each load: auto against the best of plain and fixed k (their medians, and turn by turn); and ours
    against llama.cpp plain."""
    ours_fixed = [n for n in names if n.startswith(OURS) and not n.endswith("auto")]
    rows = []
    for row in results:
        rate = {name: row["methods"][name]["tokens_per_s_median"] for name in names}
        entry = {"load": row["load"], "level": row["level"]}
        if f"{OURS} k=auto" in rate and ours_fixed:
            compared = against_best(row["methods"], f"{OURS} k=auto", ours_fixed)
            entry |= {"best_fixed": compared["best"], "auto_over_best_fixed": compared["ratio_of_medians"]}
            entry |= {"auto_over_best_fixed_per_turn": {k: v for k, v in compared.items() if "turn" in k}}
        if LLAMA in rate:
            ours_best = max((n for n in names if n.startswith(OURS)), key=rate.get)
            entry |= {"best_ours": ours_best, "best_ours_over_llama_cpp": round(rate[ours_best] / rate[LLAMA], 3)}
            entry |= {"auto_over_llama_cpp": round(rate.get(f"{OURS} k=auto", 0) / rate[LLAMA], 3)}
        rows.append(entry)
    return {"per_load": rows}


def draw(results: list[dict], names: list[str], path: Path) -> None:
    """Tokens/s and p99 end-to-end latency against load, closed-loop and Poisson side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for column, kind in enumerate(("concurrency", "rate")):
        rows = [r for r in results if r["load"] == kind]
        levels = [r["level"] for r in rows]
        for name in names:
            rates = [r["methods"][name]["tokens_per_s_median"] for r in rows]
            axes[0][column].plot(levels, rates, marker="o", label=name)
            p99 = [r["methods"][name]["e2e"]["p99_ms"] / 1e3 for r in rows]
            axes[1][column].plot(levels, p99, marker="o", label=name)
        label = "closed-loop clients" if kind == "concurrency" else "Poisson arrivals (requests/s)"
        axes[0][column].set(xlabel=label, ylabel="total tokens/s")
        axes[1][column].set(xlabel=label, ylabel="p99 end-to-end latency (s)")
    axes[0][0].legend(fontsize=8)
    figure.suptitle("Serving under load: total tokens/s and p99 latency")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
