"""Command-line interface: ``specdec-run``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdec_trt.build import PRESETS, QUANTIZATIONS, STAGES, BuildRequest, build, default_engine_dir
from specdec_trt.build_engines.manifest import SCHEMA_VERSION, read_manifest, schema_version_of
from specdec_trt.decoder import AUTO, DEFAULT_NUM_DRAFT_TOKENS, DraftLength, GenerationOutput, SpeculativeDecoder
from specdec_trt.runtime.ort_engine import PROVIDERS
from specdec_trt.sampling import SamplingParams

# What engines with a draft run by default, with the draft length chosen every round: prompt lookup where the
# text repeats itself, the engines' draft elsewhere (README, "Measured": against the draft alone, faster on three
# suites, equal on chat; against prompt lookup alone, faster on chat and summaries, slower on code and long prompts).
ENGINES_DEFAULT_DRAFT = "ngram+engine"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TORCH_ONLY = ("device", "dtype", "max_context", "enforce_eager", "compile")
_ONNX_ONLY = ("provider", "threads")
ENFORCE_EAGER_HELP = (
    "With --target on a CUDA device: launch every kernel from Python instead of replaying CUDA graphs "
    "(slower; for debugging, as vLLM's --enforce-eager)."
)
COMPILE_HELP = (
    "With --target: compile the engines' decoder layers with torch.compile, which fuses each layer's small "
    "kernels: on a GPU, steps 1.6x as fast as CUDA graphs alone, after about 15 s of compiling in the first "
    "steps (see the README)."
)


class DraftLengthType(click.ParamType):
    """A number of drafts per round (an integer from 0 to 64) or "auto"."""

    name = "INTEGER|auto"

    def convert(self, value, param, ctx) -> DraftLength:
        text = str(value).strip()
        if text == AUTO:
            return AUTO
        if text.isdigit() and int(text) <= 64:
            return int(text)
        self.fail(f"{value!r} is neither a draft length (an integer from 0 to 64) nor {AUTO!r}", param, ctx)


def number_list(kind: type, minimum: float):
    """A click callback parsing a comma-separated list of numbers >= minimum."""

    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple | None:
        if value is None:
            return None
        try:
            numbers = tuple(kind(item) for item in value.split(",") if item.strip())
        except ValueError as err:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of {kind.__name__}s") from err
        if not numbers or any(n < minimum for n in numbers):
            raise click.BadParameter(f"{value!r}: give one or more values, each >= {minimum}")
        return tuple(dict.fromkeys(numbers))

    return parse


engines_option = click.option(
    "--engines",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Engine directory built by specdec-build, run on ONNX Runtime. With neither --engines nor "
    "--target: the default engines (SmolLM2-135M-Instruct with its int4 self-draft), built on first use.",
)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("prompt", required=False)
@engines_option
@click.option(
    "--target",
    type=click.Path(exists=True, path_type=Path),
    help="Target checkpoint, run on the PyTorch engine: a Hugging Face directory (config.json + "
    "safetensors + tokenizer) or a .gguf file.",
)
@click.option(
    "--draft",
    help="With --target: a checkpoint directory or .gguf file sharing the target's vocabulary (default "
    "'ngram'). With engines: 'engine', the directory's own draft. Either way 'ngram' is prompt lookup (no "
    "model), 'none' plain target-only decoding, and 'ngram+' before a model draft ('ngram+engine', "
    "'ngram+DIR') drafts by prompt lookup where the text so far repeats itself, with the model elsewhere. "
    "[default: with engines that have a draft, 'ngram+engine' with -k auto; else 'engine' or 'ngram']",
)
@click.option(
    "--num-draft-tokens",
    "-k",
    type=DraftLengthType(),
    help="Tokens drafted per round (gamma); 0 is plain decoding on the same engine; 'auto' chooses gamma "
    "every round from the acceptance and costs measured so far (up to what the engines were built for, or "
    "8 with --target), and a round stops where the draft's calibrated confidence (prompt lookup's: how long "
    "the repeat it copies has run) says one more token no longer pays. "
    "[default: auto for the default draft of engines (see --draft); else 5, at most what the engines were "
    "built for]",
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
@click.option(
    "--provider", type=click.Choice(sorted(PROVIDERS)), help="ONNX Runtime provider (engines). [default: cpu]"
)
@click.option("--threads", type=click.IntRange(min=1), help="ONNX Runtime intra-op threads (engines).")
@click.option("--device", help="torch device with --target: cpu, cuda, cuda:1, ... [default: cpu]")
@click.option(
    "--dtype", type=click.Choice(sorted(DTYPES)), help="Weight and KV dtype with --target. [default: float32]"
)
@click.option(
    "--max-context",
    type=click.IntRange(min=8),
    help="KV cache positions with --target; prompt + new tokens + draft tokens must fit. "
    "Default: the model's limit, at most 4096.",
)
@click.option("--enforce-eager", is_flag=True, default=None, help=ENFORCE_EAGER_HELP)
@click.option("--compile", "compile_steps", is_flag=True, default=None, help=COMPILE_HELP)
def run(
    prompt: str | None,
    engines: Path | None,
    target: Path | None,
    draft: str | None,
    num_draft_tokens: DraftLength | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    stop: tuple[str, ...],
    chat: bool,
    as_json: bool,
    provider: str | None,
    threads: int | None,
    device: str | None,
    dtype: str | None,
    max_context: int | None,
    enforce_eager: bool | None,
    compile_steps: bool | None,
) -> None:
    """Generate from PROMPT with lossless speculative decoding, streaming text to stdout and a stats table
    to stderr. PROMPT '-' (or none, with piped input) reads standard input.

    \b
    Examples:
      specdec-run --chat "What is speculative decoding?"
      specdec-run --engines engines/my-llama -k 4 -t 0.8 --top-p 0.95 --seed 1 "Once upon a time"
      specdec-run --engines engines/my-llama -k auto "Once upon a time"
      specdec-run --target ./llama-1b --draft ./llama-160m "Once upon a time"
    """
    options = {
        "provider": provider,
        "threads": threads,
        "device": device,
        "dtype": dtype,
        "max_context": max_context,
        "enforce_eager": enforce_eager,
        "compile": compile_steps,
    }
    check_backend_options(engines, target, options)
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
        if target is None and engines is None:
            engines = default_engines(err)
        with err.status("Loading models…"):
            if target is not None:
                decoder = SpeculativeDecoder.from_pretrained(
                    target,
                    draft or "ngram",
                    num_draft_tokens=DEFAULT_NUM_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens,
                    device=device or "cpu",
                    dtype=DTYPES[dtype or "float32"],
                    max_context=max_context,
                    cuda_graphs=False if enforce_eager else None,
                    compiled=bool(compile_steps),
                )
            else:
                if draft is None and read_manifest(engines, verify_files=False).draft is not None:
                    draft = ENGINES_DEFAULT_DRAFT
                    num_draft_tokens = AUTO if num_draft_tokens is None else num_draft_tokens
                decoder = SpeculativeDecoder.from_engines(
                    engines,
                    draft or "engine",
                    num_draft_tokens=num_draft_tokens,
                    provider=provider or "cpu",
                    threads=threads,
                )
        if chat:
            text = decoder.apply_chat_template(text)
        if compile_steps:
            err.print("[dim]torch.compile compiles the layers during the first steps (about 15 s on a GPU)…[/dim]")
        label = draft or ("ngram" if target is not None else "engine")
        if as_json:
            output = decoder.generate(text, params)
            click.echo(json.dumps(_as_json(output, decoder.num_draft_tokens, label), indent=2))
            return
        stream = decoder.stream(text, params)
        for piece in stream:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    err.print(_stats_table(stream.output, decoder.num_draft_tokens, label))


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--target", help="Target: a Hugging Face checkpoint directory or a .gguf file.")
@click.option(
    "--draft",
    help="Draft: a checkpoint directory or .gguf file sharing the target's vocabulary, 'int4' (the target "
    "block-quantized to 4 bits: no second checkpoint needed) or 'none'. [default: int4]",
)
@click.option("--max-draft-len", type=click.IntRange(1, 32), help="Most drafts per verify pass. [default: 8]")
@click.option("--max-context", type=click.IntRange(min=16), help="KV cache positions. [default: 2048]")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), help="Weight dtype. [default: float32]")
@click.option(
    "--draft-quantization",
    type=click.Choice(QUANTIZATIONS),
    help="Quantize a draft checkpoint's linear layers to 4 bits (block 32): a cheaper draft, and the output "
    "stays exactly the target's. [default: none]",
)
@click.option(
    "--target-quantization",
    type=click.Choice(QUANTIZATIONS),
    help="Quantize the target's linear layers to 4 bits (block 32): a smaller, faster target whose own "
    "output is then what decoding reproduces (for a directory used as another engine's draft). [default: none]",
)
@click.option(
    "--out", type=click.Path(path_type=Path), help="Engine directory to write. [default with --preset: engines/PRESET]"
)
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Defaults for a known model; explicit options win.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out directory.")
def build_command(
    target: str | None,
    draft: str | None,
    max_draft_len: int | None,
    max_context: int | None,
    dtype: str | None,
    draft_quantization: str | None,
    target_quantization: str | None,
    out: Path | None,
    preset: str | None,
    force: bool,
) -> None:
    """Compile a target and a draft into an engine directory for ONNX Runtime: the target with a verify
    input of 1 to max-draft-len + 1 tokens on its KV cache, the draft with the same interface.

    \b
    Examples:
      specdec-build --preset smollm2-135m
      specdec-build --target ./llama-1b --draft ./llama-160m --max-draft-len 6 --out engines/llama
      specdec-build --target model.gguf --draft int4 --out engines/model-int4-draft
      specdec-build --target model.gguf --draft drafts/distilled --draft-quantization int4 --out engines/m
    """
    given = {
        "target": target,
        "draft": draft,
        "max_draft_len": max_draft_len,
        "max_context": max_context,
        "dtype": dtype,
        "draft_quantization": draft_quantization,
        "target_quantization": target_quantization,
    }
    settings = {"draft": "int4", "max_draft_len": 8, "max_context": 2048, "dtype": "float32"}
    if preset is not None:
        settings.update(PRESETS[preset])
        out = out or Path("engines") / preset
    settings.update({key: value for key, value in given.items() if value is not None})
    if settings.get("target") is None and preset is None:
        raise click.UsageError("give --target (a checkpoint directory or .gguf file) or a --preset")
    if out is None:
        raise click.UsageError("give --out, the engine directory to write")
    err = Console(stderr=True)
    try:
        manifest = _build_with_progress(BuildRequest(out=out, force=force, **settings), err)
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    sizes = {
        role: sum(f["bytes"] for name, f in manifest.files.items() if name.startswith(role + "/"))
        for role in ("target", "draft")
    }
    target_mb, draft_mb = sizes["target"] / 1e6, sizes["draft"] / 1e6
    err.print(f"[green]Built[/green] {out}: target {target_mb:.0f} MB, draft ({manifest.draft_kind}) {draft_mb:.0f} MB")


def check_backend_options(engines: Path | None, target: Path | None, options: dict) -> None:
    """Options that belong to the other backend are an error, not silently ignored."""
    if engines is not None and target is not None:
        raise click.UsageError("--engines and --target are alternatives: give one")
    wrong = _ONNX_ONLY if target is not None else _TORCH_ONLY
    given = [f"--{name.replace('_', '-')}" for name in wrong if options.get(name) is not None]
    if given:
        backend = "the PyTorch engine (--target)" if target is not None else "ONNX Runtime engines"
        verb = "does" if len(given) == 1 else "do"
        raise click.UsageError(f"{', '.join(given)} {verb} not apply to {backend}")


def default_engines(err: Console) -> Path:
    """The default engines, built into the cache directory on first use, and again when the cached ones were
    built by a specdec-trt whose engine layout differs (another schema version)."""
    directory = default_engine_dir()
    version = schema_version_of(directory)
    if version != SCHEMA_VERSION:
        why = "first use only" if version is None else f"the cached ones have schema version {version}"
        err.print(f"Building the default engines into {directory} ({why})…")
        _build_with_progress(BuildRequest(out=directory, force=True, **PRESETS["smollm2-135m"]), err)
    return directory


def _build_with_progress(request: BuildRequest, err: Console):
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("build", total=len(STAGES))

        def on_stage(stage: str) -> None:
            progress.update(task, completed=STAGES.index(stage), description=stage)

        manifest = build(request, on_stage)
        progress.update(task, completed=len(STAGES), description="done")
    return manifest


def _read_prompt(prompt: str | None) -> str:
    if prompt not in (None, "-"):
        return prompt
    if sys.stdin.isatty():
        raise click.UsageError("give a PROMPT argument, or pipe the prompt into standard input")
    return sys.stdin.read()


def _as_json(output: GenerationOutput, num_draft_tokens: DraftLength, draft: str) -> dict:
    return {
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "draft": draft,
        "num_draft_tokens": num_draft_tokens,
        "stats": output.stats.to_dict(),
    }


def _stats_table(output: GenerationOutput, num_draft_tokens: DraftLength, draft: str) -> Table:
    stats = output.stats
    table = Table(title=f"draft={draft} k={num_draft_tokens} finish={output.finish_reason}", show_header=False)
    table.add_row("tokens (prompt / generated)", f"{stats.prompt_tokens} / {stats.generated_tokens}")
    table.add_row("tokens/s (prefill included)", f"{stats.tokens_per_s:.1f}")
    table.add_row("time to first token", f"{1e3 * stats.prefill_s:.0f} ms")
    if num_draft_tokens:
        table.add_row("acceptance rate", f"{stats.acceptance_rate:.2f}")
        table.add_row("tokens per round (tau)", f"{stats.mean_accepted_tokens:.2f}")
        table.add_row("drafts per round", f"{stats.drafts_per_round:.2f}")
        table.add_row("per-position acceptance", " ".join(f"{a:.2f}" for a in stats.per_position_acceptance))
        table.add_row(
            "draft / verify per round", f"{stats.draft_ms_per_round:.1f} / {stats.verify_ms_per_round:.1f} ms"
        )
    else:
        table.add_row("target step", f"{stats.verify_ms_per_round:.1f} ms")
    return table
