"""PNG plots of a benchmark summary: tokens/s per suite, speedup vs gamma, per-position acceptance, measured
vs ideal.

Scheduled draft lengths (ours "auto", transformers' "heuristic") have no gamma: the speedup plot draws
each as a horizontal dash-dot line in its draft's colour, the per-position plot leaves them out, and the
measured-vs-ideal plot places them like any other point (their ideal uses the drafts actually made).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from specdec_trt.bench.methods import OURS  # noqa: E402
from specdec_trt.bench.peers_report import compared_rows  # noqa: E402

_COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def write_plots(summary: Sequence[dict], directory: Path) -> list[Path]:
    """Write the plots into ``directory``; their paths (the speculative ones only when something drafted)."""
    if not summary:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    paths = [_tokens_per_suite(summary, directory / "tokens_per_s.png")]
    speculative = [r for r in summary if r["draft"] is not None]
    if speculative:
        suites = list(dict.fromkeys(r["suite"] for r in speculative))
        paths += [
            _speedup_vs_gamma(speculative, suites, directory / "speedup_vs_gamma.png"),
            _per_position(speculative, suites, directory / "per_position_acceptance.png"),
            _measured_vs_ideal(speculative, directory / "measured_vs_ideal.png"),
        ]
    return [p for p in paths if p is not None]


def _tokens_per_suite(summary: Sequence[dict], path: Path) -> Path | None:
    """Bars of tokens/s per suite: every plain method and each family's fastest speculative one, greedy."""
    greedy = [r for r in summary if r["temperature"] == 0]
    if not greedy:
        return None
    suites = list(dict.fromkeys(r["suite"] for r in greedy))
    by_suite = {suite: compared_rows([r for r in greedy if r["suite"] == suite]) for suite in suites}
    methods = list(dict.fromkeys(r["method"] for rows in by_suite.values() for r in rows))
    figure, (ax,) = _axes(1, "Tokens/s per suite, greedy: plain methods and each family's fastest speculative one")
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        rates = [next((r["tokens_per_s"] for r in by_suite[s] if r["method"] == method), 0.0) for s in suites]
        ax.bar([x + i * width for x in range(len(suites))], rates, width, label=method, color=_COLORS[i % len(_COLORS)])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(suites))], suites)
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=6)
    return _save(figure, path)


def _is_fixed(row: dict) -> bool:
    """Whether the row drafts a fixed gamma (not a schedule such as "auto" or "heuristic")."""
    return not isinstance(row["num_draft_tokens"], str)


def _label(row: dict) -> str:
    return f"{row['family']} {row['draft']} t={row['temperature']:g}"


def _series(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Rows grouped into lines: one per family, draft and temperature, sorted by gamma (schedules last)."""
    lines: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        lines[_label(row)].append(row)
    return {label: sorted(points, key=_gamma_order) for label, points in lines.items()}


def _gamma_order(row: dict) -> tuple[bool, int]:
    return not _is_fixed(row), row["num_draft_tokens"] if _is_fixed(row) else 0


def _axes(count: int, title: str):
    figure, axes = plt.subplots(1, count, figsize=(max(7.0, 4.5 * count), 4.2), squeeze=False, sharey=True)
    figure.suptitle(title, fontsize=10)
    return figure, axes[0]


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _speedup_vs_gamma(rows: Sequence[dict], suites: list[str], path: Path) -> Path:
    figure, axes = _axes(len(suites), "Speedup over plain decoding vs draft tokens per round")
    for ax, suite in zip(axes, suites):
        here = [r for r in rows if r["suite"] == suite]
        colors = {}
        for label, points in _series([r for r in here if _is_fixed(r)]).items():
            gammas = [p["num_draft_tokens"] for p in points]
            (line,) = ax.plot(gammas, [p["speedup_vs_plain"] for p in points], marker="o", label=label)
            colors[label] = line.get_color()
            if points[0]["ideal_speedup"] is not None:
                ideal = [p["ideal_speedup"] for p in points]
                ax.plot(gammas, ideal, linestyle="--", color=line.get_color(), alpha=0.6, label=f"{label} ideal")
        for row in (r for r in here if not _is_fixed(r) and r["speedup_vs_plain"] is not None):
            color = colors.setdefault(_label(row), _COLORS[len(colors) % len(_COLORS)])
            label = f"{_label(row)} {row['num_draft_tokens']}"
            ax.axhline(row["speedup_vs_plain"], linestyle="-.", color=color, linewidth=1.2, label=label)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=suite, xlabel="gamma")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("tokens/s over plain")
    return _save(figure, path)


def _per_position(rows: Sequence[dict], suites: list[str], path: Path) -> Path | None:
    ours = [r for r in rows if r["family"] == OURS and r["per_position_acceptance"] and _is_fixed(r)]
    if not ours:
        return None
    figure, axes = _axes(len(suites), "Acceptance by draft position (largest gamma)")
    for ax, suite in zip(axes, suites):
        for label, points in _series([r for r in ours if r["suite"] == suite]).items():
            rates = points[-1]["per_position_acceptance"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{label} k={points[-1]['num_draft_tokens']}")
        ax.set(title=suite, xlabel="draft position", ylim=(0, 1.05))
        ax.legend(fontsize=6)
    axes[0].set_ylabel("acceptance rate")
    return _save(figure, path)


def _measured_vs_ideal(rows: Sequence[dict], path: Path) -> Path | None:
    points = [r for r in rows if r["ideal_speedup"] is not None and r["decode_speedup_vs_plain"] is not None]
    if not points:
        return None
    figure, (ax,) = _axes(1, "Measured decode speedup vs the cost model's ideal")
    for suite, marker in zip(dict.fromkeys(p["suite"] for p in points), "os^Dvp<>"):
        for (label, series), color in zip(_series([p for p in points if p["suite"] == suite]).items(), _COLORS):
            ideal = [p["ideal_speedup"] for p in series]
            measured = [p["decode_speedup_vs_plain"] for p in series]
            ax.scatter(ideal, measured, marker=marker, color=color, label=f"{suite}: {label}")
    top = max(max(p["ideal_speedup"], p["decode_speedup_vs_plain"]) for p in points) * 1.05
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="measured = ideal")
    ax.set(xlabel="ideal tau / (gamma c + 1)", ylabel="measured decode speedup", xlim=(0, top), ylim=(0, top))
    ax.legend(fontsize=6)
    return _save(figure, path)
