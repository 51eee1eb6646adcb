"""Many requests at once on the default model: continuous batching with speculative decoding under load.

Closed-loop clients at each concurrency send mixed code, chat and summarisation prompts (128 new tokens, EOS
ignored so every method makes as many) to one ``SpeculativeDecoder`` (the default engines, lookup-first with
the int4 self-draft), greedy and sampled. Per concurrency, the methods (plain decoding k=0, fixed k, auto)
take turns, repeat after repeat and each first in turn, so drifting machine load hits all of them alike; each
turn samples with seeds of its own, the same for every method, so that a sampled cell averages over draws of
text rather than repeating one draw per method (a draw's acceptance alone moves tokens/s by more than the
targets' 3%: docs/MEASUREMENTS.md). It reports total output tokens/s, time to first token and inter-token
latency p50/p99, and auto against the best other method and against plain, by medians and turn by turn (the
turns' geometric mean with its standard error); beside them, the same requests served one after another.
Then: a 1,500-token prompt admitted next to three streaming requests (their inter-token latency while it is
prefilled in chunks), and the measured cost of a verify pass and a draft step against the number of rows.
Everything is printed and written as JSON.

    .venv/bin/python scripts/bench_serving.py --out results/bench_serving.json
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from benchlib.load import (
    RequestTiming,
    against_best,
    closed_loop,
    load_summary,
    median_run,
    percentiles,
    timed,
)
from benchlib.timing import step_seconds
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.environment import environment
from specdec_trt.bench.suites import load_suite
from specdec_trt.build_progress import default_engines_shown
from specdec_trt.costs import RowLines
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.loading import open_engine_directory

SUITES = ("code", "chat", "summarisation")
LONG_PROMPT_TOKENS = 1500


def parse_methods(text: str) -> list:
    return [item if item == "auto" else int(item) for item in text.split(",")]


@click.command()
@click.option(
    "--engines", type=click.Path(exists=True, file_okay=False, path_type=Path), help="[default: the default engines]"
)
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Closed-loop clients, comma-separated.")
@click.option("--methods", default="0,2,4,auto", show_default=True, help="Draft lengths to compare (0: plain).")
@click.option("--temperatures", default="0,0.8", show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--requests-per-client", default=2, show_default=True, help="Requests per client (at least 4 in all).")
@click.option("--repeats", default=2, show_default=True, help="Turns of every method per setting.")
@click.option("--max-batch-size", default=8, show_default=True, help="Slots of the scheduler.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench_serving.json"), show_default=True)
def main(
    engines: Path | None,
    concurrency: str,
    methods: str,
    temperatures: str,
    max_new_tokens: int,
    requests_per_client: int,
    repeats: int,
    max_batch_size: int,
    out: Path,
) -> None:
    """Serve closed-loop clients at several concurrencies with plain, fixed and auto draft lengths."""
    console = Console(stderr=True)
    directory = engines or default_engines_shown(console)
    decoder = decoder_for(directory, max_batch_size)
    prompts = mixed_prompts(decoder)
    decoder.generate(prompts[0], SamplingParams(max_new_tokens=8), "auto")  # warm-up: the scheduler's profile
    levels = [int(c) for c in concurrency.split(",")]
    gammas = parse_methods(methods)
    data: dict = {
        "command": "scripts/bench_serving.py",
        "environment": environment("cpu", torch.get_num_threads()),
        "settings": {"max_new_tokens": max_new_tokens, "max_batch_size": max_batch_size, "repeats": repeats},
        "load": [],
    }
    for temperature in (float(t) for t in temperatures.split(",")):
        for level in levels:
            count = max(4, level * requests_per_client)
            runs: dict = {str(k): [] for k in gammas}
            serial: dict = {str(k): [] for k in gammas}
            for turn in range(repeats):
                # fresh seeds each turn, the same for every method: with one seed set, a fixed k would sample
                # the same texts turn after turn, and a cell would compare one draw of texts per method
                batch = [request(prompts, i, temperature, max_new_tokens, seed=turn * count + i) for i in range(count)]
                start = turn % len(gammas)  # each method in each place in turn: none always follows the same
                for k in gammas[start:] + gammas[:start]:
                    console.print(f"t={temperature} concurrency {level} k={k}")
                    runs[str(k)].append(load_summary(*closed_loop(sender(decoder, k), batch, level)))
                    if level == 4:  # the same requests, one after another, as a decoder without batching serves them
                        serial[str(k)].append(load_summary(*closed_loop(sender(decoder, k), batch, 1)))
            medians = {k: median_run(r) for k, r in runs.items()}
            row = {"temperature": temperature, "concurrency": level, "methods": medians}
            others = [str(k) for k in gammas if k != "auto"]
            if "auto" in medians and others:
                row["auto_against_best"] = against_best(medians, "auto", others)
            if "auto" in medians and "0" in medians:
                row["auto_against_plain"] = against_best(medians, "auto", ["0"])
            if level == 4:
                row["serial"] = {k: median_run(r) for k, r in serial.items()}
            data["load"].append(row)
            write(out, data)
    data["long_prompt"] = long_prompt_interference(decoder, prompts, max_new_tokens)
    write(out, data)
    data["round_cost"] = round_costs(directory, max_batch_size)
    data["fitted"] = fitted_lines(decoder)
    write(out, data)
    print_tables(data, gammas)
    console.print(f"Wrote {out}")


def decoder_for(directory: Path, max_batch_size: int) -> SpeculativeDecoder:
    loaded = open_engine_directory(directory, [DraftSpec.parse("ngram+engine")])
    return SpeculativeDecoder.from_loaded(loaded, max_batch_size=max_batch_size)


def mixed_prompts(decoder: SpeculativeDecoder) -> list[list[int]]:
    """The suites' prompts as token ids, interleaved code, chat, summarisation, ..."""
    suites = [load_suite(name).prompts for name in SUITES]
    encoded = []
    for group in zip(*suites):
        for prompt in group:
            text = decoder.apply_chat_template(prompt.prompt) if prompt.chat else prompt.prompt
            encoded.append(decoder.tokenize(text))
    return encoded


