"""From raw runs to the figures users compare: medians, pooled acceptance, the cost model, speedups.

Speedups are side by side: for each prompt, the method's median over repeats divided by the other
method's median on the same prompt, then the median over prompts. Acceptance, tau and per-position
acceptance pool every round of every run. The cost ratio c is one drafted token's drafting time over one
plain decoding step of the target, both measured in the same run on the same prompts; the ideal speedup
is tau / (gamma c + 1) with gamma the drafts per round actually made (so it holds for "auto", whose
gamma varies per round, and for rounds cut short near max_new_tokens); efficiency is the measured decode
speedup over that ideal: the gap is overhead the engine owns. Decode rates count the rounds only: the
draft's prefill of the prompt is a fixed cost per request, reported apart and included in tokens/s.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from specdec_trt.bench.agents import AGENTS
from specdec_trt.bench.methods import HEURISTIC, OURS, TRANSFORMERS, Method
from specdec_trt.draft_spec import AUTO
from specdec_trt.stats import ideal_speedup

PLAIN = Method(OURS, None).name
TRANSFORMERS_GENERATE = Method(TRANSFORMERS, None).name


def decode_tokens_per_s(run: dict) -> float | None:
    """Tokens after the first one per second of the rounds that made them: the time after the first token
    less the draft's prefill, a fixed cost per request reported on its own (None for a single token)."""
    decode_s = run["total_s"] - run["ttft_s"] - (run.get("draft_prefill_s") or 0.0)
    return (run["generated_tokens"] - 1) / decode_s if run["generated_tokens"] > 1 and decode_s > 0 else None


def per_prompt_medians(runs: Iterable[dict]) -> dict[str, dict[str, float]]:
    """For each prompt id: the median over repeats of tokens/s, decode tokens/s, time to first token and
    the draft's prefill."""
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        by_prompt[run["prompt_id"]].append(run)
    medians = {}
    for prompt_id, repeats in by_prompt.items():
        decode = [rate for rate in map(decode_tokens_per_s, repeats) if rate is not None]
        medians[prompt_id] = {
            "tokens_per_s": statistics.median(r["generated_tokens"] / r["total_s"] for r in repeats),
            "decode_tokens_per_s": statistics.median(decode) if decode else float("nan"),
            "ttft_s": statistics.median(r["ttft_s"] for r in repeats),
            "draft_prefill_s": statistics.median(r.get("draft_prefill_s") or 0.0 for r in repeats),
        }
    return medians


def median_ratio(numerator: dict[str, dict[str, float]], denominator: dict[str, dict[str, float]], key: str):
    """Median over the prompts both sides ran of numerator[key] / denominator[key]; None if none."""
    ratios = [numerator[p][key] / denominator[p][key] for p in numerator.keys() & denominator.keys()]
    return statistics.median(ratios) if ratios else None


