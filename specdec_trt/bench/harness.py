"""The benchmark loop: every method on every prompt, alternating inside each repeat, after a warm-up.

Methods alternate per prompt and repeat so that drifting machine load hits all of them alike. After
every prompt the results file is rewritten atomically (a temporary file renamed over it), so an
interrupted run leaves valid JSON holding every finished prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specdec_trt.bench.methods import Method, Run
from specdec_trt.bench.suites import BenchPrompt, Suite
from specdec_trt.bench.summary import agent_summary, summarise
from specdec_trt.sampling import SamplingParams

SCHEMA = "specdec-bench/1"
WARMUP_TOKENS = 8


class Runner(Protocol):
    def run(self, method: Method, prompt_ids: list[int], params: SamplingParams) -> tuple[Run, list[int]]: ...


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. Each prompt and repeat seeds its sampled requests with its own seed, the same for
    every method: a sampled method's median then pools ``repeats`` texts per prompt, so no method is timed
    on a single lucky or unlucky draw (how many drafts are accepted depends on the text). ``ignore_eos``
    gives every method the same number of tokens."""

    suites: tuple[str, ...]
    num_draft_tokens: tuple[int | str, ...]  # integers and "auto"
    temperatures: tuple[float, ...]
    max_new_tokens: int = 128
    repeats: int = 3
    limit: int | None = None
    warmup: bool = True
    seed: int = 0
    ignore_eos: bool = True

    def params(
        self, temperature: float, index: int, repeat: int = 0, max_new_tokens: int | None = None
    ) -> SamplingParams:
        """The request of prompt ``index`` in repeat ``repeat``: seed ``seed + index * repeats + repeat``."""
        return SamplingParams(
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            temperature=temperature,
            seed=self.seed + index * self.repeats + repeat,
            ignore_eos=self.ignore_eos,
        )


@dataclass
class BenchResults:
    """Everything a run measured, kept ready to write as JSON at any moment."""

    config: BenchConfig
    methods: list[Method]
    environment: dict[str, Any]
    command: str
    runs: list[dict] = field(default_factory=list)
    status: str = "running"
    weights: str = "float32"  # the class of our target's weights: "float32" or "4-bit"
    limits: dict[str, Any] = field(default_factory=dict)  # read bandwidth, weight bytes, our step's breakdown
    notes: list[str] = field(default_factory=list)  # peers skipped, and why

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "status": self.status,
            "command": self.command,
            "config": asdict(self.config),
            "environment": self.environment,
            "weights": self.weights,
            "limits": self.limits,
            "notes": self.notes,
            "methods": [asdict(m) | {"name": m.name} for m in self.methods],
            "summary": summarise(self.runs, self.methods, self.limits),
            "agents": agent_summary(self.runs),
            "runs": self.runs,
        }

    def write(self, path: Path) -> None:
        """Write atomically: readers see the previous complete file or the new one, never a torn one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(partial, path)


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """The index of the first token where ``tokens`` differs from ``reference`` (a length too); None if equal."""
    if list(tokens) == list(reference):
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def run_benchmark(
    results: BenchResults,
    suites: Sequence[Suite],
    runners: dict[str, Runner],
    encode: Callable[[BenchPrompt], list[int]],
    on_run: Callable[[str], None] = lambda description: None,
    on_prompt: Callable[[], None] = lambda: None,
) -> None:
    """Fill ``results.runs``: per suite and temperature, a warm-up of every method, then each prompt's
    repeats with all methods in turn. ``on_run`` is told before each timed run, ``on_prompt`` after each
    prompt's runs are stored."""
    config = results.config
    for suite in suites:
        prompts = suite.prompts[: config.limit]
        encoded = [encode(p) for p in prompts]
        for temperature in config.temperatures:
            if config.warmup:
                for method in results.methods:
                    on_run(f"{suite.name} t={temperature} warm-up {method.name}")
                    warmup = config.params(temperature, 0, max_new_tokens=WARMUP_TOKENS)
                    runners[method.family].run(method, encoded[0], warmup)
            for index, (prompt, prompt_ids) in enumerate(zip(prompts, encoded)):
                for repeat in range(config.repeats):
                    params = config.params(temperature, index, repeat)
                    plain_tokens = None
                    for method in results.methods:
                        on_run(f"{suite.name} t={temperature} {prompt.id} #{repeat + 1} {method.name}")
                        run, tokens = runners[method.family].run(method, prompt_ids, params)
                        if method.is_baseline:
                            plain_tokens = tokens
                        compared = params.greedy and plain_tokens is not None
                        same = tokens == plain_tokens if compared else None
                        results.runs.append(
                            {
                                "suite": suite.name,
                                "temperature": temperature,
                                "prompt_id": prompt.id,
                                "prompt_tokens": len(prompt_ids),
                                "repeat": repeat,
                                "seed": params.seed,
                                "method": method.name,
                                **run.to_dict(),
                                "same_tokens_as_plain": same,
                                "first_divergence": first_divergence(tokens, plain_tokens) if compared else None,
                            }
                        )
                on_prompt()
