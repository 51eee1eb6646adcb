"""``specdec-bench``: speculative decoding side by side with plain decoding and transformers, on prompt suites. The
options parse here; ``specdec_trt.bench.session`` measures."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from specdec_trt.backend import BackendOptions
from specdec_trt.bench.agents import AGENTS
from specdec_trt.bench.methods import HEURISTIC, HEURISTIC_CONFIDENCE, HEURISTIC_START, PEERS
from specdec_trt.bench.suites import SUITES
from specdec_trt.cli_options import SEED, Command, backend_options, number_list
from specdec_trt.draft_spec import AUTO, DraftLength


def _draft_lengths(schedule: str):
    """A click callback parsing comma-separated draft lengths: integers >= 1, or the word ``schedule``."""

    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple | None:
        if value is None:
            return None
        lengths: list[DraftLength] = []
        for item in (item.strip() for item in value.split(",")):
            if item == schedule:
                lengths.append(item)
            elif item.isascii() and item.isdigit() and int(item) >= 1:
                lengths.append(int(item))
            elif item:
                raise click.BadParameter(f"{item!r} is neither a draft length (an integer >= 1) nor {schedule!r}")
        if not lengths:
            raise click.BadParameter(f"{value!r}: give one or more draft lengths")
        return tuple(dict.fromkeys(lengths))

    return parse


def peer_lengths(gammas: tuple[DraftLength, ...]) -> tuple[DraftLength, ...]:
    """transformers' default draft lengths: the integers of ours, and its HEURISTIC schedule beside AUTO."""
    return tuple(k for k in gammas if k != AUTO) + ((HEURISTIC,) if AUTO in gammas else ())


