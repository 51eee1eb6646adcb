"""Prompt lookup replayed exactly on recorded greedy outputs: how often its drafts are right, by match length,
and how auto draft lengths compare with fixed ones.

Greedy output does not depend on the drafter, so one plain greedy continuation per bench prompt (EOS ignored,
as specdec-bench does) fixes every round a drafter would see: a round proposes up to k tokens after the
committed text, keeps the prefix that equals the recorded continuation, and commits one token more. This
prints, per suite and lookup setting, the acceptance of a round's first drafted token by the length of the
longest suffix of the committed text that occurred before, and the tokens per round (tau) at k=4.

It then prices every round by the target's verify pass, timed on the engines for each width (1 to the
engines' max draft length + 1) at a few context lengths and interpolated between them, and compares fixed
draft lengths with auto: the decoder's own ``DraftLengthController``, fed each round's drafts, acceptances
and price as the decoder feeds it. The acceptances are exact; the times are a model (lookup's own ~0.1 ms and
the decoder's sub-millisecond work per round are left out), so machine noise cannot decide the comparison.
Everything is written as JSON.

    .venv/bin/python scripts/replay_prompt_lookup.py --out results/lookup_replay.json
    .venv/bin/python scripts/replay_prompt_lookup.py --recorded greedy.json   # replay an earlier recording
    .venv/bin/python scripts/replay_prompt_lookup.py --recorded greedy.json --costs results/lookup_replay.json
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import click
import numpy as np
from rich.console import Console

from build_engines.manifest import read_manifest
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.replay import (
    COST_CONTEXTS,
    Proposal,
    Proposer,
    StepPrices,
    auto_against_fixed,
    fixed_length_rounds,
    measure_step_prices,
    speedup_table,
    speedups_by_length,
)
from specdec_trt.bench.suites import SUITES, load_suite
from specdec_trt.cli import default_engines
from specdec_trt.drafting import LOOKUP, PromptLookupDrafter

SETTINGS = {"max 3, min 2 (before)": (3, 2), "max 4, min 1 (now)": (4, 1)}
LONGEST_MATCH = 8  # match lengths are measured up to this
MATCH_BINS = {"1": (1, 1), "2": (2, 2), "3-7": (3, 7), "8+": (8, LONGEST_MATCH)}  # inclusive ranges


def record(engines: Path, new_tokens: int) -> dict[str, list[dict]]:
    """Plain greedy continuations of every bench prompt: {suite: [{id, prompt, output}]}."""
    decoder = SpeculativeDecoder.from_engines(engines, draft=None)
    recorded: dict[str, list[dict]] = {}
    for suite in SUITES:
        rows = recorded.setdefault(suite, [])
        for prompt in load_suite(suite).prompts:
            text = decoder.apply_chat_template(prompt.prompt) if prompt.chat else prompt.prompt
            ids = decoder.tokenize(text)
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
            rows.append({"id": prompt.id, "prompt": ids, "output": decoder.generate(ids, params, 0).token_ids})
            click.echo(f"recorded {suite} {prompt.id}", err=True)
    return recorded


def match_length(sequence: np.ndarray) -> int:
    """Length of the longest suffix (up to ``LONGEST_MATCH``) that occurred earlier in the sequence; 0 if none."""
    for n in range(LONGEST_MATCH, 0, -1):
        if len(PromptLookupDrafter(max_ngram=n, min_ngram=n).lookup(sequence, 1)):
            return n
    return 0


def lookup_proposer(drafter: PromptLookupDrafter) -> Proposer:
    """Proposals of ``drafter``."""
    return lambda committed, length: Proposal(drafter.lookup(committed, length))


def replay(prompt: list[int], output: list[int], drafter: PromptLookupDrafter, k: int) -> tuple[list, float]:
    """[(matched length, first draft right)] over the rounds that drafted, and tau at draft length ``k``."""
    sequence = np.asarray(prompt + output)
    replayed = fixed_length_rounds(prompt, output, lookup_proposer(drafter), k, LOOKUP)
    first_drafts = [(match_length(sequence[: r.context]), r.accepted > 0) for r in replayed if r.drafted]
    return first_drafts, sum(r.accepted + 1 for r in replayed) / max(len(replayed), 1)


def summarise(recorded: dict[str, list[dict]], new_tokens: int) -> dict:
    """Per suite and setting: first-draft acceptance per match-length bin (with counts) and median tau at k=4."""
    results: dict = {}
    for suite, rows in recorded.items():
        for name, (max_ngram, min_ngram) in SETTINGS.items():
            drafter = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
            by_bin, taus = defaultdict(list), []
            for row in rows:
                first_drafts, tau = replay(row["prompt"], row["output"][:new_tokens], drafter, k=4)
                taus.append(tau)
                for length, right in first_drafts:
                    by_bin[next(b for b, (low, high) in MATCH_BINS.items() if low <= length <= high)].append(right)
            results.setdefault(suite, {})[name] = {
                "first_draft_acceptance": {b: (float(np.mean(v)), len(v)) for b in MATCH_BINS if (v := by_bin[b])},
                "median_tau_k4": float(np.median(taus)),
            }
    return results


def compare_draft_lengths(recorded: dict[str, list[dict]], new_tokens: int, prices: StepPrices, max_draft: int) -> dict:
    """Per suite: the median over prompts of each fixed length's and auto's speedup over plain decoding, the
    best fixed length (chosen after the fact), and auto's speedup over it."""
    parts = {LOOKUP: lookup_proposer(PromptLookupDrafter())}
    results = {}
    for suite, rows in recorded.items():
        per_prompt = [
            speedups_by_length(row["prompt"], row["output"][:new_tokens], parts, lambda _: LOOKUP, prices, max_draft)
            for row in rows
        ]
        results[suite] = auto_against_fixed(per_prompt)
    return results


