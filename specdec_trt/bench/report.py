"""Markdown from a benchmark's JSON: the tables printed on stdout and the whole docs/BENCHMARKS.md."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path

from specdec_trt.bench.methods import HEURISTIC, OURS, TRANSFORMERS, Method
from specdec_trt.bench.peers_report import peers_section
from specdec_trt.bench.summary import PLAIN, TRANSFORMERS_GENERATE
from specdec_trt.draft_spec import AUTO

_COLUMNS = (
    ("method", "method", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("TTFT ms", "ttft_ms", "{:.0f}"),
    ("draft prefill ms", "draft_prefill_ms", "{:.0f}"),
    ("vs plain", "speedup_vs_plain", "{:.2f}x"),
    ("accept", "acceptance_rate", "{:.2f}"),
    ("tau", "tau", "{:.2f}"),
    ("drafts/round", "drafts_per_round", "{:.2f}"),
    ("c", "cost_ratio", "{:.3f}"),
    ("ideal", "ideal_speedup", "{:.2f}x"),
    ("measured/ideal", "efficiency", "{:.2f}"),
    ("vs transformers generate", "speedup_vs_transformers_generate", "{:.2f}x"),
    ("vs transformers same method", "speedup_vs_transformers_peer", "{:.2f}x"),
    ("same tokens as plain", "same_tokens_as_plain", "{}"),
)


def _cell(value, template: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return template.format(value)


def _setting(row: dict) -> tuple[str, float]:
    return row["suite"], row["temperature"]


def markdown_tables(summary: Sequence[dict]) -> str:
    """One table per suite and temperature, every method a row."""
    parts = []
    for (suite, temperature), rows in groupby(summary, key=_setting):
        rows = list(rows)
        sampling = "greedy" if temperature == 0 else f"temperature {temperature}"
        parts.append(f"### {suite}, {sampling} ({rows[0]['prompts']} prompts)\n")
        parts.append("| " + " | ".join(title for title, _, _ in _COLUMNS) + " |")
        parts.append("|" + "---|" * len(_COLUMNS))
        for row in rows:
            parts.append("| " + " | ".join(_cell(row.get(key), fmt) for _, key, fmt in _COLUMNS) + " |")
        parts.append("")
    return "\n".join(parts)


def agent_table(rows: list[dict]) -> str:
    """The agent summary as a markdown table; empty without agent runs."""
    if not rows:
        return ""
    lines = [
        "| sampling | method | TTFT first call p50 | later calls p50 | p99 | whole | vs plain | tok/s | cached "
        "| store acceptance | same tokens as plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        acceptance, drafted = row["store_acceptance"], row["store_drafted_tokens"]
        store = "-" if acceptance is None else f"{acceptance:.2f} of {drafted}"
        same = {None: "-", True: "yes", False: "NO"}[row["same_tokens_as_plain"]]
        vs_plain = "-" if row["whole_vs_plain"] is None else f"{row['whole_vs_plain']:.2f}x"
        cells = [
            "greedy" if row["temperature"] == 0 else f"t={row['temperature']}",
            row["method"],
            f"{row['first_call_ttft_p50_ms']:.0f} ms",
            f"{row['later_calls_ttft_p50_ms']:.0f} ms",
            f"{row['later_calls_ttft_p99_ms']:.0f} ms",
            f"{row['whole_s']:.1f} s",
            vs_plain,
            f"{row['tokens_per_s']:.1f}",
            f"{100 * row['cached_share']:.0f}%",
            store,
            same,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def auto_table(summary: Sequence[dict]) -> str:
    """Per suite, temperature and draft measured with num_draft_tokens "auto": its tok/s against the best
    fixed gamma's (highest tok/s) and transformers' heuristic schedule on the same draft, when measured;
    empty when no "auto" method ran. Beside the ratio of the medians, the same ratio taken prompt by prompt
    (the median and the range over prompts), which shows how far the machine's noise and the prompts move it."""
    lookup = {(*_setting(r), r["method"]): r for r in summary}
    lines = []
    for auto in (r for r in summary if r["family"] == OURS and r["num_draft_tokens"] == AUTO):
        fixed = [
            r
            for r in summary
            if _setting(r) == _setting(auto)
            and r["family"] == OURS
            and r["draft"] == auto["draft"]
            and not isinstance(r["num_draft_tokens"], str)
        ]
        best = max(fixed, key=lambda r: r["tokens_per_s"]) if fixed else {}
        heuristic = lookup.get((*_setting(auto), Method(TRANSFORMERS, auto["draft"], HEURISTIC).name), {})
        ratio = auto["tokens_per_s"] / best["tokens_per_s"] if best else None
        cells = [
            auto["suite"],
            "greedy" if auto["temperature"] == 0 else f"t={auto['temperature']}",
            auto["draft"],
            f"k={best['num_draft_tokens']}" if best else "-",
            _cell(best.get("tokens_per_s"), "{:.1f}"),
            _cell(auto["tokens_per_s"], "{:.1f}"),
            _cell(ratio, "{:.3f}"),
            _per_prompt_ratio(auto, best),
            _cell(auto["drafts_per_round"], "{:.2f}"),
            _cell(heuristic.get("tokens_per_s"), "{:.1f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return ""
    header = (
        "| suite | sampling | draft | best fixed gamma | its tok/s | auto tok/s | auto / best fixed "
        "| per prompt: median (range) | auto drafts per round | transformers heuristic tok/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *lines]) + "\n"


def _per_prompt_ratio(auto: dict, best: dict) -> str:
    """auto / best tok/s prompt by prompt, as "median (lowest-highest)"; "-" when no prompt has both."""
    mine, theirs = auto.get("tokens_per_s_by_prompt") or {}, best.get("tokens_per_s_by_prompt") or {}
    ratios = sorted(mine[p] / theirs[p] for p in mine.keys() & theirs.keys())
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.3f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def best_speculative(summary: Sequence[dict]) -> dict[tuple[str, float], dict]:
    """For each suite and temperature, our speculative method with the highest speedup over plain."""
    best: dict[tuple[str, float], dict] = {}
    for row in summary:
        if row["family"] == OURS and row["draft"] is not None and row["speedup_vs_plain"] is not None:
            key = _setting(row)
            if key not in best or row["speedup_vs_plain"] > best[key]["speedup_vs_plain"]:
                best[key] = row
    return best


def headline_table(summary: Sequence[dict]) -> str:
    """Per suite and temperature: plain, transformers generate, and our best speculative method."""
    lookup = {(*_setting(r), r["method"]): r for r in summary}
    lines = [
        "| suite | sampling | plain tok/s | transformers generate tok/s | plain vs transformers "
        "| best speculative | tok/s | vs plain | vs transformers generate | acceptance | c |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (suite, temperature), row in best_speculative(summary).items():
        plain = lookup.get((suite, temperature, PLAIN), {})
        hf = lookup.get((suite, temperature, TRANSFORMERS_GENERATE), {})
        cells = [
            suite,
            "greedy" if temperature == 0 else f"t={temperature}",
            _cell(plain.get("tokens_per_s"), "{:.1f}"),
            _cell(hf.get("tokens_per_s"), "{:.1f}"),
            _cell(plain.get("speedup_vs_transformers_generate"), "{:.2f}x"),
            row["method"],
            _cell(row["tokens_per_s"], "{:.1f}"),
            _cell(row["speedup_vs_plain"], "{:.2f}x"),
            _cell(row["speedup_vs_transformers_generate"], "{:.2f}x"),
            _cell(row["acceptance_rate"], "{:.2f}"),
            _cell(row["cost_ratio"], "{:.3f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def reading(summary: Sequence[dict]) -> str:
    """Where speculation paid in this run and where it did not, in the cost model's terms."""
    lines = []
    for (suite, temperature), row in best_speculative(summary).items():
        sampling = "greedy" if temperature == 0 else f"at temperature {temperature}"
        verdict = "pays" if row["speedup_vs_plain"] > 1 else "does not pay"
        figures = f"acceptance {_cell(row['acceptance_rate'], '{:.2f}')}, tau {_cell(row['tau'], '{:.2f}')}"
        if row["cost_ratio"] is not None:
            figures += (
                f", c {row['cost_ratio']:.3f}: ideal {row['ideal_speedup']:.2f}x, "
                f"measured/ideal {_cell(row['efficiency'], '{:.2f}')}"
            )
        lines.append(
            f"- **{suite}**, {sampling}: speculation {verdict}; the best method is {row['method']} at "
            f"{row['speedup_vs_plain']:.2f}x plain ({figures})."
        )
    return "\n".join(lines + [""] + _draft_lines(summary)) + "\n"


def _draft_lines(summary: Sequence[dict]) -> list[str]:
    """Per draft, over every suite and gamma: the range of its cost ratio, acceptance and speedup."""
    lines = []
    ours = [r for r in summary if r["family"] == OURS and r["draft"] is not None and r["cost_ratio"] is not None]
    for draft in dict.fromkeys(r["draft"] for r in ours):
        rows = [r for r in ours if r["draft"] == draft]

        def span(key: str, template: str, rows: list[dict] = rows) -> str:
            values = [r[key] for r in rows if r[key] is not None]
            low, high = template.format(min(values)), template.format(max(values))
            return low if low == high else f"{low} to {high}"

        prefill = span("draft_prefill_ms", "{:.0f}")
        lines.append(
            f"- The **{draft}** draft costs c = {span('cost_ratio', '{:.3f}')} of a target step per drafted token "
            f"and is accepted at {span('acceptance_rate', '{:.2f}')}: ideal speedups "
            f"{span('ideal_speedup', '{:.2f}x')}, measured {span('speedup_vs_plain', '{:.2f}x')} over plain "
            f"(measured/ideal over the rounds {span('efficiency', '{:.2f}')})"
            + ("." if prefill == "0" else f"; its own prefill of the prompt adds {prefill} ms per request.")
        )
    return lines


def _auto_section(summary: Sequence[dict]) -> str:
    table = auto_table(summary)
    if not table:
        return ""
    return f"""## Auto draft length vs the best fixed gamma

With `num_draft_tokens="auto"` the decoder chooses each round's gamma from the acceptance and the costs it
has measured so far (maximising expected tokens per second under the cost model, with the acceptance of
each draft position measured apart); a model draft then drafts until one more token is expected to add
fewer tokens than it costs, judged from its own confidence as calibrated on the drafts verified so far.
The best fixed gamma is picked after the fact, per suite; auto has to find it on line.

{table}
"""


def _agents_section(rows: Sequence[dict]) -> str:
    if not rows:
        return ""
    return f"""## Agent loops

Agents run one after another, each call sending its whole history again (a shared system prompt of tool schemas
and rules, then the task, and each answer followed by a tool's result). Each of our methods runs the workload on
a decoder that keeps its prefix cache and its store of earlier requests' text across calls, as a server does,
reset before and after. "whole" is the workload's time (the median over repeats), "cached" the share of prompt
tokens found in the prefix cache, "store acceptance" that of the drafts taken from earlier requests' text.

{agent_table(rows)}
"""


def benchmarks_document(
    data: dict, plots: Sequence[Path], document: Path, rerender: str, others: Sequence[dict] = ()
) -> str:
    """docs/BENCHMARKS.md: the command, the machine, the headline, every table, the plots and a reading, with
    the peers and the bandwidth limit of this run and of the ``others`` (runs on another class of weights).
    ``rerender`` is the command that writes this document again from the runs' JSON, measuring nothing."""
    env = data["environment"]
    versions = ", ".join(f"{name} {version}" for name, version in env["packages"].items())
    images = "\n".join(f"![{p.stem}]({os.path.relpath(p, document.parent)})" for p in plots)
    summary, config = data["summary"], data["config"]
    peer_sections = "".join(peers_section(run) + "\n" for run in (data, *others))
    length = f"{config['max_new_tokens']} new tokens" + (
        " each (EOS ignored, so that every method makes as many)" if config["ignore_eos"] else " at most (stop at EOS)"
    )
    return f"""# Benchmarks

Generated by `specdec-bench`; do not edit by hand. The run that measured it:

```bash
{data["command"]}
```

The command that writes this page and its plots again from that run's JSON, measuring nothing:

```bash
{rerender}
```

Machine: {env["cpu"]}, {env["cores"]} cores, {env["threads"]} threads; {env["platform"]}; device {env["device"]}.
Packages: {versions}. Revision {env["git_revision"]}. Run status: {data["status"]}.

Every method runs on the same prompts (ours and the in-process peers in one process, llama.cpp in servers of its
own), methods alternating within each repeat, after a warm-up; figures are medians over prompts of each prompt's
median over {config["repeats"]} repeats, with
{length}. Speedups are per prompt, side by side, then the median. "plain" is
target-only decoding on the same engine: the baseline. tok/s counts every generated token over the whole
request; "draft prefill" is the draft model's pass over the prompt, a fixed cost per request.

## Headline

{headline_table(summary)}
## How to read the cost model

A round drafts gamma tokens at c target-steps each and verifies them in one target pass, which yields
tau tokens (the accepted drafts plus the target's own token). With plain decoding costing one target step
per token, the ideal speedup is tau / (gamma c + 1). Speculation pays when the drafts are both cheap
(small c) and often right (high acceptance): prompt lookup costs almost nothing (c near 0) and wins
wherever the output copies the prompt (extraction, summarisation, code that repeats identifiers), but
proposes little on free-form chat; a model draft proposes everywhere, at its cost c per token.
"measured/ideal" is the engine's efficiency over the decoding rounds (the draft's prefill excluded, as the
model has no term for it): the extra cost of a verify pass of gamma + 1 tokens over one step, sampling and
Python overhead are what separate the two.

## Reading this run

{reading(summary)}
{_auto_section(summary)}{_agents_section(data.get("agents") or [])}{peer_sections}## Plots

{images}

## Every method

{markdown_tables(summary)}"""
