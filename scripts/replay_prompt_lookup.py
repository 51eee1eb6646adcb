"""Prompt lookup replayed exactly on recorded greedy outputs: how often its drafts are right, by match length.

Greedy output does not depend on the drafter, so one plain greedy continuation per bench prompt (EOS ignored,
as specdec-bench does) fixes every round a drafter would see: a round proposes up to k tokens after the
committed text, keeps the prefix that equals the recorded continuation, and commits one token more. This
prints, per suite and lookup setting, the acceptance of a round's first drafted token by the length of the
longest suffix of the committed text that occurred before, and the tokens per round (tau) at k=4; and writes
them as JSON.

    .venv/bin/python scripts/replay_prompt_lookup.py --out results/lookup_replay.json
    .venv/bin/python scripts/replay_prompt_lookup.py --recorded greedy.json   # replay an earlier recording
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import click
import numpy as np
from rich.console import Console

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.suites import SUITES, load_suite
from specdec_trt.cli import default_engines
from specdec_trt.drafting import PromptLookupDrafter

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


def replay(prompt: list[int], output: list[int], drafter: PromptLookupDrafter, k: int) -> tuple[list, float]:
    """[(matched length, first draft right)] over the rounds that drafted, and tau at draft length ``k``."""
    sequence = np.asarray(prompt + output)
    position, end = len(prompt) + 1, len(sequence)  # the first token comes from the prefill
    first_drafts, rounds, committed = [], 0, 0
    while position < end:
        context = sequence[:position]
        draft = drafter.lookup(context, min(k, end - position - 1))
        accepted = 0
        while accepted < len(draft) and draft[accepted] == sequence[position + accepted]:
            accepted += 1
        if len(draft):
            first_drafts.append((match_length(context), accepted > 0))
        position += accepted + 1
        rounds, committed = rounds + 1, committed + accepted + 1
    return first_drafts, committed / max(rounds, 1)


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


@click.command()
@click.option("--engines", type=click.Path(path_type=Path), help="Engine directory [default: the default engines]")
@click.option("--recorded", type=click.Path(exists=True, path_type=Path), help="Replay this recording, make none.")
@click.option("--new-tokens", default=128, show_default=True, help="Tokens of each recorded continuation to replay.")
@click.option("--record-tokens", default=256, show_default=True, help="Tokens each new recording generates.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/lookup_replay.json"), show_default=True)
def main(engines: Path | None, recorded: Path | None, new_tokens: int, record_tokens: int, out: Path) -> None:
    """Replay prompt lookup on greedy recordings of the bench suites and print what it gets right."""
    if recorded is not None:
        recording = {s: rows for s, rows in json.loads(recorded.read_text()).items() if s in SUITES}
    else:
        recording = record(engines or default_engines(Console(stderr=True)), record_tokens)
    results = summarise(recording, new_tokens)
    for suite, settings in results.items():
        for name, figures in settings.items():
            bins = ", ".join(f"m={b}: {a:.2f} ({n})" for b, (a, n) in figures["first_draft_acceptance"].items())
            click.echo(f"{suite:14s} {name:22s} tau k=4 {figures['median_tau_k4']:.2f}; first draft right at {bins}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"new_tokens": new_tokens, "results": results}, indent=1))
    click.echo(f"Wrote {out}")


if __name__ == "__main__":
    main()
