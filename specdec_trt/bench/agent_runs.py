"""specdec-bench's agent workload: agent loops (``specdec_trt.bench.agents``) through each of our methods, warm.

An agent sends its whole history again every call, so what an engine keeps between calls decides its speed:
each method runs the workload on a decoder with its prefix cache and its store of earlier requests' text on, as
a server runs, from a reset (``reset_prefix_cache``) and reset again after, so that no method finds another's
conversations. The agents run one after another, each call after the last; methods take turns per repeat in a
rotated order, each repeat with new tasks and tool results, the same for every method. Greedy answers are the
same for every lossless method, so every method sends the same prompts; each call's tokens are compared with
plain decoding's. The peers keep no cache between calls in-process and are left out: the served comparison with
llama.cpp's llama-server is ``scripts/bench_agents.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from specdec_trt.bench.agents import AGENTS, Message, agent_loops
from specdec_trt.bench.harness import WARMUP_TOKENS, BenchConfig, first_divergence
from specdec_trt.bench.methods import OURS, Method
from specdec_trt.bench.runners import Converse, OursRunner
from specdec_trt.bench.summary import PLAIN


@dataclass(frozen=True)
class AgentWorkload:
    """How many agents run one after another, and how many calls each makes."""

    agents: int = 3
    calls: int = 5

    def runs_per_method(self, config: BenchConfig) -> int:
        """Timed calls and warm-ups of one method over the whole workload."""
        return len(config.temperatures) * (config.warmup + config.repeats * self.agents * self.calls)


@dataclass(frozen=True)
class _Caller:
    """Who calls: one agent of one repeat, on one method."""

    temperature: float
    repeat: int
    method: Method
    agent: int


@dataclass
class _Recorder:
    """Runs each call of the workload and records it."""

    config: BenchConfig
    calls_per_agent: int
    runs: list[dict]
    on_run: Callable[[str], None]
    on_call: Callable[[], None]

    def ask(self, caller: _Caller, converse: Converse, made: list[tuple[dict, list[int]]]) -> Callable[[list], str]:
        """The agent's way of calling the model: each call runs, goes into ``runs`` and, with its tokens, into
        ``made``."""
        return partial(self._call, caller, converse, made)

    def _call(
        self, caller: _Caller, converse: Converse, made: list[tuple[dict, list[int]]], messages: list[Message]
    ) -> str:
        call = sum(m["role"] == "assistant" for m in messages)
        label = f"agent{caller.agent + 1} call{call + 1}"
        self.on_run(f"{AGENTS} t={caller.temperature} {label} #{caller.repeat + 1} {caller.method.name}")
        index = caller.agent * self.calls_per_agent + call
        params = self.config.params(caller.temperature, index, caller.repeat)
        reply = converse(messages, params)
        record = (
            {"suite": AGENTS, "temperature": caller.temperature, "prompt_id": label, "repeat": caller.repeat}
            | {"seed": params.seed, "method": caller.method.name, "agent": caller.agent, "call": call}
            | {"prompt_tokens": reply.prompt_tokens}
            | reply.run.to_dict()
            | {"same_tokens_as_plain": None, "first_divergence": None}
        )
        made.append((record, reply.token_ids))
        self.runs.append(record)
        self.on_call()
        return reply.text


def run_agent_workload(
    config: BenchConfig,
    workload: AgentWorkload,
    methods: Sequence[Method],
    runner: OursRunner,
    runs: list[dict],
    on_run: Callable[[str], None] = lambda description: None,
    on_call: Callable[[], None] = lambda: None,
) -> None:
    """Append a run record for every call of every method (ours only) to ``runs``; ``on_run`` is told before
    each call, ``on_call`` after each call is stored."""
    ours = [m for m in methods if m.family == OURS]
    recorder = _Recorder(config, workload.calls, runs, on_run, on_call)
    for temperature in config.temperatures:
        if config.warmup:
            for method in ours:
                on_run(f"{AGENTS} t={temperature} warm-up {method.name}")
                warm_up = config.params(temperature, 0, max_new_tokens=WARMUP_TOKENS)
                with runner.warm(method) as converse:
                    converse([{"role": "user", "content": "Hi."}], warm_up)
        for repeat in range(config.repeats):
            start = repeat % len(ours)
            made: list[tuple[dict, list[int]]] = []  # this repeat's records, with their tokens
            for method in ours[start:] + ours[:start]:
                with runner.warm(method) as converse:
                    for index, agent in enumerate(agent_loops(workload.agents, config.seed + repeat + 1)):
                        caller = _Caller(temperature, repeat, method, index)
                        agent.run(workload.calls, recorder.ask(caller, converse, made))
            _compare_with_plain(made, greedy=temperature == 0)


def _compare_with_plain(made: list[tuple[dict, list[int]]], greedy: bool) -> None:
    """Set each greedy record's ``same_tokens_as_plain`` and ``first_divergence`` against plain decoding's call."""
    plain = {r["prompt_id"]: tokens for r, tokens in made if r["method"] == PLAIN}
    for record, tokens in made:
        reference = plain.get(record["prompt_id"]) if greedy else None
        if reference is not None:
            record["same_tokens_as_plain"] = tokens == reference
            record["first_divergence"] = first_divergence(tokens, reference)