def request(prompts: list[list[int]], index: int, temperature: float, max_new_tokens: int, seed: int) -> tuple:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, ignore_eos=True)
    return prompts[index % len(prompts)], params


def sender(decoder: SpeculativeDecoder, k):
    def send(item: tuple) -> RequestTiming:
        prompt, params = item
        stream = decoder.stream(prompt, params, k)
        timing, _ = timed(stream)
        timing.tokens = stream.output.stats.generated_tokens
        return timing

    return send


def long_prompt_interference(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Three greedy streams with auto; once all three decode, a 1,500-token prompt arrives. Their inter-token
    latency from then on, and while that prompt was being prefilled (submission to its first piece). The
    readers never wait on each other, so no piece waits unread and no gap is a reader's own pause."""
    params = SamplingParams(max_new_tokens=2 * max_new_tokens, ignore_eos=True)
    timings: list[RequestTiming] = []
    first_pieces = threading.Semaphore(0)  # released by each reader at its first piece

    def read(prompt: list[int]) -> None:
        timing = RequestTiming(time.perf_counter())
        for index, _ in enumerate(decoder.stream(prompt, params, "auto")):
            timing.arrivals.append(time.perf_counter())
            if index == 0:
                first_pieces.release()
        timings.append(timing)

    readers = [threading.Thread(target=read, args=(prompts[i],)) for i in range(3)]
    for reader in readers:
        reader.start()
    for _ in readers:
        first_pieces.acquire()
    decoding = time.perf_counter()
    long = [t for p in prompts for t in p][:LONG_PROMPT_TOKENS]
    arriving = decoder.stream(long, SamplingParams(max_new_tokens=16, ignore_eos=True), "auto")
    arrival, _ = timed(arriving)
    for reader in readers:
        reader.join()
    window = (arrival.sent, arrival.arrivals[0])
    pairs = [(a, b) for t in timings for a, b in zip(t.arrivals, t.arrivals[1:]) if a >= decoding]
    gaps = [b - a for a, b in pairs]
    during = [b - a for a, b in pairs if window[0] <= b <= window[1] + 1e-3]
    whole, inside = percentiles(gaps), percentiles(during)
    worst = max(whole["p99_ms"], inside["p99_ms"] or 0)
    return {
        "prompt_tokens": len(long),
        "prefill_s": round(window[1] - window[0], 3),
        "itl_all": whole,
        "itl_during_prefill": inside,
        "gaps_during_prefill": len(during),
        "p99_over_median": round(worst / whole["p50_ms"], 2),
    }


def round_costs(directory: Path, rows_up_to: int) -> list[dict]:
    """Seconds of the target's verify pass (1 and 5 new tokens a row) and of the self-draft's step, against
    the number of rows, after 200 cached tokens each."""
    loaded = open_engine_directory(directory, [DraftSpec.parse("engine")])
    target, draft = loaded.target, loaded.only_drafter().engine
    table = []
    for rows in range(1, rows_up_to + 1):
        table.append(
            {
                "rows": rows,
                "verify_1_ms": round(1e3 * step_seconds(target, 200, 1, repeats=5, rows=rows), 2),
                "verify_5_ms": round(1e3 * step_seconds(target, 200, 5, repeats=5, rows=rows), 2),
                "draft_step_ms": round(1e3 * step_seconds(draft, 200, 1, repeats=5, rows=rows), 2),
            }
        )
    return table


def fitted_lines(decoder: SpeculativeDecoder) -> dict:
    """The cost lines auto fitted online: of the target's verify passes per number of rows, without and with a
    prefill chunk riding in them, and of each kind of draft's drafting."""
    planner = decoder.scheduler.planner

    def lines(row_lines: RowLines) -> dict:
        return {n: [round(c, 5) for c in line.coefficients()] for n, line in row_lines.lines.items()}

    def means(row_lines: RowLines) -> dict:
        return {n: round(line.coefficients()[0], 5) for n, line in row_lines.lines.items()}

    verify, beside_chunk = planner.costs.verify, planner.costs.verify_beside_chunk
    return {
        "verify": lines(verify.drafting),
        "plain": means(verify.plain),
        "verify_with_chunk": lines(beside_chunk.drafting),
        "plain_with_chunk": means(beside_chunk.plain),
        "draft": {kind: lines(controller.drafting) for kind, controller in planner.controllers.items()},
    }


def write(out: Path, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))


