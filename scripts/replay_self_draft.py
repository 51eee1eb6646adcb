"""The int4 self-draft, alone and behind prompt lookup (the default drafter), replayed on recorded greedy or
sampled outputs: auto draft lengths against fixed ones, with no timing noise in the comparison.

For every committed length of each recorded greedy continuation (``replay_prompt_lookup.py`` makes the
recording), the self-draft's greedy proposals and its confidence in each are computed once on the engines,
as the decoder's self-draft computes them: on the target's keys and values of the committed tokens, feeding
the newest one, then its own drafts. Each round is priced by the self-draft's step and the target's verify
pass, timed on the engines at a few context lengths, and the decoder's own ``DraftLengthController`` (with
its cost-aware stop on the draft's calibrated confidence) is fed each round as the decoder feeds it. The
decoder's sub-millisecond work per round and prompt lookup's ~0.1 ms are left out.

A sampled recording (``replay_prompt_lookup.py --temperature``) is replayed exactly in distribution
(``benchlib.replay``): along each sampled continuation the self-draft's chance of being accepted at
every drafted position is computed once per committed length, each position gets one uniform number that
every draft length shares, and when auto's stop rule asks about drafts after a rejected one the draft
samples them on the engines (``sampled_continuation``).

``--check N`` runs the real decoder at k=4 on the first N prompts of each suite and compares its rounds with
the replay's: for greedy output round for round (the replay's proposals come from a batched pass over a
full-sequence cache, the decoder's from its own rounds, so floating-point differences may rarely flip a
drafted token); for sampled output, which the decoder samples afresh, by the acceptance at each draft
position over all the prompts' seeds.

    .venv/bin/python scripts/replay_self_draft.py --recorded results/lookup_greedy_recording.json \
        --costs results/self_draft_replay.summary.json --check 2 --out results/self_draft_replay.json
    .venv/bin/python scripts/replay_self_draft.py --recorded ... --chains results/self_draft_replay.json --costs ...
    .venv/bin/python scripts/replay_self_draft.py --recorded results/lookup_sampled_recording.json --limit 6 \
        --costs results/self_draft_replay.summary.json --check 2 --out results/self_draft_replay_sampled.json

The recordings and the full outputs are large and not in the tree: ``replay_prompt_lookup.py`` makes the
recordings again, and ``results/*.summary.json`` keep every figure of the published runs but the proposals,
with the step prices that ``--costs`` reuses (scripts/README.md).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import click
import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

from benchlib.replay import (
    COST_CONTEXTS,
    ModelChains,
    Proposer,
    SampledChains,
    StepPrices,
    auto_against_fixed,
    fixed_length_rounds,
    lookup_proposer,
    measure_step_prices,
    position_counts,
    record_model_chains,
    record_sampled_chains,
    sampled_continuation,
    speedup_table,
    speedups_by_length,
)
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.suites import SUITES
from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.build_progress import default_engines_shown
from specdec_trt.drafting import LOOKUP, LOOKUP_FIRST_MIN_NGRAM, MODEL, PromptLookupDrafter
from specdec_trt.runtime.ort_engine import OrtEngine

CHECK_LENGTH = 4
Chains = ModelChains | SampledChains


def row_key(row: dict) -> str:
    """A recorded continuation's key: its prompt's id, and for a sampled one its seed."""
    return f"{row['id']}/seed {row['seed']}" if row.get("temperature") else row["id"]


def row_params(row: dict, new_tokens: int) -> SamplingParams:
    """The sampling a recorded continuation was made with (EOS ignored, as the recording ignored it)."""
    temperature = row.get("temperature", 0.0)
    return SamplingParams(new_tokens, temperature, seed=row["seed"] if temperature else None, ignore_eos=True)


def record_chains(target: OrtEngine, draft: OrtEngine, row: dict, new_tokens: int, max_draft: int) -> Chains:
    """The self-draft's proposals along one recorded continuation: greedy, or sampled as it was sampled."""
    sequence, first = row["prompt"] + row["output"][:new_tokens], len(row["prompt"]) + 1
    params = row_params(row, new_tokens)
    if params.greedy:
        return record_model_chains(target, draft, sequence, first, max_draft)
    generator = torch.Generator().manual_seed(params.seed)
    return record_sampled_chains(target, draft, sequence, first, max_draft, params, generator)


