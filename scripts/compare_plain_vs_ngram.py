"""Plain vs speculative (prompt lookup) decoding on the default model, side by side in one process.

Both methods run on the same engine, greedy, after a warm-up; each figure is the median over repeats.
Prints a markdown table and writes the raw figures as JSON.

    .venv/bin/python scripts/compare_plain_vs_ngram.py --out results/plain_vs_ngram.json
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import click
import torch

from specdec_trt import SamplingParams, SpeculativeDecoder

PROMPTS = {
    "extract": (
        "Read the passage and list every city it mentions with the sentence it appears in.\n\n"
        "The conference opened in Lisbon on a rainy Monday. Delegates from Oslo and Nairobi arrived late, "
        "because their connecting flight through Frankfurt was delayed. On Wednesday the group travelled to "
        "Porto for a workshop, and on Friday most of them flew home via Madrid."
    ),
    "code": (
        "Rewrite this Python function so that it uses a list comprehension, and keep the docstring:\n\n"
        "def squares_of_even(numbers):\n"
        '    """Return the squares of the even numbers in the list."""\n'
        "    result = []\n"
        "    for number in numbers:\n"
        "        if number % 2 == 0:\n"
        "            result.append(number * number)\n"
        "    return result\n"
    ),
    "chat": "Give three tips for staying focused while studying.",
}


@click.command()
@click.option("--num-draft-tokens", "-k", type=int, default=5)
@click.option("--max-new-tokens", "-n", type=int, default=128)
@click.option("--repeats", type=int, default=3)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/plain_vs_ngram.json"))
def main(num_draft_tokens: int, max_new_tokens: int, repeats: int, out: Path) -> None:
    """Measure tokens/s and acceptance of plain and prompt-lookup decoding per prompt."""
    decoder = SpeculativeDecoder.from_pretrained(None, "ngram", max_context=2048)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    rows = []
    for name, message in PROMPTS.items():
        prompt = decoder.apply_chat_template(message)
        decoder.generate(prompt, SamplingParams(max_new_tokens=8), num_draft_tokens=num_draft_tokens)  # warm-up
        runs: dict[int, list] = {0: [], num_draft_tokens: []}
        for _ in range(repeats):
            for gamma in runs:  # alternate the methods so drifting machine load hits both alike
                runs[gamma].append(decoder.generate(prompt, params, num_draft_tokens=gamma))
        plain, spec = runs[0], runs[num_draft_tokens]
        assert all(r.token_ids == plain[0].token_ids for r in plain + spec), "greedy outputs differ"
        row = {
            "prompt": name,
            "generated_tokens": len(plain[0].token_ids),
            "plain_tokens_per_s": statistics.median(r.stats.tokens_per_s for r in plain),
            "ngram_tokens_per_s": statistics.median(r.stats.tokens_per_s for r in spec),
            "acceptance_rate": statistics.median(r.stats.acceptance_rate for r in spec),
            "tokens_per_round": statistics.median(r.stats.mean_accepted_tokens for r in spec),
            "plain_step_ms": statistics.median(r.stats.verify_ms_per_round for r in plain),
            "verify_ms": statistics.median(r.stats.verify_ms_per_round for r in spec),
        }
        row["speedup"] = row["ngram_tokens_per_s"] / row["plain_tokens_per_s"]
        rows.append(row)
    print(
        f"| prompt | tokens | plain tok/s | ngram k={num_draft_tokens} tok/s | speedup | acceptance | tau | "
        "plain step ms | verify ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prompt']} | {r['generated_tokens']} | {r['plain_tokens_per_s']:.1f} "
            f"| {r['ngram_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance_rate']:.2f} "
            f"| {r['tokens_per_round']:.2f} "
            f"| {r['plain_step_ms']:.1f} | {r['verify_ms']:.1f} |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    environment = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    out.write_text(
        json.dumps(
            {
                "environment": environment,
                "num_draft_tokens": num_draft_tokens,
                "max_new_tokens": max_new_tokens,
                "repeats": repeats,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