@click.command(cls=Command)
@backend_options
@click.option(
    "--draft",
    "drafts",
    multiple=True,
    help="A draft to measure (repeatable): 'ngram' (prompt lookup); with engines 'int4' or 'engine' (the "
    "directory's own draft) or another engine directory; with --target a draft checkpoint; 'ngram+' before "
    "a model draft ('ngram+int4') drafts by prompt lookup where it matches and with that model elsewhere. "
    "[default: on engines with a draft of their own, the default drafter 'ngram+engine' and each of its parts "
    "alone, 'engine' and 'ngram'; else 'ngram']",
)
@click.option(
    "--suite",
    "suites",
    multiple=True,
    help=f"Prompt suite (repeatable): {', '.join(SUITES)}, or a JSONL file of {{id, prompt, chat}}; or "
    f"'{AGENTS}', agent loops whose every call sends the whole growing history, run by our methods with the prefix "
    "cache and the store of earlier requests' text on, as a server runs (see --agents). [default: every suite, "
    f"not '{AGENTS}']",
)
@click.option(
    "--agents",
    "agent_count",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help=f"With --suite {AGENTS}: agents run one after another, each with its own task (a ~1,300-token system "
    "prompt of tool schemas and rules, shared).",
)
@click.option(
    "--agent-calls",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help=f"With --suite {AGENTS}: calls per agent; each adds the answer and a tool's result to the history.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=5,
    help="Use the first N prompts of each suite; 0 for all of them (20-24 per shipped suite, hours on a CPU).",
)
@click.option(
    "--num-draft-tokens",
    "-k",
    "gammas",
    default="1,2,3,4,6,8",
    callback=_draft_lengths(AUTO),
    help="Draft lengths (gamma) to sweep, comma-separated; 'auto' chooses gamma every round from the "
    "acceptance and costs measured so far, and a round stops where the draft's calibrated confidence (prompt "
    "lookup's: how long the repeat it copies has run) says one more token no longer pays.",
)
@click.option(
    "--peer-num-draft-tokens",
    "peer_gammas",
    callback=_draft_lengths(HEURISTIC),
    help="Draft lengths for transformers' assisted generation and prompt lookup; 'heuristic' is assisted "
    f"generation with transformers' own schedule at its defaults (from {HEURISTIC_START} drafts, +2 after a round "
    f"that accepted all, -1 otherwise, stopping below confidence {HEURISTIC_CONFIDENCE}), restarted per "
    "request. Prompt lookup has no schedule: it skips 'heuristic'. [default: the integers of "
    "--num-draft-tokens, and 'heuristic' when they include 'auto']",
)
@click.option(
    "--temperature",
    "-t",
    "temperatures",
    default="0",
    callback=number_list(float, 0),
    help="Sampling temperatures, comma-separated; 0 is greedy.",
)
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=2), default=128, help="New tokens per request.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, help="Timed runs per prompt and method.")
@click.option("--warmup/--no-warmup", default=True, help="Run every method once before timing each suite.")
@click.option(
    "--ignore-eos/--stop-at-eos",
    default=True,
    help="Generate exactly --max-new-tokens with every method (EOS ignored), or stop at EOS.",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    help="Base seed of sampled requests: each prompt and repeat draws its own text (seed + prompt index x "
    "repeats + repeat), the same for every method.",
)
@click.option(
    "--peers/--no-peers",
    default=True,
    help="Also time the peers on the same weights: transformers (generate, assisted generation, prompt lookup), "
    "llama.cpp's llama-server (plain, its n-gram types, a Q4_1 draft model; built by "
    "scripts/install_llama_cpp.sh) and onnxruntime-genai (plain, prompt lookup; pip install "
    "'specdec-trt[peers]'), each where it is installed and has weights of our target's class (float32 or 4-bit).",
)
@click.option(
    "--peer",
    "peer_names",
    multiple=True,
    type=click.Choice(PEERS),
    help="Time only this peer (repeatable); one that cannot run is then an error. [default: every peer that can run]",
)
@click.option(
    "--hf-target",
    type=click.Path(exists=True, path_type=Path),
    help="Checkpoint for transformers' and onnxruntime-genai's peers. [default: the checkpoint the target was "
    "built from]",
)
@click.option(
    "--peer-gguf",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="GGUF of the target's weights for llama.cpp. [default: for a target made from a GGUF file, that file "
    "rewritten in float32 (written once), or the file itself in a 4-bit run]",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("results/bench.json"),
    help="JSON of every run, the summary and the environment.",
)
@click.option(
    "--plots-dir", type=click.Path(file_okay=False, path_type=Path), help="Where the PNG plots go. [default: OUT-plots]"
)
@click.option(
    "--from-json",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Measure nothing: render the tables, plots and --markdown again from the JSON of an earlier run "
    "(every measuring option is then unused). Repeat it to add the peer sections of further runs (e.g. a "
    "4-bit run) to the document.",
)
@click.option(
    "--markdown",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the benchmarks document (e.g. docs/BENCHMARKS.md) from this run.",
)
def bench(
    backend: BackendOptions,
    drafts: tuple[str, ...],
    suites: tuple[str, ...],
    agent_count: int,
    agent_calls: int,
    limit: int,
    gammas: tuple[DraftLength, ...],
    peer_gammas: tuple[DraftLength, ...] | None,
    temperatures: tuple[float, ...],
    max_new_tokens: int,
    repeats: int,
    warmup: bool,
    ignore_eos: bool,
    seed: int,
    peers: bool,
    peer_names: tuple[str, ...],
    hf_target: Path | None,
    peer_gguf: Path | None,
    out: Path,
    plots_dir: Path | None,
    from_json: tuple[Path, ...],
    markdown: Path | None,
) -> None:
    """Time plain decoding, speculative decoding with each draft and gamma, and transformers' generate and
    assisted generation, side by side in one process on prompt suites. Prints markdown tables, writes
    every raw figure to --out (valid JSON even after Ctrl-C) and PNG plots.

    \b
    Examples:
      specdec-bench --suite code --suite summarisation --limit 5
      specdec-bench --suite agents --draft ngram+int4 -k auto --no-peers
      specdec-bench --draft int4 --draft ngram -k 1,2,4,8 -t 0,0.8 --out results/sweep.json
      specdec-bench --target ./llama-1b --draft ./llama-160m -k 2,4,auto --peer-num-draft-tokens 4,heuristic
      specdec-bench --target model.gguf --device cuda --draft ngram
      specdec-bench --engines engines/smollm2-int4 --draft ngram --peer llama.cpp --out results/int4.json
      specdec-bench --from-json results/bench.json --from-json results/int4.json --markdown docs/BENCHMARKS.md
    """
    if not from_json and not peers and (hf_target or peer_gammas or peer_names or peer_gguf):
        raise click.UsageError("--hf-target, --peer, --peer-gguf and --peer-num-draft-tokens need the peers (--peers)")
    from specdec_trt.bench import session  # the runtime, the peers and the plots: imported once the options parsed

    err = Console(stderr=True)
    if from_json:
        plots_dir = plots_dir or from_json[0].with_name(from_json[0].stem + "-plots")
        from specdec_trt.bench.results_file import read_results

        runs = [read_results(path) for path in from_json]
        session.write_outputs(runs, list(from_json), plots_dir, markdown, err)
        return
    config = session.BenchConfig(
        suites=suites or SUITES,
        num_draft_tokens=gammas,
        temperatures=temperatures,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        limit=limit or None,
        warmup=warmup,
        seed=seed,
        ignore_eos=ignore_eos,
    )
    agents = session.AgentWorkload(agent_count, agent_calls) if AGENTS in config.suites else None
    session.run(
        backend,
        drafts,
        config,
        agents,
        peer_names=(peer_names or PEERS) if peers else (),
        peers_named=bool(peer_names),
        peer_gammas=peer_gammas or peer_lengths(gammas),
        hf_target=hf_target,
        peer_gguf=peer_gguf,
        outputs=(out, plots_dir, markdown),
        err=err,
    )
