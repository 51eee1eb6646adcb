"""Sampled decoding with top-k/top-p warped from the top scores first, against sorting the whole vocabulary.

On the default engines, suite prompts (code, chat, summarisation in turn) are generated sampled, plain and with
the engine's own draft at a fixed length, once with ``sampling.CANDIDATE_WIDTHS`` as shipped and once with none
(every warping sorts the whole vocabulary); the two take turns each round. Decode tokens/s of the median prompt.

    .venv/bin/python scripts/bench_warping.py --out results/warping.json
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from benchlib.shared_target import decode_tokens_per_s, decoder_on
from specdec_trt import SamplingParams, sampling
from specdec_trt.bench.environment import environment
from specdec_trt.bench.suites import interleaved_prompt_texts
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.loading import open_engine_directory
from specdec_trt.policy import default_engine_dir

PATHS = {"whole sort": (), "top scores first": sampling.CANDIDATE_WIDTHS}


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="JSON results file.")
@click.option("--prompts", default=6, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("-n", "--max-new-tokens", default=96, show_default=True)
@click.option("-k", "--num-draft-tokens", default=4, show_default=True)
@click.option("--temperature", default=0.7, show_default=True)
@click.option("--top-p", default=0.95, show_default=True)
@click.option("--top-k", default=0, show_default=True)
def main(out: Path, prompts: int, rounds: int, max_new_tokens: int, num_draft_tokens: int, **warping) -> None:
    loaded = open_engine_directory(default_engine_dir(), [DraftSpec.parse("engine")])
    label = next(iter(loaded.drafters))

    decoders = {
        "plain": decoder_on(loaded, None, 0),
        f"{label}, k={num_draft_tokens}": decoder_on(loaded, label, num_draft_tokens),
    }
    texts = interleaved_prompt_texts(decoders["plain"].tokenizer)[:prompts]
    rates: dict[str, dict[str, list[float]]] = {path: {name: [] for name in decoders} for path in PATHS}
    for turn in range(rounds):
        for path in list(PATHS) if turn % 2 == 0 else list(reversed(PATHS)):
            sampling.CANDIDATE_WIDTHS = PATHS[path]
            for name, decoder in decoders.items():
                for seed, text in enumerate(texts):
                    params = SamplingParams(max_new_tokens=max_new_tokens, seed=seed, ignore_eos=True, **warping)
                    rates[path][name].append(decode_tokens_per_s(decoder.generate(text, params).stats))
            click.echo(f"round {turn + 1}/{rounds}: {path} done", err=True)
    medians = {path: {name: statistics.median(v) for name, v in by_name.items()} for path, by_name in rates.items()}
    table = Table(title=f"Sampled decode tokens/s (median prompt), {warping}")
    table.add_column("method")
    for path in PATHS:
        table.add_column(path)
    for name in decoders:
        table.add_row(name, *(f"{medians[path][name]:.1f}" for path in PATHS))
    Console().print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"prompts": len(texts), "rounds": rounds, "max_new_tokens": max_new_tokens, **warping}
    result = {"environment": environment("cpu", loaded.threads), "settings": settings, "median": medians, "runs": rates}
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
