"""What one layer's attention costs against context on ONNX Runtime's CPU provider, in three formulations
(``specdec_trt.bench.attention``): GroupQueryAttention as the engines run it, ONNX's Attention over a
sequence-major cache view, and block-diagonal matrix products over the same view. Defaults are the default
model's attention (9 query heads, 3 key-value heads, head size 64, 2,048 positions) and its 30 layers.

Prints microseconds per layer for a decode step (1 new token) and a verify pass (5), each formulation's
largest difference from GroupQueryAttention's output, and what each would add to a decode step of the whole
model going from the first to the last context; writes the rows to ``--out``.

    .venv/bin/python scripts/bench_attention.py --out results/bench_attention.json
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import click

from specdec_trt.bench.attention import FORMULATIONS, AttentionBench, AttentionShape, measure
from specdec_trt.bench.environment import environment


def _integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


@click.command()
@click.option("--contexts", default="100,500,1000,1500", help="Cached positions after the step, comma-separated.")
@click.option("--widths", default="1,5", help="New tokens per step, comma-separated.")
@click.option("--layers", type=int, default=30, help="Attention blocks per graph (the model's layer count).")
@click.option("--heads", type=int, default=9)
@click.option("--kv-heads", type=int, default=3)
@click.option("--head-dim", type=int, default=64)
@click.option("--max-context", type=int, default=2048)
@click.option("--threads", type=int, help="Intra-op threads (default: one per core, as the engines).")
@click.option("--repeats", type=int, default=10)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench_attention.json"))
def main(
    contexts: str,
    widths: str,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    max_context: int,
    threads: int | None,
    repeats: int,
    out: Path,
) -> None:
    """Time the attention formulations and print their table."""
    shape = AttentionShape(heads, kv_heads, head_dim, max_context)
    threads = threads or os.cpu_count() or 1
    context_list, width_list = _integers(contexts), _integers(widths)
    if max(context_list) > max_context or min(context_list) < max(width_list):
        raise click.BadParameter(f"each context must be at least the widest step and at most {max_context}")
    rows = measure(AttentionBench(shape, layers, threads), context_list, width_list, repeats)

    print("\n| new tokens | context | " + " | ".join(f"{name} us/layer" for name in FORMULATIONS) + " | max abs diff |")
    print("|---" * (3 + len(FORMULATIONS)) + "|")
    for row in rows:
        micros = " | ".join(f"{row['us_per_layer'][name]:.0f}" for name in FORMULATIONS)
        print(f"| {row['new_tokens']} | {row['context']} | {micros} | {max(row['max_abs_diff'].values()):.1e} |")
    first, last = context_list[0], context_list[-1]
    for width in width_list:
        by_context = {row["context"]: row["us_per_layer"] for row in rows if row["new_tokens"] == width}
        growth = ", ".join(
            f"{name} {layers * (by_context[last][name] - by_context[first][name]) / 1e3:.1f} ms"
            for name in FORMULATIONS
        )
        print(f"\n{width} new token(s), {layers} layers: attention adds {growth} to a step from {first} to {last}")

    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"layers": layers, "threads": threads, "repeats": repeats, "shape": asdict(shape)}
    out.write_text(json.dumps({"environment": environment("cpu", threads), **settings, "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
