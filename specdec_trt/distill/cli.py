"""``specdec-distill``: train a distilled draft for a target and write it as a checkpoint directory. torch and the
training code are imported once the options have parsed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from specdec_trt.cli_options import SEED, Command, FiniteFloat, ThreadCount, number_list

if TYPE_CHECKING:
    from specdec_trt.distill.pipeline import DistillConfig, DistillReport


@click.command(cls=Command)
@click.option("--out", "-o", type=click.Path(path_type=Path), required=True, help="Directory for the draft checkpoint.")
@click.option(
    "--target",
    type=click.Path(exists=True, path_type=Path),
    help="Target checkpoint directory or .gguf file. [default: the embedded SmolLM2-135M-Instruct]",
)
@click.option("--num-layers", type=click.IntRange(min=1), default=2, help="Decoder layers of the draft.")
@click.option(
    "--init-layers",
    callback=number_list(int, 0),
    help="Target layers the draft's layers start from, comma-separated. [default: the first --num-layers]",
)
@click.option(
    "--draft-vocab-size",
    type=click.IntRange(min=0),
    default=8192,
    help="Score only the N tokens the target emits most often (q = 0 for the rest, still lossless); 0 keeps "
    "the whole vocabulary.",
)
@click.option(
    "--prompts",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL file of {id, prompt, chat} prompts the target continues (repeatable). [default: the shipped "
    "seed prompts]",
)
@click.option(
    "--text",
    "texts",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="Plain-text file, or directory of .py/.md/.rst/.txt files, to train on as is (repeatable).",
)
@click.option(
    "--max-text-tokens",
    type=click.IntRange(min=1),
    help="Take at most N tokens of the --text files (whole files in a seeded random order). [default: all]",
)
@click.option(
    "--self-generate/--no-self-generate",
    default=True,
    help="Train on the target's own continuations of the prompts (needs no dataset).",
)
@click.option(
    "--temperatures",
    callback=number_list(float, 0),
    default="0,0.8",
    help="One continuation per prompt at each of these temperatures; 0 is greedy.",
)
@click.option("--continuation-tokens", type=click.IntRange(min=1), default=192, help="Tokens per continuation.")
@click.option("--max-prompts", type=click.IntRange(min=1), help="Use only the first N prompts.")
@click.option("--seq-len", type=click.IntRange(min=8), default=256, help="Tokens per training chunk.")
@click.option("--label-top-k", type=click.IntRange(min=1), default=64, help="Teacher logits kept per position.")
@click.option(
    "--holdout-fraction",
    type=float,
    default=0.05,
    help="Share of prompts (all their continuations) and of text files (whole) held out for evaluation.",
)
@click.option("--steps", type=click.IntRange(min=1), default=1500, help="Optimiser steps.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, help="Chunks per step.")
@click.option("--learning-rate", "--lr", type=FiniteFloat(min=0, min_open=True), default=2e-3)
@click.option("--warmup-steps", type=click.IntRange(min=0), default=30)
@click.option(
    "--kd-temperature",
    type=FiniteFloat(min=0, min_open=True),
    default=1.0,
    help="Temperature of both distributions in the KL loss (e.g. the sampling temperature you serve at).",
)
@click.option("--eval-every", type=click.IntRange(min=1), default=100, help="Held-out evaluation and state save.")
@click.option("--seed", type=SEED, default=0, help="Seeds sampling, the split and batch order.")
@click.option("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
@click.option("--threads", type=ThreadCount(), help="torch CPU threads. [default: torch's]")
@click.option("--generate-batch-size", type=click.IntRange(min=1), default=32, help="Rows per generation batch.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in --out (same settings).")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
def distill_command(**options) -> None:
    """Train a small draft model for a target by knowledge distillation, and write it as a Hugging Face
    checkpoint directory for `specdec-build --draft DIR`.

    The draft starts from a few of the target's layers and reuses its embeddings and output head; it learns
    the target's next-token distributions (forward KL over the teacher's top-k) on the target's own
    continuations of prompts and on any text you give. A held-out estimate of the acceptance rate
    (sum of min(p, q)) and of the greedy match rate is shown as it trains. Interrupted runs resume with
    --resume.

    \b
    Example (the embedded SmolLM2-135M-Instruct, about 40 minutes on 2 CPU cores):
      specdec-distill --out drafts/smollm2-distilled
      specdec-build --draft drafts/smollm2-distilled --out engines/smollm2-distilled
      specdec-run --engines engines/smollm2-distilled "Write a haiku about caches."
    """
    import torch

    from specdec_trt.distill.pipeline import DataSettings, DistillConfig
    from specdec_trt.distill.trainer import TrainSettings

    err = Console(stderr=True)
    if options["threads"]:
        torch.set_num_threads(options["threads"])
    config = DistillConfig(
        out=options["out"],
        target=options["target"],
        num_layers=options["num_layers"],
        init_layers=options["init_layers"],
        draft_vocab_size=options["draft_vocab_size"],
        data=DataSettings(
            prompts=tuple(str(p) for p in options["prompts"]),
            texts=tuple(str(t) for t in options["texts"]),
            max_text_tokens=options["max_text_tokens"],
            self_generate=options["self_generate"],
            temperatures=options["temperatures"],
            continuation_tokens=options["continuation_tokens"],
            max_prompts=options["max_prompts"],
            seq_len=options["seq_len"],
            label_top_k=options["label_top_k"],
            holdout_fraction=options["holdout_fraction"],
        ),
        train=TrainSettings(
            steps=options["steps"],
            batch_size=options["batch_size"],
            learning_rate=options["learning_rate"],
            warmup_steps=options["warmup_steps"],
            kd_temperature=options["kd_temperature"],
            eval_every=options["eval_every"],
            seed=options["seed"],
        ),
        device=options["device"],
        generate_batch_size=options["generate_batch_size"],
        resume=options["resume"],
        force=options["force"],
    )
    report = _run_with_progress(config, err)
    err.print(_report_table(report))
    click.echo(f"draft written to {config.out}; next: specdec-build --draft {config.out} --out engines/NAME")


def _run_with_progress(config: DistillConfig, err: Console) -> DistillReport:
    from specdec_trt.distill.pipeline import distill

    columns = (
        TextColumn("{task.description:<9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[figures]}"),
    )
    with Progress(*columns, console=err) as progress:
        tasks: dict[str, int] = {}
        logged: dict[str, int] = {}

        def on_stage(stage: str, done: int, total: int, figures: dict) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total, figures="")
            shown = "  ".join(f"{name} {value:.3f}" for name, value in figures.items())
            progress.update(tasks[stage], completed=done, total=total, figures=shown)
            tenth = 10 * done // max(total, 1)
            if not err.is_terminal and logged.get(stage) != tenth:  # a log file gets a line per tenth
                logged[stage] = tenth
                err.log(f"{stage} {done}/{total} {shown}")

        return distill(config, on_stage)


def _report_table(report: DistillReport) -> Table:
    table = Table(title="held-out evaluation (temperature 1)")
    for column in ("step", "KL", "acceptance sum min(p,q)", "greedy match"):
        table.add_column(column, justify="right")
    for e in report.evaluations:
        step = f"{e.step} (written)" if e.step == report.best_step else str(e.step)
        table.add_row(step, f"{e.kl:.3f}", f"{e.acceptance:.3f}", f"{e.greedy_match:.3f}")
    table.caption = (
        f"layers {report.layers}, draft vocabulary {report.draft_vocab_size} (covers "
        f"{report.draft_vocab_coverage:.1%} of the target's top-1 mass), {report.train_tokens} training tokens, "
        + ", ".join(f"{stage} {s:.0f} s" for stage, s in report.seconds.items())
    )
    return table
