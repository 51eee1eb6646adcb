"""One specdec-bench run: open the models and the peers, time every method on every suite (and the agent loops),
write the JSON, the tables, the plots and the benchmarks document; or render them again from earlier JSON."""

from __future__ import annotations

import dataclasses
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
from specdec_trt.bench.bandwidth import matrix_vector_bandwidth, stream_bandwidth
from specdec_trt.bench.environment import environment
from specdec_trt.bench.harness import BenchConfig, BenchResults, run_benchmark
from specdec_trt.bench.methods import OURS, Method
from specdec_trt.bench.peers import PeerRequest, Peers, open_peers, our_weight_bytes, weight_class
from specdec_trt.bench.peers_report import peers_section
from specdec_trt.bench.plots import write_plots
from specdec_trt.bench.report import agent_table, auto_table, benchmarks_document, markdown_tables
from specdec_trt.bench.runners import OursRunner
from specdec_trt.bench.step_profile import step_breakdown
from specdec_trt.bench.suites import Suite, load_suite
from specdec_trt.build_engines.model import DTYPES
from specdec_trt.decoder import AUTO, AUTO_MAX_DRAFT_TOKENS, DraftLength, check_context, check_draft_length
from specdec_trt.draft_spec import ENGINE, NGRAM, DraftSpec
from specdec_trt.loading import LoadedModels
from specdec_trt.policy import ENGINES_DEFAULT_DRAFT, has_own_draft
from specdec_trt.runtime.ort_engine import OrtEngine

LOOKUP_ROOM = 64  # llama.cpp's positions beyond our context, for the drafts its prompt lookup verifies


def default_drafts(engines: Path | None) -> tuple[str, ...]:
    """What a run measures when no draft is named: on engines with a draft of their own, the policy's default
    drafter and each of its parts alone; elsewhere prompt lookup."""
    if engines is not None and has_own_draft(engines):
        return (ENGINES_DEFAULT_DRAFT, ENGINE, NGRAM)
    return (NGRAM,)


def run(
    backend: BackendOptions,
    drafts: tuple[str, ...],
    config: BenchConfig,
    agents: AgentWorkload | None,
    *,
    peer_names: tuple[str, ...],
    peers_named: bool,
    peer_gammas: tuple[DraftLength, ...],
    hf_target: Path | None,
    peer_gguf: Path | None,
    outputs: tuple[Path, Path | None, Path | None],
    err: Console,
) -> None:
    """Measure and write everything (``outputs``: the JSON, the plots' folder and the benchmarks document);
    exits 130 after Ctrl-C, with every prompt finished so far written."""
    out, plots_dir, markdown = outputs
    torch_threads = backend.threads or os.cpu_count() or 1  # transformers' and the PyTorch engine's pool
    transformers.logging.set_verbosity_error()  # generation-config chatter would break the progress bar
    transformers.logging.disable_progress_bar()
    specs = [DraftSpec.parse(d) for d in drafts]  # a bad --draft is an error before anything is built
    loaded_suites = [load_suite(name) for name in config.suites if name != AGENTS]
    backend = backend.resolved(err)
    specs = specs or [DraftSpec.parse(d) for d in default_drafts(backend.engines)]
    with err.status("Loading models…") as status:
        models = backend.open(specs, err)
        ours = OursRunner(models, torch_threads if backend.on_pytorch else 1)
        _check_fits(config, loaded_suites, models, ours)
        weights = weight_class(backend.engines, DTYPES[backend.dtype or "float32"])
        request = PeerRequest(
            names=peer_names,
            named=peers_named,
            lengths=peer_gammas,
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
            f"[yellow]Peers left out of {AGENTS}[/yellow]: they run every call cold here "
            "(scripts/bench_agents.py serves the workload through llama-server)"
        )
    methods = (
        [Method(OURS, None)]
        + [Method(OURS, d, k) for d in models.drafters for k in config.num_draft_tokens]
        + found.methods
    )
    command = "specdec-bench " + shlex.join(sys.argv[1:])
    measured_on = environment(str(models.target.device), torch_threads)
    measured_on["packages"] |= found.versions
    results = BenchResults(config, methods, measured_on, command)
    results.weights, results.notes = weights, found.notes
    try:
        results.limits = _limits(models, found, torch_threads, err)
        interrupted = _measure(results, loaded_suites, agents, {OURS: ours, **found.runners}, ours, out, err)
    finally:
        found.close()
    readings = [results.limits["machine_read_GBps"], stream_bandwidth(torch_threads)["read"].best]
    results.limits |= {"machine_read_GBps": max(readings), "machine_read_GBps_before_after": readings}
    results.write(out)
    err.print(f"Wrote {out}")
    write_outputs([results.to_json()], [out], plots_dir or out.with_name(out.stem + "-plots"), markdown, err)
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
        stream = stream_bandwidth(threads)
        limits: dict = {
            "machine_read_GBps": stream["read"].best,
            "stream_GBps": {kernel: dataclasses.asdict(rate) for kernel, rate in stream.items()},
            "matrix_vector_GBps": dataclasses.asdict(matrix_vector_bandwidth()),  # on the engines' pool
            "weight_bytes_per_token": ({Method(OURS, None).name: ours} if ours else {}) | found.weight_bytes,
        }
        if isinstance(models.target, OrtEngine):
            limits["step"] = step_breakdown(models.target.spec)
    return limits


def write_outputs(runs: list[dict], sources: list[Path], plots_dir: Path, markdown: Path | None, err: Console) -> None:
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
