"""What a seed costs: seeded requests (coupled verification) against unseeded ones (rejection sampling).

On the default engines (built by ``specdec-run``'s first use), each prompt of the code, chat and summarisation
suites is generated sampled, with and without a seed, by each drafter: the engine's own draft at a fixed draft
length, and the default drafter (``ngram+engine``, auto). The two modes alternate which goes first per prompt.
Acceptance (drafts accepted per draft made), tokens per round and decode tokens/s per mode; and a check that
every seeded speculative text equals the same request's plain (no drafts) text.

    .venv/bin/python scripts/bench_seeded.py --out results/seeded.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from benchlib.shared_target import decode_tokens_per_s, decoder_on
from specdec_trt import SamplingParams
from specdec_trt.bench.environment import environment
from specdec_trt.bench.suites import interleaved_prompt_texts
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.loading import open_engine_directory
from specdec_trt.policy import default_engine_dir
from specdec_trt.stats import GenerationStats

DRAFTERS = {"engine, k=4": ("engine", 4), "ngram+engine, auto": ("ngram+engine", "auto")}
MODES = ("unseeded", "seeded")


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="JSON results file.")
@click.option("--prompts", default=12, show_default=True, help="Prompts, taken in turn from the three suites.")
@click.option("-n", "--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.7, show_default=True)
@click.option("--top-p", default=0.95, show_default=True)
def main(out: Path, prompts: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    loaded = open_engine_directory(default_engine_dir(), [DraftSpec.parse(d) for d, _ in DRAFTERS.values()])
    labels = list(loaded.drafters)  # as opened, in DRAFTERS' order ("engine" is named by what it is)
    decoders = {name: decoder_on(loaded, label, k) for (name, (_, k)), label in zip(DRAFTERS.items(), labels)}
    plain = decoder_on(loaded, None, 0)
    texts = interleaved_prompt_texts(plain.tokenizer)[:prompts]
    base = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, ignore_eos=True)
    rows: dict[str, dict[str, list[dict]]] = {name: {mode: [] for mode in MODES} for name in DRAFTERS}
    mismatches, plain_runs = 0, []
    for index, text in enumerate(texts):
        seeded = dataclasses.replace(base, seed=index)
        reference = plain.generate(text, seeded)
        plain_runs.append(record(reference.stats))
        for name, decoder in decoders.items():
            for mode in MODES if index % 2 == 0 else reversed(MODES):
                torch.manual_seed(index)
                output = decoder.generate(text, seeded if mode == "seeded" else base)
                rows[name][mode].append(record(output.stats))
                if mode == "seeded" and output.token_ids != reference.token_ids:
                    mismatches += 1
        click.echo(f"prompt {index + 1}/{len(texts)} done", err=True)
    summary = {name: {mode: summarise(rows[name][mode]) for mode in MODES} for name in DRAFTERS}
    plain_summary = summarise(plain_runs)
    show(summary, plain_summary, mismatches, len(texts) * len(DRAFTERS))
    result = {
        "environment": environment("cpu", loaded.threads),
        "settings": {
            "prompts": len(texts),
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
        },
        "summary": summary,
        "plain_seeded": plain_summary,
        "seeded_texts_unequal_to_plain": mismatches,
        "runs": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def record(stats: GenerationStats) -> dict:
    """A run's figures as JSON, with its decode tokens/s."""
    return stats.to_dict() | {"decode_tokens_per_s": decode_tokens_per_s(stats)}


def summarise(runs: list[dict]) -> dict[str, float]:
    """Acceptance and tokens per round over all runs' rounds; the median run's decode tokens/s."""
    drafted = sum(r["drafted_tokens"] for r in runs)
    return {
        "acceptance": sum(r["accepted_tokens"] for r in runs) / max(drafted, 1),
        "tokens_per_round": sum(r["generated_tokens"] - 1 for r in runs) / max(sum(r["rounds"] for r in runs), 1),
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
    }


def show(summary: dict, plain: dict, mismatches: int, checked: int) -> None:
    table = Table(title="Seeded (coupled verification) against unseeded (rejection sampling)")
    for column in ("drafter", "mode", "acceptance", "tokens/round", "decode tok/s"):
        table.add_column(column)
    for name, modes in summary.items():
        for mode, figures in modes.items():
            table.add_row(
                name,
                mode,
                f"{figures['acceptance']:.3f}",
                f"{figures['tokens_per_round']:.2f}",
                f"{figures['decode_tokens_per_s']:.1f}",
            )
    table.add_row("none (plain)", "seeded", "", "1.00", f"{plain['decode_tokens_per_s']:.1f}")
    console = Console()
    console.print(table)
    console.print(f"seeded speculative texts equal to their plain text: {checked - mismatches} of {checked}")


if __name__ == "__main__":
    main()