def model_proposer(chains: Chains, row: dict, new_tokens: int, target: OrtEngine, draft: OrtEngine) -> Proposer:
    """The self-draft replayed on one recorded continuation; a sampled one with its own coins (one uniform
    number per position, seeded by the continuation's seed) and the draft's continuation after a rejection."""
    if isinstance(chains, ModelChains):
        return chains.proposer()
    sequence, params = row["prompt"] + row["output"][:new_tokens], row_params(row, new_tokens)
    coins = np.random.default_rng([params.seed, 1]).random(len(sequence))
    return chains.proposer(coins, sampled_continuation(target, draft, sequence, params, params.seed))


def drafters(model: Proposer) -> dict[str, tuple[dict[str, Proposer], Callable[[np.ndarray], str]]]:
    """{name: (parts, part_of)}: the self-draft (``model``) alone, prompt lookup first (as
    ``LookupFirstDrafter``), and prompt lookup alone."""
    lookup = PromptLookupDrafter()
    first = PromptLookupDrafter(min_ngram=LOOKUP_FIRST_MIN_NGRAM)
    return {
        "int4": ({MODEL: model}, lambda committed: MODEL),
        "lookup-first": (
            {LOOKUP: lookup_proposer(first), MODEL: model},
            lambda committed: LOOKUP if len(first.lookup(committed, 1)) else MODEL,
        ),
        "lookup": ({LOOKUP: lookup_proposer(lookup)}, lambda _: LOOKUP),
    }


def compare(
    recording: dict, proposers: Callable[[str, dict], Proposer], prices: StepPrices, new_tokens: int, max_draft: int
) -> dict:
    """Per drafter and suite: median over the recorded continuations of each fixed length's and auto's speedup
    over plain decoding (each against the same priced plain decoding), the best fixed length and auto over
    it. ``proposers(suite, row)`` gives the self-draft on a continuation."""
    results: dict = {}
    for suite, rows in recording.items():
        per_prompt = defaultdict(list)
        for row in rows:
            prompt, output = row["prompt"], row["output"][:new_tokens]
            for name, (parts, part_of) in drafters(proposers(suite, row)).items():
                per_prompt[name].append(speedups_by_length(prompt, output, parts, part_of, prices, max_draft))
        for name, speedups in per_prompt.items():
            results.setdefault(name, {})[suite] = auto_against_fixed(speedups)
    return results


def per_position(counts: np.ndarray) -> list[float]:
    """Acceptance at each draft position from [drafted, accepted] counts per position."""
    drafted, accepted = counts
    return [round(float(a / d), 4) for a, d in zip(accepted, drafted)]


def check(
    engines: Path, recording: dict, proposers: Callable[[str, dict], Proposer], new_tokens: int, count: int
) -> dict:
    """The real decoder at k=4 (self-draft alone) against the replay's rounds, first ``count`` prompts a suite:
    greedy, the same rounds prompt by prompt; sampled, the same acceptance per draft position in aggregate
    (the decoder samples anew, with seeds the recording did not use)."""
    decoder = SpeculativeDecoder.from_engines(engines, "engine")
    same = checked = rounds_decoded = rounds_replayed = 0
    counts = {side: np.zeros((2, CHECK_LENGTH)) for side in ("decoder", "replay")}  # drafted, accepted
    ids = {suite: list(dict.fromkeys(row["id"] for row in rows))[:count] for suite, rows in recording.items()}
    greedy = True
    for suite, rows in recording.items():
        for row in (row for row in rows if row["id"] in ids[suite]):
            output, params = row["output"][:new_tokens], row_params(row, new_tokens)
            greedy = greedy and params.greedy
            if not params.greedy:
                params = replace(params, seed=params.seed + 1_000_000)
            real = decoder.generate(row["prompt"], params, num_draft_tokens=CHECK_LENGTH)
            if params.greedy and real.token_ids != output:
                raise click.ClickException(
                    f"{suite} {row['id']}: the engines' greedy output differs from the recording"
                )
            replayed = fixed_length_rounds(row["prompt"], output, proposers(suite, row), CHECK_LENGTH, MODEL)
            drafted, accepted = position_counts(replayed, CHECK_LENGTH)
            counts["replay"] += [drafted, accepted]
            for side, decoded in enumerate((real.stats.drafted_per_position, real.stats.accepted_per_position)):
                counts["decoder"][side, : len(decoded)] += decoded
            same += (len(replayed), accepted) == (real.stats.rounds, real.stats.accepted_per_position[:CHECK_LENGTH])
            checked += 1
            rounds_decoded += real.stats.rounds
            rounds_replayed += len(replayed)
    rounds = {"rounds_decoder": rounds_decoded, "rounds_replay": rounds_replayed}
    if greedy:
        return {"prompts": checked, "identical": same, **rounds}
    acceptance = {side: per_position(side_counts) for side, side_counts in counts.items()}
    drafts = counts["decoder"][0].tolist()
    return {
        "continuations": checked,
        **rounds,
        "acceptance_per_position": acceptance,
        "decoder_drafts_per_position": drafts,
    }


