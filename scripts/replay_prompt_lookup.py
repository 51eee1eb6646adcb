"""Prompt lookup replayed exactly on recorded outputs: how often its drafts are right, by match length, and how
auto draft lengths compare with fixed ones, for greedy and for sampled decoding.

Greedy output does not depend on the drafter, so one plain greedy continuation per bench prompt (EOS ignored,
as specdec-bench does) fixes every round a drafter would see: a round proposes up to k tokens after the
committed text, keeps the prefix that equals the recorded continuation, and commits one token more. Sampled
output does not either, in distribution: prompt lookup's drafts are deterministic (q is one-hot on the drafted
token), so rejection sampling accepts a drafted token exactly when the token it emits there is that token, and
every emitted token is a sample of the target's own distribution. A plain sampled continuation therefore
fixes every round just as a greedy one does, and the rounds of a speculative run have the same distribution as
those replayed on plain samples (``--temperature``, several ``--seeds`` a prompt; every method replays the
same samples). This prints, per suite and lookup setting, the acceptance of a round's first drafted token by
the length of the longest suffix of the committed text that occurred before, and the tokens per round (tau)
at k=4.

It then prices every round by the target's verify pass, timed on the engines for each width (1 to the
engines' max draft length + 1) at a few context lengths and interpolated between them, and compares fixed
draft lengths with auto: the decoder's own ``DraftLengthController``, fed each round's drafts, acceptances,
lookup's confidences and price as the decoder feeds it, and again with auto's rounds not stopped on that
confidence, as before prompt lookup reported one. The acceptances are exact; the times are a model (lookup's
own ~0.1 ms and the decoder's sub-millisecond work per round are left out), so machine noise cannot decide the
comparison. Everything is written as JSON.

    .venv/bin/python scripts/replay_prompt_lookup.py --out results/lookup_replay.json
    .venv/bin/python scripts/replay_prompt_lookup.py --recorded greedy.json   # replay an earlier recording
    .venv/bin/python scripts/replay_prompt_lookup.py --recorded greedy.json --costs results/lookup_replay.json
    .venv/bin/python scripts/replay_prompt_lookup.py --temperature 0.8 --seeds 4 --record-tokens 128 \
        --costs results/lookup_replay.json --out results/lookup_replay_sampled.json
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import click
import numpy as np
from rich.console import Console

from benchlib.replay import (
    COST_CONTEXTS,
    StepPrices,
    auto_against_fixed,
    fixed_length_rounds,
    lookup_proposer,
    measure_step_prices,
    speedup_table,
    speedups_by_length,
)
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.suites import SUITES, load_suite
from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.build_progress import default_engines_shown
from specdec_trt.drafting import LOOKUP, PromptLookupDrafter

SETTINGS = {"max 3, min 2 (before)": (3, 2), "max 4, min 1 (now)": (4, 1)}
LONGEST_MATCH = 8  # match lengths are measured up to this
MATCH_BINS = {"1": (1, 1), "2": (2, 2), "3-7": (3, 7), "8+": (8, LONGEST_MATCH)}  # inclusive ranges
LONGEST_SUFFIX = PromptLookupDrafter(max_ngram=LONGEST_MATCH)  # matches the longest recurring suffix


def record(engines: Path, new_tokens: int, temperature: float, seeds: int) -> dict[str, list[dict]]:
    """Plain continuations of every bench prompt, EOS ignored: greedy, or sampled at ``temperature`` once per
    seed (the seeds of a prompt in one batch). {suite: [{id, seed, temperature, prompt, output}]}."""
    decoder = SpeculativeDecoder.from_engines(engines, draft="none")
    runs = range(seeds if temperature > 0 else 1)
    recorded: dict[str, list[dict]] = {}
    for suite in SUITES:
        rows = recorded.setdefault(suite, [])
        for prompt in load_suite(suite).prompts:
            text = decoder.apply_chat_template(prompt.prompt) if prompt.chat else prompt.prompt
            ids = decoder.tokenize(text)
            params = [
                SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=seed, ignore_eos=True)
                for seed in runs
            ]
            outputs = decoder.generate_batch([ids] * len(params), params, 0)
            rows += [
                {"id": prompt.id, "seed": seed, "temperature": temperature, "prompt": ids, "output": output.token_ids}
                for seed, output in zip(runs, outputs)
            ]
            click.echo(f"recorded {suite} {prompt.id}", err=True)
    return recorded


def match_length(sequence: np.ndarray) -> int:
    """Length of the longest suffix (up to ``LONGEST_MATCH``) that occurred earlier in the sequence; 0 if none."""
    return LONGEST_SUFFIX.match(sequence, 1)[0]


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


def compare_draft_lengths(
    recorded: dict[str, list[dict]], new_tokens: int, prices: StepPrices, max_draft: int, confidence_stop: bool
) -> dict:
    """Per suite: the median over the recorded continuations (sampled ones: every seed of every prompt) of each
    fixed length's and auto's speedup over plain decoding, the best fixed length (chosen after the fact), and
    auto's speedup over it. Prompt lookup drafts as the decoder runs it, or, without ``confidence_stop``, as it
    did before it reported a confidence: auto's rounds then draft the length its controller chooses."""
    propose = lookup_proposer(PromptLookupDrafter())
    parts = {LOOKUP: propose if confidence_stop else lambda committed, length, _: propose(committed, length, None)}
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
    "--temperature",
    default=0.0,
    show_default=True,
    help="Record sampled continuations at this temperature (0: greedy).",
)
@click.option("--seeds", default=1, show_default=True, help="Sampled continuations recorded per prompt, one per seed.")
@click.option("--save-recording", type=click.Path(path_type=Path), help="Also write a new recording here.")
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
    temperature: float,
    seeds: int,
    save_recording: Path | None,
    costs: Path | None,
    cost_repeats: int,
    out: Path,
) -> None:
    """Replay prompt lookup on greedy or sampled recordings of the bench suites: what its drafts get right, and
    auto against fixed draft lengths with verify passes priced as measured on the engines."""
    if temperature < 0 or seeds < 1:
        raise click.UsageError("--temperature must be >= 0 and --seeds >= 1")
    if recorded is not None and (temperature or seeds > 1 or save_recording):
        raise click.UsageError("--temperature, --seeds and --save-recording make a new recording: drop --recorded")
    if engines is None and (recorded is None or costs is None):
        engines = default_engines_shown(Console(stderr=True))
    if recorded is not None:
        recording = {s: rows for s, rows in json.loads(recorded.read_text()).items() if s in SUITES}
    else:
        recording = record(engines, record_tokens, temperature, seeds)
        if save_recording is not None:
            save_recording.parent.mkdir(parents=True, exist_ok=True)
            save_recording.write_text(json.dumps(recording))
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
        target = SpeculativeDecoder.from_engines(engines, draft="none").target
        prices = measure_step_prices(target, None, max_draft + 1, COST_CONTEXTS, cost_repeats)
    lengths = compare_draft_lengths(recording, new_tokens, prices, max_draft, confidence_stop=True)
    before = compare_draft_lengths(recording, new_tokens, prices, max_draft, confidence_stop=False)
    click.echo("\nSpeedup over plain decoding (median over continuations), verify passes priced as measured:")
    click.echo(speedup_table(lengths))
    click.echo("\nThe same, auto's rounds not stopped on lookup's confidence (before):")
    click.echo(speedup_table(before))

    out.parent.mkdir(parents=True, exist_ok=True)
    draft_lengths = {
        "contexts": list(COST_CONTEXTS),
        "verify_seconds": prices.verify,
        "max_draft": max_draft,
        "suites": lengths,
        "suites_without_confidence_stop": before,
    }
    rows = [row for suite_rows in recording.values() for row in suite_rows]
    sampling = {
        "temperature": rows[0].get("temperature", 0.0),  # recordings before sampled ones were greedy
        "continuations_per_prompt": len(rows) // len({(row["id"], tuple(row["prompt"])) for row in rows}),
    }
    body = {"new_tokens": new_tokens, "sampling": sampling, "results": results, "draft_lengths": draft_lengths}
    out.write_text(json.dumps(body, indent=1))
    click.echo(f"Wrote {out}")


if __name__ == "__main__":
    main()
