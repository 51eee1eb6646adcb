"""Command-line interface: ``specdec-run`` and ``specdec-build``. The runtime and the build pipeline (torch,
transformers, ONNX) are imported inside the commands, once the options have parsed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from specdec_trt.backend import BackendOptions
from specdec_trt.build_request import PRESETS, QUANTIZATIONS, BuildRequest
from specdec_trt.cli_options import SEED, Command, DraftLengthType, FiniteFloat, backend_options
from specdec_trt.draft_spec import DraftLength
from specdec_trt.policy import DEFAULT_DRAFT, choose_draft
from specdec_trt.user_text import check_text, read_stdin, unescape

if TYPE_CHECKING:
    from specdec_trt.request import GenerationOutput


@click.command(cls=Command)
@click.argument("prompt", required=False)
@backend_options
@click.option(
    "--draft",
    default=DEFAULT_DRAFT,
    help="With engines: 'engine', the directory's own draft, or another engine directory; on the PyTorch engine: "
    "a checkpoint directory or .gguf file sharing the target's vocabulary. Either way 'ngram' is prompt lookup "
    "(no model), 'none' plain target-only decoding, and 'ngram+' before a model draft ('ngram+engine', "
    "'ngram+DIR') drafts by prompt lookup where the text so far repeats itself, with the model elsewhere. "
    "'default' is 'ngram+engine' with -k auto for engines that have a draft, else 'ngram'. [default: default]",
)
@click.option(
    "--num-draft-tokens",
    "-k",
    type=DraftLengthType(),
    help="Tokens drafted per round (gamma); 0 is plain decoding on the same engine; 'auto' chooses gamma "
    "every round from the acceptance and costs measured so far (up to what the engines were built for, or "
    "8 on the PyTorch engine), and a round stops where the draft's calibrated confidence (prompt lookup's: "
    "how long the repeat it copies has run) says one more token no longer pays. "
    "[default: auto for the default draft of engines (see --draft); else 5, at most what the engines were "
    "built for]",
)
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128)
@click.option("--temperature", "-t", type=FiniteFloat(min=0), default=0.0, help="0 is greedy decoding.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0, help="Nucleus mass; 1 is off.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, help="Keep the k most likely tokens; 0 is off.")
@click.option(
    "--min-p",
    type=FiniteFloat(0, 1, max_open=True),
    default=0.0,
    help="Drop tokens below min_p times the top probability; 0 is off.",
)
@click.option("--seed", type=SEED, help="Seed for reproducible sampling.")
@click.option(
    "--stop",
    multiple=True,
    help="Stop string (repeatable); not included in the output. Backslash escapes are interpreted, as in PROMPT.",
)
@click.option(
    "--escape/--no-escape",
    default=True,
    help=r"Interpret backslash escapes (\n, \t, \\, \xHH, ...) in PROMPT and --stop, as llama.cpp does; "
    "standard input is always taken as it is.",
)
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the tokenizer's chat template.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats) instead of streaming."
)
def run(
    prompt: str | None,
    backend: BackendOptions,
    draft: str,
    num_draft_tokens: DraftLength | None,
    chat: bool,
    as_json: bool,
    escape: bool,
    **sampling,
) -> None:
    """Generate from PROMPT with lossless speculative decoding, streaming text to stdout and a stats table
    to stderr. PROMPT '-' (or none, with piped input) reads standard input. Backslash escapes in PROMPT and
    --stop are interpreted ("\\n" is a newline) unless --no-escape.

    \b
    Examples:
      specdec-run --chat "What is speculative decoding?"
      specdec-run --engines engines/my-llama -k 4 -t 0.8 --top-p 0.95 --seed 1 "Once upon a time"
      specdec-run --engines engines/my-llama -k auto "Once upon a time"
      specdec-run --target ./llama-1b --draft ./llama-160m "Once upon a time"
      specdec-run --device cuda --chat "Hello"
    """

    from specdec_trt.decoder import SpeculativeDecoder
    from specdec_trt.sampling import SamplingParams

    err = Console(stderr=True)
    text = _read_prompt(prompt, escape)
    if escape:
        sampling["stop"] = tuple(unescape(stop) for stop in sampling["stop"])
    params = SamplingParams(**sampling)
    backend = backend.resolved(err)
    spec, num_draft_tokens = choose_draft(backend.engines, draft, num_draft_tokens)
    with err.status("Loading models…"):
        loaded = backend.open([spec], err)
    decoder = SpeculativeDecoder.from_loaded(loaded, num_draft_tokens, draft=spec)
    if chat:
        text = decoder.apply_chat_template(text)
    if backend.compile:
        err.print("[dim]torch.compile compiles the layers during the first steps…[/dim]")
    if as_json:
        output = decoder.generate(text, params)
        click.echo(json.dumps(_as_json(output, decoder.num_draft_tokens, str(decoder.draft)), indent=2))
        return
    stream = decoder.stream(text, params)
    for piece in stream:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    err.print(_stats_table(stream.output, decoder.num_draft_tokens, str(decoder.draft)))


@click.command(cls=Command)
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
    settings = dict(PRESETS[preset]) if preset is not None else {}  # and BuildRequest's defaults
    if preset is not None:
        out = out or Path("engines") / preset
    settings.update({key: value for key, value in given.items() if value is not None})
    if target is None and preset is None:
        raise click.UsageError("give --target (a checkpoint directory or .gguf file) or a --preset")
    if out is None:
        raise click.UsageError("give --out, the engine directory to write")

    from specdec_trt.build_progress import build_with_progress

    err = Console(stderr=True)
    manifest = build_with_progress(BuildRequest(out=out, force=force, **settings), err)
    sizes = {
        role: sum(f["bytes"] for name, f in manifest.files.items() if name.startswith(role + "/"))
        for role in ("target", "draft")
    }
    target_mb, draft_mb = sizes["target"] / 1e6, sizes["draft"] / 1e6
    err.print(f"[green]Built[/green] {out}: target {target_mb:.0f} MB, draft ({manifest.draft_kind}) {draft_mb:.0f} MB")


def _read_prompt(prompt: str | None, escape: bool) -> str:
    """PROMPT (with its escapes interpreted when ``escape``), or standard input as it is."""
    if prompt not in (None, "-"):
        text = check_text(prompt, "PROMPT")
        return unescape(text) if escape else text
    if sys.stdin.isatty():
        raise click.UsageError("give a PROMPT argument, or pipe the prompt into standard input")
    return read_stdin()


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
    table.add_row("time to first token", f"{1e3 * stats.time_to_first_token_s:.0f} ms")
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