def ratio_cell(compared: dict | None) -> str:
    """An ``against_best`` result in a table cell."""
    if compared is None:
        return "-"
    spread = f"{compared['lowest_turn_ratio']:.3f}-{compared['highest_turn_ratio']:.3f}"
    mean = f"{compared['geometric_mean_turn_ratio']:.3f} +- {compared['geometric_mean_standard_error']:.3f}"
    return (
        f"{compared['ratio_of_medians']:.3f} vs {compared['best']}; {compared['median_turn_ratio']:.3f} ({spread}); "
        f"{mean}"
    )


def print_tables(data: dict, gammas: list) -> None:
    console = Console(width=180)
    for temperature in sorted({row["temperature"] for row in data["load"]}):
        table = Table(title=f"total output tokens/s (TTFT p50 / ITL p50 / ITL p99 ms), t={temperature}")
        table.add_column("concurrency")
        for k in gammas:
            table.add_column("plain" if k == 0 else f"k={k}")
        table.add_column("auto / best other: medians; per turn, median (lowest-highest); geometric mean +- s.e.")
        table.add_column("auto / plain, the same")
        for row in (r for r in data["load"] if r["temperature"] == temperature):
            cells = []
            for k in gammas:
                m = row["methods"][str(k)]
                latencies = f"{m['ttft']['p50_ms']:.0f}/{m['itl']['p50_ms']:.0f}/{m['itl']['p99_ms']:.0f}"
                cells.append(f"{m['tokens_per_s_median']:.1f} ({latencies})")
            ratios = [ratio_cell(row.get(key)) for key in ("auto_against_best", "auto_against_plain")]
            table.add_row(str(row["concurrency"]), *cells, *ratios)
        console.print(table)
        for row in (r for r in data["load"] if r["temperature"] == temperature and "serial" in r):
            for k in gammas:
                batched, serial = (
                    row["methods"][str(k)]["tokens_per_s_median"],
                    row["serial"][str(k)]["tokens_per_s_median"],
                )
                ratio = batched / serial
                console.print(f"concurrency 4, k={k}: {batched:.1f} tok/s; one at a time {serial:.1f} ({ratio:.2f}x)")
    console.print(f"long prompt: {data['long_prompt']}")
    cost = Table(title="cost of a round's parts against rows (ms)")
    for name in ("rows", "verify_1_ms", "verify_5_ms", "draft_step_ms"):
        cost.add_column(name)
    for row in data["round_cost"]:
        cost.add_row(*(str(row[name]) for name in ("rows", "verify_1_ms", "verify_5_ms", "draft_step_ms")))
    console.print(cost)


if __name__ == "__main__":
    main()
