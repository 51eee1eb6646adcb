"""Agent workloads for serving benchmarks: the calls an AI agent makes, and two-turn chats.

An agent calls the model again and again with one long system prompt (its tools as JSON schemas and its rules)
and a history that only grows: each call's answer goes back in, followed by a tool's result, and the next call
sends it all again. Several agents run at once, each with its own task, the same tools and rules. A two-turn
chat asks a question, then asks about a sentence of the answer, quoting it. Everything is made here from a
seed (no downloads), so every server gets the same tasks and tool results; the answers are each server's own.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

AGENTS = "agents"  # specdec-bench's name for the agent loops, as --suite takes it and as their runs' suite
Message = dict[str, str]
Ask = Callable[[list[Message]], str]
"""Sends a conversation to the model and returns its answer."""

TOOLS = {
    "search_docs": ("Search the internal documentation.", {"query": "string", "limit": "integer"}),
    "read_file": ("Read a file from the repository.", {"path": "string", "start_line": "integer"}),
    "list_directory": ("List the files in a directory of the repository.", {"path": "string"}),
    "run_tests": ("Run the test suite, or the tests matching a pattern.", {"pattern": "string"}),
    "query_metrics": ("Query a Prometheus metric over a time range.", {"promql": "string", "minutes": "integer"}),
    "get_ticket": ("Fetch a support ticket with its comments.", {"ticket_id": "string"}),
    "update_ticket": ("Change a ticket's status or add a comment.", {"ticket_id": "string", "comment": "string"}),
    "send_email": ("Send an email to a colleague.", {"to": "string", "subject": "string", "body": "string"}),
    "sql_query": ("Run a read-only SQL query on the analytics database.", {"sql": "string"}),
    "calendar_free_slots": ("Find free meeting slots for people.", {"people": "array", "duration_minutes": "integer"}),
}
RULES = [
    "Think about which tool answers the question before calling one.",
    'Call one tool at a time, as JSON: {"tool": NAME, "arguments": {...}}.',
    "After a tool's result, either call another tool or give the final answer.",
    "Never invent a ticket, file or metric that a tool did not return.",
    "Quote numbers exactly as the tools gave them.",
    "Keep the final answer under 100 words, with the evidence you used.",
]
# Tasks and questions are templates filled from a seed, so that no two conversations of a run, or of two runs,
# start alike past the system prompt (a repeated conversation would find its answers cached or stored).
TASKS = [
    "Ticket OPS-{n} says the {service} service is slow since {day}. Find out why and update the ticket.",
    "How many orders failed payment on {day}, and which payment provider failed most? Email the numbers to {person}.",
    "The nightly test run of the {service} service is red. Find the failing tests and the commit that broke them.",
    "Find a {minutes}-minute slot on {day} for {person} and the {service} team to review ticket OPS-{n}.",
    "Our docs say {service} uploads are limited to {n} KB but users hit errors sooner. Find where the limit is set.",
    "Summarise the error rate of the {service} API since {day} and say if it breaks the 1% objective.",
]
QUESTIONS = [
    "What is the difference between {a} and {b}? Answer in three short paragraphs.",
    "Explain how {a} works and how it compares with {b}, with an example.",
    "Why would a team choose {a} over {b}? Give three reasons.",
    "What mistakes do people make with {a}, and when is {b} the safer choice? Keep it brief.",
]
FILLERS = {
    "service": ["checkout", "search", "billing", "inventory", "login", "shipping", "reviews", "recommendations"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "the weekend", "yesterday", "last night"],
    "person": ["Dana", "Ana", "Ben", "Chloe", "Omar", "Priya", "Kenji", "Lucia"],
    "minutes": ["15", "30", "45", "60"],
    "a": [
        "a hash table",
        "a process",
        "public-key cryptography",
        "a CDN",
        "unit testing",
        "garbage collection",
        "a message queue",
        "database indexing",
        "TCP",
        "caching",
        "recursion",
        "containers",
    ],
    "b": [
        "a binary tree",
        "a thread",
        "a shared password",
        "a single server",
        "manual testing",
        "reference counting",
        "direct HTTP calls",
        "full table scans",
        "UDP",
        "recomputing",
        "loops",
        "virtual machines",
    ],
}


def _fill(template: str, rng: random.Random) -> str:
    return template.format(n=rng.randint(1000, 9999), **{k: rng.choice(v) for k, v in FILLERS.items()})


def system_prompt() -> str:
    """The agents' system prompt: who they are, their tools as JSON schemas, and their rules."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        arg: {"type": kind, "description": f"The {arg.replace('_', ' ')}."}
                        for arg, kind in args.items()
                    },
                    "required": list(args),
                },
            },
        }
        for name, (description, args) in TOOLS.items()
    ]
    rules = "\n".join(f"{i}. {rule}" for i, rule in enumerate(RULES, 1))
    return (
        "You are Ops, an operations assistant for an online shop's engineering team. You solve tasks by calling "
        "tools and reading their results.\n\n# Tools\n\n" + json.dumps(tools, indent=1) + "\n\n# Rules\n\n" + rules
    )