def load_chains(path: Path) -> dict[str, dict[str, Chains]]:
    """The proposals an earlier run wrote (its --out)."""
    saved = json.loads(path.read_text())["chains"]
    kind = {True: SampledChains, False: ModelChains}
    return {s: {key: kind["accept" in c](**c) for key, c in rows.items()} for s, rows in saved.items()}


@click.command()
@click.option("--engines", type=click.Path(path_type=Path), help="Engine directory [default: the default engines]")
@click.option(
    "--recorded",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="Greedy or sampled recording of the bench prompts (replay_prompt_lookup.py --save-recording writes one).",
)
@click.option("--new-tokens", default=128, show_default=True, help="Tokens of each recorded continuation to replay.")
@click.option("--limit", type=int, help="Replay only the first N prompts of each suite (every seed of each).")
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
    """Replay the int4 self-draft and lookup-first on greedy or sampled recordings of the bench suites: auto
    against fixed draft lengths, with draft and verify steps priced as measured on the engines."""
    engines = engines or default_engines_shown(Console(stderr=True))
    recording = {}
    for suite, rows in json.loads(recorded.read_text()).items():
        if suite in SUITES:
            kept = list(dict.fromkeys(row["id"] for row in rows))[:limit]
            recording[suite] = [row for row in rows if row["id"] in kept]
    max_draft = read_manifest(engines, verify_files=False).target.max_draft_len
    decoder = SpeculativeDecoder.from_engines(engines, "engine")
    target, draft = decoder.target, decoder.drafter.engine
    if costs is not None:
        saved = json.loads(costs.read_text())["prices"]
        prices = StepPrices(tuple(saved["contexts"]), {int(w): v for w, v in saved["verify"].items()}, saved["draft"])
    else:
        # Timed first, before this script has loaded the machine with anything else.
        prices = measure_step_prices(target, draft, max_draft + 1, COST_CONTEXTS, cost_repeats)
    if chains is not None:
        proposals = load_chains(chains)
    else:
        proposals = {}
        with Progress(console=Console(stderr=True)) as progress:
            task = progress.add_task("self-draft proposals", total=sum(len(rows) for rows in recording.values()))
            for suite, rows in recording.items():
                for row in rows:
                    chain = record_chains(target, draft, row, new_tokens, max_draft)
                    proposals.setdefault(suite, {})[row_key(row)] = chain
                    progress.advance(task)

    def proposers(suite: str, row: dict) -> Proposer:
        return model_proposer(proposals[suite][row_key(row)], row, new_tokens, target, draft)

    results = compare(recording, proposers, prices, new_tokens, max_draft)
    for drafter, suites in results.items():
        click.echo(f"\n{drafter}: speedup over plain decoding (median over continuations), steps priced as measured")
        click.echo(speedup_table(suites))
    checked = check(engines, recording, proposers, new_tokens, check_count) if check_count else None
    if checked and "identical" in checked:
        click.echo(
            f"\ncheck at k={CHECK_LENGTH}: {checked['identical']} of {checked['prompts']} prompts with the decoder's "
            f"rounds and acceptances; rounds {checked['rounds_replay']} replayed, {checked['rounds_decoder']} decoded"
        )
    elif checked:
        click.echo(
            f"\ncheck at k={CHECK_LENGTH} over {checked['continuations']} sampled continuations, acceptance per draft "
            f"position: decoder {checked['acceptance_per_position']['decoder']}, replay "
            f"{checked['acceptance_per_position']['replay']}; rounds {checked['rounds_replay']} replayed, "
            f"{checked['rounds_decoder']} decoded"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [row for suite_rows in recording.values() for row in suite_rows]
    document = {
        "new_tokens": new_tokens,
        "sampling": {
            "temperature": rows[0].get("temperature", 0.0),
            "continuations": len(rows),
            "prompts": len({(row["id"], tuple(row["prompt"])) for row in rows}),
        },
        "prices": {"contexts": list(prices.contexts), "verify": prices.verify, "draft": prices.draft},
        "results": results,
        "check": checked,
        "chains": {s: {key: vars(c) for key, c in rows.items()} for s, rows in proposals.items()},
    }
    out.write_text(json.dumps(document))
    click.echo(f"Wrote {out}")


if __name__ == "__main__":
    main()
