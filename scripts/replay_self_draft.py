"""The int4 self-draft, alone and behind prompt lookup (the default drafter), replayed on recorded greedy outputs:
auto draft lengths against fixed ones, with no timing noise in the comparison.

For every committed length of each recorded greedy continuation (``replay_prompt_lookup.py`` makes the
recording), the self-draft's greedy proposals and its confidence in each are computed once on the engines,
as the decoder's self-draft computes them: on the target's keys and values of the committed tokens, feeding
the newest one, then its own drafts. Each round is priced by the self-draft's step and the target's verify
pass, timed on the engines at a few context lengths, and the decoder's own ``DraftLengthController`` (with
its cost-aware stop on the draft's calibrated confidence) is fed each round as the decoder feeds it. The
decoder's sub-millisecond work per round and prompt lookup's ~0.1 ms are left out.

``--check N`` runs the real decoder at k=4 on the first N prompts of each suite and compares its rounds with
the replay's: the replay's proposals come from a batched pass over a full-sequence cache, the decoder's from
its own rounds, so floating-point differences may rarely flip a drafted token.

    .venv/bin/python scripts/replay_self_draft.py --recorded results/lookup_greedy_recording.json
    .venv/bin/python scripts/replay_self_draft.py --recorded ... --chains results/self_draft_replay.json --costs ...
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.progress import Progress

from build_engines.manifest import read_manifest
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.replay import (
    COST_CONTEXTS,
    ModelChains,
    Proposal,
    Proposer,
    StepPrices,
    auto_against_fixed,
    fixed_length_rounds,
    measure_step_prices,
    record_model_chains,
    speedup_table,
    speedups_by_length,
)
from specdec_trt.bench.suites import SUITES
from specdec_trt.cli import default_engines
from specdec_trt.drafting import LOOKUP, LOOKUP_FIRST_MIN_NGRAM, MODEL, PromptLookupDrafter

CHECK_LENGTH = 4


def drafters(chains: ModelChains) -> dict[str, tuple[dict[str, Proposer], Callable[[np.ndarray], str]]]:
    """{name: (parts, part_of)}: the self-draft alone, prompt lookup first (as ``LookupFirstDrafter``), and
    prompt lookup alone."""
    lookup = PromptLookupDrafter()
    first = PromptLookupDrafter(min_ngram=LOOKUP_FIRST_MIN_NGRAM)
    model = chains.proposer()
    return {
        "int4": ({MODEL: model}, lambda committed: MODEL),
        "lookup-first": (
            {LOOKUP: lambda committed, length: Proposal(first.lookup(committed, length)), MODEL: model},
            lambda committed: LOOKUP if len(first.lookup(committed, 1)) else MODEL,
        ),
        "lookup": ({LOOKUP: lambda committed, length: Proposal(lookup.lookup(committed, length))}, lambda _: LOOKUP),
    }


def compare(recording: dict, chains: dict, prices: StepPrices, new_tokens: int, max_draft: int) -> dict:
    """Per drafter and suite: median over prompts of each fixed length's and auto's speedup over plain decoding
    (each against the same priced plain decoding), the best fixed length and auto over it."""
    results: dict = {}
    for suite, rows in recording.items():
        per_prompt = defaultdict(list)
        for row in rows:
            prompt, output = row["prompt"], row["output"][:new_tokens]
            for name, (parts, part_of) in drafters(chains[suite][row["id"]]).items():
                per_prompt[name].append(speedups_by_length(prompt, output, parts, part_of, prices, max_draft))
        for name, speedups in per_prompt.items():
            results.setdefault(name, {})[suite] = auto_against_fixed(speedups)
    return results


def check(engines: Path, recording: dict, chains: dict, new_tokens: int, count: int) -> dict:
    """The real decoder at k=4 (self-draft alone) against the replay's rounds, first ``count`` prompts a suite."""
    decoder = SpeculativeDecoder.from_engines(engines)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    same, rounds_real, rounds_replayed, prompts = 0, 0, 0, 0
    for suite, rows in recording.items():
        for row in rows[:count]:
            output = row["output"][:new_tokens]
            real = decoder.generate(row["prompt"], params, num_draft_tokens=CHECK_LENGTH)
            if real.token_ids != output:
                raise click.ClickException(
                    f"{suite} {row['id']}: the engines' greedy output differs from the recording"
                )
            propose = chains[suite][row["id"]].proposer()
            replayed = fixed_length_rounds(row["prompt"], output, propose, CHECK_LENGTH, MODEL)
            accepted = [0] * CHECK_LENGTH
            for round_ in replayed:
                for i in range(round_.accepted):
                    accepted[i] += 1
            prompts += 1
            same += accepted == real.stats.accepted_per_position[:CHECK_LENGTH] and len(replayed) == real.stats.rounds
            rounds_real, rounds_replayed = rounds_real + real.stats.rounds, rounds_replayed + len(replayed)
    return {"prompts": prompts, "identical": same, "rounds_decoder": rounds_real, "rounds_replay": rounds_replayed}