def summarise(runs: list[dict], methods: list[Method], limits: dict | None = None) -> list[dict]:
    """One row per (suite, temperature, method) that has runs, in run order. ``limits``: the machine's read
    bandwidth and each plain method's weight bytes per token (``bandwidth_figures``)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[(run["suite"], run["temperature"], run["method"])].append(run)
    settings = list(dict.fromkeys((run["suite"], run["temperature"]) for run in runs))
    rows = []
    for suite, temperature in settings:
        medians = {m.name: per_prompt_medians(groups[(suite, temperature, m.name)]) for m in methods}
        plain_step_s = _pooled_step_s(groups[(suite, temperature, PLAIN)])
        for method in methods:
            method_runs = groups[(suite, temperature, method.name)]
            if method_runs:
                row = _row(method, method_runs, medians, plain_step_s) | bandwidth_figures(method, medians, limits)
                rows.append({"suite": suite, "temperature": temperature, **row})
    return rows


def _row(method: Method, runs: list[dict], medians: dict, plain_step_s: float | None) -> dict:
    mine = medians[method.name]
    rounds = sum(r["rounds"] for r in runs)
    accepted = sum(r["accepted_tokens"] for r in runs)
    row = {
        "method": method.name,
        "family": method.family,
        "draft": method.draft,
        "num_draft_tokens": method.num_draft_tokens,
        "prompts": len(mine),
        "runs": len(runs),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in mine.values()),
        "tokens_per_s_by_prompt": {prompt_id: m["tokens_per_s"] for prompt_id, m in mine.items()},
        "decode_tokens_per_s": statistics.median(m["decode_tokens_per_s"] for m in mine.values()),
        "ttft_ms": 1e3 * statistics.median(m["ttft_s"] for m in mine.values()),
        "draft_prefill_ms": 1e3 * statistics.median(m["draft_prefill_s"] for m in mine.values()),
        "tau": (accepted + rounds) / rounds if rounds else None,
        "speedup_vs_plain": median_ratio(mine, medians[PLAIN], "tokens_per_s"),
        "decode_speedup_vs_plain": median_ratio(mine, medians[PLAIN], "decode_tokens_per_s"),
        "speedup_vs_transformers_generate": median_ratio(mine, medians.get(TRANSFORMERS_GENERATE, {}), "tokens_per_s"),
        "speedup_vs_transformers_peer": None,
        "acceptance_rate": None,
        "per_position_acceptance": None,
        "drafts_per_round": None,
        "cost_ratio": None,
        "ideal_speedup": None,
        "efficiency": None,
        "same_tokens_as_plain": _all_or_none(r["same_tokens_as_plain"] for r in runs),
        "first_divergence": min((d for r in runs if (d := r.get("first_divergence")) is not None), default=None),
    }
    if method.family == OURS and method.draft is not None:
        # The same draft length, or transformers' own schedule for ours.
        peer_k = HEURISTIC if method.num_draft_tokens == AUTO else method.num_draft_tokens
        peer = Method(TRANSFORMERS, method.draft, peer_k).name
        row["speedup_vs_transformers_peer"] = median_ratio(mine, medians.get(peer, {}), "tokens_per_s")
        row |= _draft_figures(runs, plain_step_s, row["tau"], row["decode_speedup_vs_plain"])
    return row


def bandwidth_figures(method: Method, medians: dict, limits: dict | None) -> dict:
    """For a plain method whose weight bytes per token are known: the memory bandwidth its decode steps use
    (bytes per token x decode tokens/s, the median over prompts), the most tokens/s the machine's read
    bandwidth allows over those bytes, and the share of that bound it reaches."""
    figures = {"weight_mb_per_token": None, "used_GBps": None, "bound_tokens_per_s": None, "of_bound": None}
    weight_bytes = (limits or {}).get("weight_bytes_per_token", {}).get(method.name)
    if not weight_bytes or method.draft is not None:
        return figures
    rates = [m["decode_tokens_per_s"] for m in medians[method.name].values()]
    used = [rate * weight_bytes / 1e9 for rate in rates if rate == rate]  # NaN: a single-token run
    bound = limits["machine_read_GBps"] * 1e9 / weight_bytes
    figures |= {"weight_mb_per_token": weight_bytes / 1e6, "bound_tokens_per_s": bound}
    if used:
        median = statistics.median(used)
        figures |= {"used_GBps": median, "of_bound": median / limits["machine_read_GBps"]}
    return figures


def _draft_figures(runs: list[dict], plain_step_s: float | None, tau: float | None, decode_speedup) -> dict:
    """Acceptance, per-position acceptance and the cost model of one speculative method."""
    drafted = sum(r["drafted_tokens"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    width = max(len(r["drafted_per_position"]) for r in runs)
    by_position = [
        (sum(_at(r["accepted_per_position"], i) for r in runs), sum(_at(r["drafted_per_position"], i) for r in runs))
        for i in range(width)
    ]
    figures: dict = {
        "acceptance_rate": sum(r["accepted_tokens"] for r in runs) / drafted if drafted else None,
        "per_position_acceptance": [a / d if d else None for a, d in by_position],
        "drafts_per_round": drafted / rounds if rounds else None,
    }
    if drafted and plain_step_s and tau is not None:
        cost_ratio = sum(r["draft_s"] for r in runs) / drafted / plain_step_s
        ideal = ideal_speedup(tau, figures["drafts_per_round"], cost_ratio)
        figures |= {
            "cost_ratio": cost_ratio,
            "ideal_speedup": ideal,
            "efficiency": decode_speedup / ideal if decode_speedup is not None else None,
        }
    return figures


def _pooled_step_s(plain_runs: list[dict]) -> float | None:
    """Seconds per token of plain decoding after the first token, pooled over the runs (plain decoding has
    no draft prefill)."""
    tokens = sum(r["generated_tokens"] - 1 for r in plain_runs)
    return sum(r["total_s"] - r["ttft_s"] for r in plain_runs) / tokens if tokens else None


def agent_summary(runs: list[dict]) -> list[dict]:
    """Per temperature and method of the agent workload: time to first token of each agent's first call and of
    later calls (p50, p99), the whole workload's time (its calls' times, the median over the repeats that ran
    every call) and against plain decoding's (repeat by repeat, then the median), tokens/s, the share of prompt
    tokens found cached, and the acceptance of drafts from the store."""
    groups: dict[tuple[float, str], list[dict]] = defaultdict(list)
    for run in runs:
        if run["suite"] == AGENTS:
            groups[(run["temperature"], run["method"])].append(run)
    wholes = {key: _whole_by_repeat(calls) for key, calls in groups.items()}
    rows = []
    for (temperature, method), calls in groups.items():
        later = [c["ttft_s"] for c in calls if c["call"] > 0]
        drafted = sum(c["store_drafted_tokens"] or 0 for c in calls)
        accepted = sum(c["store_accepted_tokens"] or 0 for c in calls)
        whole, plain = wholes[(temperature, method)], wholes.get((temperature, PLAIN), {})
        paired = [whole[r] / plain[r] for r in whole.keys() & plain.keys()]
        rows.append(
            {
                "temperature": temperature,
                "method": method,
                "calls": len(calls),
                "first_call_ttft_p50_ms": 1e3 * percentile([c["ttft_s"] for c in calls if c["call"] == 0], 50),
                "later_calls_ttft_p50_ms": 1e3 * percentile(later, 50),
                "later_calls_ttft_p99_ms": 1e3 * percentile(later, 99),
                "whole_s": statistics.median(whole.values()),
                "whole_vs_plain": statistics.median(paired) if paired else None,
                "tokens_per_s": sum(c["generated_tokens"] for c in calls) / sum(c["total_s"] for c in calls),
                "cached_share": sum(c["cached_prompt_tokens"] for c in calls) / sum(c["prompt_tokens"] for c in calls),
                "store_drafted_tokens": drafted,
                "store_acceptance": accepted / drafted if drafted else None,
                "same_tokens_as_plain": _all_or_none(c["same_tokens_as_plain"] for c in calls),
            }
        )
    return rows


def _whole_by_repeat(calls: list[dict]) -> dict[int, float]:
    """The workload's time in each repeat that ran every call (as many as the fullest repeat: an interrupted
    run's last repeat is left out)."""
    times: dict[int, list[float]] = defaultdict(list)
    for call in calls:
        times[call["repeat"]].append(call["total_s"])
    most = max(len(t) for t in times.values())
    return {repeat: sum(t) for repeat, t in times.items() if len(t) == most}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (NaN for none)."""
    return float(np.percentile(values, q)) if values else float("nan")


def _at(values: list[int], index: int) -> int:
    return values[index] if index < len(values) else 0


def _all_or_none(flags: Iterable[bool | None]) -> bool | None:
    known = [flag for flag in flags if flag is not None]
    return all(known) if known else None
