"""``specdec-bench``: speculative decoding side by side with plain decoding and transformers, on prompt suites."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click
import transformers
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdec_trt.backend import BackendOptions
from specdec_trt.bench.agent_runs import AgentWorkload, run_agent_workload
from specdec_trt.bench.agents import AGENTS, agent_loops
from specdec_trt.bench.bandwidth import machine_read_bandwidth
from specdec_trt.bench.environment import environment
from specdec_trt.bench.harness import BenchConfig, BenchResults, run_benchmark
from specdec_trt.bench.methods import (
    HEURISTIC,
    HEURISTIC_CONFIDENCE,
    HEURISTIC_START,
    OURS,
    Method,
    OursRunner,
)
from specdec_trt.bench.peers import PEERS, PeerRequest, Peers, open_peers, our_weight_bytes, weight_class
from specdec_trt.bench.peers_report import peers_section
from specdec_trt.bench.plots import write_plots
from specdec_trt.bench.report import agent_table, auto_table, benchmarks_document, markdown_tables
from specdec_trt.bench.results_file import read_results
from specdec_trt.bench.step_profile import step_breakdown
from specdec_trt.bench.suites import SUITES, Suite, load_suite
from specdec_trt.build_engines.model import DTYPES
from specdec_trt.cli_options import SEED, Command, backend_options, number_list
from specdec_trt.decoder import AUTO, AUTO_MAX_DRAFT_TOKENS, DraftLength, check_context, check_draft_length
from specdec_trt.draft_spec import ENGINE, NGRAM, DraftSpec
from specdec_trt.loading import LoadedModels
from specdec_trt.policy import ENGINES_DEFAULT_DRAFT, has_own_draft
from specdec_trt.runtime.ort_engine import OrtEngine

LOOKUP_ROOM = 64  # llama.cpp's positions beyond our context, for the drafts its prompt lookup verifies


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


def default_drafts(engines: Path | None) -> tuple[str, ...]:
    """What a run measures when no draft is named: on engines with a draft of their own, the policy's default
    drafter and each of its parts alone; elsewhere prompt lookup."""
    if engines is not None and has_own_draft(engines):
        return (ENGINES_DEFAULT_DRAFT, ENGINE, NGRAM)
    return (NGRAM,)


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
    "llama.cpp (plain, prompt lookup) and onnxruntime-genai (plain), each where it is installed "
    "(pip install 'specdec-trt[peers]') and has weights of our target's class (float32 or 4-bit).",
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
    err = Console(stderr=True)
    if from_json:
        runs = [read_results(path) for path in from_json]
        plots_dir = plots_dir or from_json[0].with_name(from_json[0].stem + "-plots")
        _write_outputs(runs, list(from_json), plots_dir, markdown, err)
        return
    if not peers and (hf_target or peer_gammas or peer_names or peer_gguf):
        raise click.UsageError("--hf-target, --peer, --peer-gguf and --peer-num-draft-tokens need the peers (--peers)")
    torch_threads = backend.threads or os.cpu_count() or 1  # transformers' and the PyTorch engine's pool
    transformers.logging.set_verbosity_error()  # generation-config chatter would break the progress bar
    transformers.logging.disable_progress_bar()
    config = BenchConfig(
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
    specs = [DraftSpec.parse(d) for d in drafts]  # a bad --draft is an error before anything is built
    loaded_suites = [load_suite(name) for name in config.suites if name != AGENTS]
    agents = AgentWorkload(agent_count, agent_calls) if AGENTS in config.suites else None
    backend = backend.resolved(err)
    specs = specs or [DraftSpec.parse(d) for d in default_drafts(backend.engines)]
    with err.status("Loading models…") as status:
        models = backend.open(specs, err)
        ours = OursRunner(models, torch_threads if backend.on_pytorch else 1)
        _check_fits(config, loaded_suites, models, ours)
        weights = weight_class(backend.engines, DTYPES[backend.dtype or "float32"])
        request = PeerRequest(
            names=(peer_names or PEERS) if peers else (),
            named=bool(peer_names),
            lengths=peer_gammas or peer_lengths(gammas),
            threads=torch_threads,
            n_ctx=models.max_context + LOOKUP_ROOM,  # prompt lookup verifies drafts past the last token
            hf_target=hf_target,
            gguf=peer_gguf,
        )
        found = open_peers(request, models, weights, str(models.target.device), lambda text: status.update(text))
    for note in found.notes:
        err.print(f"[yellow]Peer left out[/yellow]: {note}")
    if agents is not None and found.methods:
        err.print(
            f"[yellow]Peers left out of {AGENTS}[/yellow]: they keep no cache between calls in-process "
            "(scripts/bench_agents.py serves the workload through llama-server)"
        )
    methods = [Method(OURS, None)] + [Method(OURS, d, k) for d in models.drafters for k in gammas] + found.methods
    command = "specdec-bench " + shlex.join(sys.argv[1:])
    results = BenchResults(config, methods, environment(str(models.target.device), torch_threads), command)
    results.weights, results.notes = weights, found.notes
    results.limits = _limits(models, found, torch_threads, err)
    interrupted = _measure(results, loaded_suites, agents, {OURS: ours, **found.runners}, ours, out, err)
    readings = [results.limits["machine_read_GBps"], machine_read_bandwidth(torch_threads)]
    results.limits |= {"machine_read_GBps": max(readings), "machine_read_GBps_before_after": readings}
    results.write(out)
    err.print(f"Wrote {out}")
    _write_outputs([results.to_json()], [out], plots_dir or out.with_name(out.stem + "-plots"), markdown, err)
    if interrupted:
        err.print(f"[yellow]Interrupted[/yellow]: {out} holds every prompt finished so far.")
        sys.exit(130)


def _measure(
    results: BenchResults,
    suites: list[Suite],
    agents: AgentWorkload | None,
    runner_for: dict,
    ours: OursRunner,
    out: Path,
    err: Console,
) -> bool:
    """Run the benchmark under a progress bar, saving after every prompt (every call of the agent workload);
    True when Ctrl-C stopped it."""
    config = results.config
    per_setting = [len(s.prompts[: config.limit]) * config.repeats + config.warmup for s in suites]
    total = sum(per_setting) * len(config.temperatures) * len(results.methods)
    our_methods = [m for m in results.methods if m.family == OURS]
    if agents is not None:
        total += agents.runs_per_method(config) * len(our_methods)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=err) as progress:
        task = progress.add_task("warm-up", total=total)
        started = 0

        def on_run(description: str) -> None:
            nonlocal started
            progress.update(task, completed=started, description=description)
            started += 1

        try:
            run_benchmark(results, suites, runner_for, ours.encode, on_run, lambda: results.write(out))
            if agents is not None:
                run_agent_workload(config, agents, our_methods, ours, results.runs, on_run, lambda: results.write(out))
        except KeyboardInterrupt:
            results.status = "interrupted"
            return True
        results.status = "complete"
        progress.update(task, completed=total, description="done")
    return False


def _check_fits(config: BenchConfig, suites: list[Suite], models: LoadedModels, ours: OursRunner) -> None:
    """Refuse, before any timing, a draft length the engine cannot verify or a prompt that cannot fit."""
    built_for = models.target.max_draft_len
    fixed = [k for k in config.num_draft_tokens if k != AUTO]
    for gamma in fixed:
        check_draft_length(gamma, built_for)
    reach = max(fixed + ([built_for or AUTO_MAX_DRAFT_TOKENS] if AUTO in config.num_draft_tokens else []))
    if AGENTS in config.suites:
        first_call = agent_loops(1, config.seed + 1)[0].first_messages()
        try:
            check_context(len(ours.encode_messages(first_call)), config.max_new_tokens, reach, models.max_context)
        except ValueError as error:
            raise ValueError(f"the first call of {AGENTS}: {error}") from error
    for suite in suites:
        for prompt in suite.prompts[: config.limit]:
            try:
                check_context(len(ours.encode(prompt)), config.max_new_tokens, reach, models.max_context)
            except ValueError as error:
                raise ValueError(f"prompt {prompt.id} of suite {suite.name}: {error}") from error


def _limits(models: LoadedModels, found: Peers, threads: int, err: Console) -> dict:
    """The memory-bandwidth limit of this run: the machine's read rate, the weight bytes per token of every
    plain method, and where our plain decode step goes (ONNX Runtime engines)."""
    with err.status("Measuring the machine's memory bandwidth and our decode step…"):
        ours = our_weight_bytes(models)
        limits: dict = {
            "machine_read_GBps": machine_read_bandwidth(threads),
            "weight_bytes_per_token": ({Method(OURS, None).name: ours} if ours else {}) | found.weight_bytes,
        }
        if isinstance(models.target, OrtEngine):
            limits["step"] = step_breakdown(models.target.spec)
    return limits


def _write_outputs(runs: list[dict], sources: list[Path], plots_dir: Path, markdown: Path | None, err: Console) -> None:
    """The tables of the first run on stdout, the plots, and the benchmarks document when asked for (with
    the peer sections of every run)."""
    data = runs[0]
    click.echo(markdown_tables(data["summary"]))
    if data.get("agents"):
        click.echo(f"### {AGENTS}: whole loops\n\n" + agent_table(data["agents"]))
    versus = auto_table(data["summary"])
    if versus:
        click.echo("### auto vs the best fixed gamma\n\n" + versus)
    for run in runs:
        click.echo(peers_section(run))
    plots = write_plots(data["summary"], plots_dir)
    if plots:
        err.print(f"Wrote the plots into {plots_dir}")
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        sources_argv = " ".join(f"--from-json {source}" for source in sources)
        rerender = f"specdec-bench {sources_argv} --plots-dir {plots_dir} --markdown {markdown}"
        markdown.write_text(benchmarks_document(data, plots, markdown, rerender, runs[1:]))
        err.print(f"Wrote {markdown}")