@click.command()
@click.option("--engines", type=click.Path(path_type=Path), help="Engine directory [default: the default engines]")
@click.option(
    "--recorded",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("results/lookup_greedy_recording.json"),
    show_default=True,
    help="Greedy recording of the bench prompts (replay_prompt_lookup.py writes one).",
)
@click.option("--new-tokens", default=128, show_default=True, help="Tokens of each recorded continuation to replay.")
@click.option("--limit", type=int, help="Replay only the first N prompts of each suite.")
@click.option(
    "--chains",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reuse the self-draft proposals an earlier run wrote (its --out) instead of computing them.",
)
@click.option(
    "--costs",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reuse the step prices an earlier run wrote (its --out) instead of timing them.",
)
@click.option("--cost-repeats", default=20, show_default=True, help="Timed passes per width and context.")
@click.option(
    "--check", "check_count", default=0, show_default=True, help="Prompts a suite to check against the decoder."
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("results/self_draft_replay.json"), show_default=True
)
def main(
    engines: Path | None,
    recorded: Path,
    new_tokens: int,
    limit: int | None,
    chains: Path | None,
    costs: Path | None,
    cost_repeats: int,
    check_count: int,
    out: Path,
) -> None:
    """Replay the int4 self-draft and lookup-first on greedy recordings of the bench suites: auto against fixed
    draft lengths, with draft and verify steps priced as measured on the engines."""
    engines = engines or default_engines(Console(stderr=True))
    recording = {s: rows[:limit] for s, rows in json.loads(recorded.read_text()).items() if s in SUITES}
    max_draft = read_manifest(engines, verify_files=False).target.max_draft_len
    decoder = SpeculativeDecoder.from_engines(engines)
    target, draft = decoder.target, decoder.drafter.engine
    if costs is not None:
        saved = json.loads(costs.read_text())["prices"]
        prices = StepPrices(tuple(saved["contexts"]), {int(w): v for w, v in saved["verify"].items()}, saved["draft"])
    else:
        # Timed first, before this script has loaded the machine with anything else.
        prices = measure_step_prices(target, draft, max_draft + 1, COST_CONTEXTS, cost_repeats)
    if chains is not None:
        saved = json.loads(chains.read_text())["chains"]
        proposals = {s: {i: ModelChains(**c) for i, c in rows.items()} for s, rows in saved.items()}
    else:
        proposals = {}
        with Progress(console=Console(stderr=True)) as progress:
            task = progress.add_task("self-draft proposals", total=sum(len(rows) for rows in recording.values()))
            for suite, rows in recording.items():
                for row in rows:
                    sequence = row["prompt"] + row["output"][:new_tokens]
                    chain = record_model_chains(target, draft, sequence, len(row["prompt"]) + 1, max_draft)
                    proposals.setdefault(suite, {})[row["id"]] = chain
                    progress.advance(task)
    results = compare(recording, proposals, prices, new_tokens, max_draft)
    for drafter, suites in results.items():
        click.echo(f"\n{drafter}: speedup over plain decoding (median over prompts), steps priced as measured")
        click.echo(speedup_table(suites))
    checked = check(engines, recording, proposals, new_tokens, check_count) if check_count else None
    if checked:
        click.echo(
            f"\ncheck at k={CHECK_LENGTH}: {checked['identical']} of {checked['prompts']} prompts with the decoder's "
            f"rounds and acceptances; rounds {checked['rounds_replay']} replayed, {checked['rounds_decoder']} decoded"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "new_tokens": new_tokens,
        "prices": {"contexts": list(prices.contexts), "verify": prices.verify, "draft": prices.draft},
        "results": results,
        "check": checked,
        "chains": {s: {i: vars(c) for i, c in rows.items()} for s, rows in proposals.items()},
    }
    out.write_text(json.dumps(document))
    click.echo(f"Wrote {out}")


if __name__ == "__main__":
    main()