def tool_result(rng: random.Random, call: int) -> str:
    """A tool's JSON result, as an agent's harness would send it back."""
    tool = rng.choice(list(TOOLS))
    rows = [
        {
            "id": f"{tool[:3].upper()}-{rng.randint(1000, 9999)}",
            "title": rng.choice(
                ["latency p99", "failed payments", "test_checkout_total", "upload limit", "error rate"]
            ),
            "value": round(rng.uniform(0, 500), 2),
            "updated": f"2026-12-0{rng.randint(1, 6)}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}Z",
        }
        for _ in range(4)
    ]
    return f"Result of {tool} (call {call + 1}):\n" + json.dumps({"status": "ok", "rows": rows})


@dataclass(frozen=True)
class AgentLoop:
    """One agent: its task and the seed of its tools' results."""

    task: str
    seed: int

    def first_messages(self) -> list[Message]:
        """The conversation of the first call: the system prompt and the task."""
        return [{"role": "system", "content": system_prompt()}, {"role": "user", "content": self.task}]

    def run(self, calls: int, ask: Ask) -> None:
        """``calls`` calls, each sending the whole conversation so far; the answer and a tool's result go back
        into it."""
        rng = random.Random(self.seed)
        messages = self.first_messages()
        for call in range(calls):
            answer = ask(messages)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": tool_result(rng, call)}]


def agent_loops(count: int, seed: int) -> list[AgentLoop]:
    """``count`` agents with different tasks (the templates in turn, filled from ``seed``, each on a ticket of its
    own) and tool results."""
    rng = random.Random(seed)
    tasks = [f"Ticket OPS-{seed * count + i}: " + _fill(TASKS[(seed + i) % len(TASKS)], rng) for i in range(count)]
    return [AgentLoop(task, seed * 1000 + i) for i, task in enumerate(tasks)]


@dataclass(frozen=True)
class TwoTurnChat:
    """A question, then a follow-up that quotes the first answer."""

    question: str

    def run(self, ask: Ask) -> None:
        messages = [{"role": "user", "content": self.question}]
        answer = ask(messages)
        quoted = (answer.split(". ")[0] or answer).strip()[:300]
        follow_up = f'You wrote: "{quoted}". Explain that sentence in more detail, with an example.'
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
        ask(messages)


def two_turn_chats(count: int, seed: int) -> list[TwoTurnChat]:
    """``count`` chats, each asking one of the (template, topic, other topic) questions, no two alike for any
    ``seed`` and index (the k-th question overall is combination 7k, modulo their number, which 7 divides not)."""
    topics, others = FILLERS["a"], FILLERS["b"]
    combinations = len(QUESTIONS) * len(topics) * len(others)
    chats = []
    for k in range(seed * count, (seed + 1) * count):
        pick = 7 * k % combinations
        template, pick = QUESTIONS[pick % len(QUESTIONS)], pick // len(QUESTIONS)
        chats.append(TwoTurnChat(template.format(a=topics[pick % len(topics)], b=others[pick // len(topics)])))
    return chats
