"""The agent workloads of the serving benchmark (``specdec_trt.bench.agents``): an agent's history grows by each
answer and a tool's result, a chat's second turn quotes its first answer, and no two conversations start alike."""

from __future__ import annotations

from specdec_trt.bench.agents import agent_loops, system_prompt, two_turn_chats


def test_an_agent_sends_its_whole_growing_history_each_call() -> None:
    sent: list[list[dict]] = []

    def ask(messages: list[dict]) -> str:
        sent.append([dict(m) for m in messages])
        return f"answer {len(sent)}"

    agent_loops(1, seed=3)[0].run(4, ask)
    assert len(sent) == 4
    assert all(call[0] == {"role": "system", "content": system_prompt()} for call in sent)
    for before, after in zip(sent, sent[1:]):
        assert after[: len(before)] == before  # a prefix of the next call: what a prefix cache can reuse
        assert after[len(before)] == {"role": "assistant", "content": f"answer {len(before) // 2}"}
        assert after[-1]["role"] == "user" and after[-1]["content"].startswith("Result of ")


def test_a_chats_second_turn_quotes_its_first_answer() -> None:
    sent: list[list[dict]] = []

    def ask(messages: list[dict]) -> str:
        sent.append(list(messages))
        return "Caches keep recent data close. They trade memory for time."

    two_turn_chats(1, seed=0)[0].run(ask)
    assert len(sent) == 2 and sent[1][:2] == [
        sent[0][0],
        {"role": "assistant", "content": "Caches keep recent data close. They trade memory for time."},
    ]
    assert '"Caches keep recent data close"' in sent[1][2]["content"]


def test_no_two_conversations_of_any_runs_start_alike() -> None:
    tasks = [a.task for seed in range(1, 40) for a in agent_loops(3, seed)]
    questions = [c.question for seed in range(1, 40) for c in two_turn_chats(8, seed)]
    assert len(set(tasks)) == len(tasks) and len(set(questions)) == len(questions)
    assert {a.seed for a in agent_loops(3, 1)}.isdisjoint(a.seed for a in agent_loops(3, 2))