@click.command()
@click.option("--engines", type=click.Path(path_type=Path), help="Engine directory [default: the default engines]")
@click.option("--recorded", type=click.Path(exists=True, path_type=Path), help="Replay this recording, make none.")
@click.option("--new-tokens", default=128, show_default=True, help="Tokens of each recorded continuation to replay.")
@click.option("--record-tokens", default=256, show_default=True, help="Tokens each new recording generates.")
@click.option(
    "--costs",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Price the draft lengths with the verify costs an earlier run wrote (its --out), measure none.",
)
@click.option("--cost-repeats", default=20, show_default=True, help="Timed passes per width and context.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/lookup_replay.json"), show_default=True)
def main(
    engines: Path | None,
    recorded: Path | None,
    new_tokens: int,
    record_tokens: int,
    costs: Path | None,
    cost_repeats: int,
    out: Path,
) -> None:
    """Replay prompt lookup on greedy recordings of the bench suites: what its drafts get right, and auto
    against fixed draft lengths with verify passes priced as measured on the engines."""
    if engines is None and (recorded is None or costs is None):
        engines = default_engines(Console(stderr=True))
    if recorded is not None:
        recording = {s: rows for s, rows in json.loads(recorded.read_text()).items() if s in SUITES}
    else:
        recording = record(engines, record_tokens)
    results = summarise(recording, new_tokens)
    for suite, settings in results.items():
        for name, figures in settings.items():
            bins = ", ".join(f"m={b}: {a:.2f} ({n})" for b, (a, n) in figures["first_draft_acceptance"].items())
            click.echo(f"{suite:14s} {name:22s} tau k=4 {figures['median_tau_k4']:.2f}; first draft right at {bins}")

    if costs is not None:
        earlier = json.loads(costs.read_text())["draft_lengths"]
        if tuple(earlier["contexts"]) != COST_CONTEXTS:
            raise click.UsageError(f"{costs} priced contexts {earlier['contexts']}, this script {list(COST_CONTEXTS)}")
        max_draft = earlier["max_draft"]
        prices = StepPrices(COST_CONTEXTS, {int(w): v for w, v in earlier["verify_seconds"].items()})
    else:
        max_draft = read_manifest(engines, verify_files=False).target.max_draft_len
        target = SpeculativeDecoder.from_engines(engines, draft=None).target
        prices = measure_step_prices(target, None, max_draft + 1, COST_CONTEXTS, cost_repeats)
    lengths = compare_draft_lengths(recording, new_tokens, prices, max_draft)
    click.echo("\nSpeedup over plain decoding (median over prompts), verify passes priced as measured:")
    click.echo(speedup_table(lengths))

    out.parent.mkdir(parents=True, exist_ok=True)
    draft_lengths = {
        "contexts": list(COST_CONTEXTS),
        "verify_seconds": prices.verify,
        "max_draft": max_draft,
        "suites": lengths,
    }
    out.write_text(json.dumps({"new_tokens": new_tokens, "results": results, "draft_lengths": draft_lengths}, indent=1))
    click.echo(f"Wrote {out}")


if __name__ == "__main__":
    main()
