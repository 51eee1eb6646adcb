"""Compiled engines on the default model: the engine-level figures, measured side by side in one run.

SmolLM2-135M-Instruct, float32, greedy, ``--max-new-tokens`` new tokens, medians of ``--repeats`` after a
warm-up; methods alternate inside each repeat so that drifting machine load hits all of them alike.

1. plain decoding on the ONNX engine vs Hugging Face transformers ``generate`` on the same weights;
2. per-step cost against context: decode tokens/s after a ~100-token and a ~1,500-token prompt;
3. verify cost: the target's forward with 5 (and 6) new tokens vs with 1, and a batch of 4 rows verifying 5
   tokens each in one pass vs as 4 single-row passes;
4. speculative decoding with the int4 self-draft vs plain on the same engine, per gamma: tokens/s ratio,
   acceptance, tau, the cost ratio c, the ideal speedup tau / (gamma c + 1) and measured / ideal;
5. memory bandwidth: weight bytes read per token x tokens/s, beside the machine's measured read bandwidth.

    .venv/bin/python scripts/bench_engines.py --out results/bench_engines.json
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import click
from rich.console import Console

from benchlib.timing import step_seconds, step_seconds_by_width
from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.bandwidth import stream_bandwidth
from specdec_trt.bench.environment import environment
from specdec_trt.bench.methods import TRANSFORMERS, Method
from specdec_trt.bench.runners import TransformersRunner
from specdec_trt.build_engines.checkpoint import load_transformers_model
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.manifest import read_manifest
from specdec_trt.build_progress import default_engines_shown
from specdec_trt.runtime.engine import Engine
from specdec_trt.stats import ideal_speedup

PASSAGE = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls circled the market, and the "
    "baker on the corner opened his shutters to the smell of bread. Children ran along the sea wall while "
    "their grandparents argued about the weather, the price of fish and the new ferry timetable. "
)
QUESTIONS = {
    "extract": "List every place and every kind of person the passage mentions, one per line.",
    "chat": "Give three tips for staying focused while studying.",
}


def release_slots(*engines: Engine) -> None:
    """Free the slots the step timings left occupied (they leave their context cached), so that the decoder
    over these engines can admit its next requests into them."""
    for engine in engines:
        for slot in range(engine.num_slots):
            if engine.occupied(slot):
                engine.release(slot)


def weight_bytes_per_token(directory: Path) -> int:
    """Bytes of target weights one decode step reads: every weight except the embedding table (one row)."""
    manifest = read_manifest(directory, verify_files=False)
    config = manifest.target.architecture
    total = manifest.files["target/model.onnx.data"]["bytes"]
    return total - config["vocab_size"] * config["hidden_size"] * 4


@click.command()
@click.option(
    "--engines",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Engine directory (default: the default engines, built on first use).",
)
@click.option("--max-new-tokens", "-n", type=int, default=128)
@click.option("--repeats", type=int, default=3)
@click.option("--gammas", default="2,3,4,5", help="Draft lengths to measure.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench_engines.json"))
def main(engines: Path | None, max_new_tokens: int, repeats: int, gammas: str, out: Path) -> None:
    """Run the engines benchmark and print its tables."""
    directory = engines or default_engines_shown(Console(stderr=True))
    decoder = SpeculativeDecoder.from_engines(directory, "engine")
    cores = os.cpu_count() or 1
    transformers = TransformersRunner(load_transformers_model(default_model_path()), {}, cores, decoder.eos_token_ids)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    gamma_list = [int(g) for g in gammas.split(",")]
    results: dict = {"environment": environment("cpu", cores), "max_new_tokens": max_new_tokens, "repeats": repeats}

    # 1 + 4: plain vs transformers vs speculative, per prompt, alternating.
    rows = []
    for name, question in QUESTIONS.items():
        prompt = decoder.apply_chat_template(PASSAGE + "\n\n" + question)
        ids = decoder.tokenize(prompt)
        decoder.generate(prompt, SamplingParams(max_new_tokens=8), num_draft_tokens=max(gamma_list))  # warm-up
        runs: dict[str, list] = {}
        for _ in range(repeats):
            for gamma in [0, *gamma_list]:
                runs.setdefault(f"k={gamma}", []).append(decoder.generate(prompt, greedy, num_draft_tokens=gamma))
            runs.setdefault("hf", []).append(transformers.run(Method(TRANSFORMERS, None), ids, greedy))
        plain = runs["k=0"]
        assert all(r.token_ids == plain[0].token_ids for key, rs in runs.items() if key != "hf" for r in rs)
        plain_tps = statistics.median(r.stats.tokens_per_s for r in plain)
        hf_tps = statistics.median(max_new_tokens / run.total_s for run, _ in runs["hf"])
        row = {"prompt": name, "prompt_tokens": len(ids), "plain_tokens_per_s": plain_tps, "hf_tokens_per_s": hf_tps}
        row["plain_vs_hf"] = plain_tps / hf_tps
        row["same_tokens_as_transformers"] = runs["hf"][0][1] == plain[0].token_ids
        # c: one draft step over one target step, on the engines, at the middle of this generation's context.
        middle = len(ids) + max_new_tokens // 2
        cost_ratio = step_seconds(decoder.drafter.engine, middle, 1) / step_seconds(decoder.target, middle, 1)
        release_slots(decoder.drafter.engine, decoder.target)
        row["cost_ratio"] = cost_ratio
        row["speculative"] = {}
        for gamma in gamma_list:
            spec = runs[f"k={gamma}"]
            stats = [r.stats for r in spec]
            tps = statistics.median(s.tokens_per_s for s in stats)
            tau = statistics.median(s.mean_accepted_tokens for s in stats)
            ideal = ideal_speedup(tau, gamma, cost_ratio)
            row["speculative"][gamma] = {
                "tokens_per_s": tps,
                "speedup": tps / plain_tps,
                "acceptance_rate": statistics.median(s.acceptance_rate for s in stats),
                "tau": tau,
                "ideal_speedup": ideal,
                "efficiency": tps / plain_tps / ideal,
                "per_position_acceptance": stats[0].per_position_acceptance,
            }
        rows.append(row)
    results["generation"] = rows

    # 2 + 3: engine-level step costs.
    target = decoder.target
    # Widths are timed in turn within each repeat, so that a burst of load hits every width alike.
    results["steps_ms"] = {
        f"context={context},new={new}": 1e3 * seconds
        for context in (100, 1500)
        for new, seconds in step_seconds_by_width(target, context, (1, 5, 6)).items()
    }
    # A batch of 4 rows verifying 5 tokens each: one pass, against the 4 single-row passes it used to take
    # (the single-row T=5 step above at context 100).
    one_row, four_rows = results["steps_ms"]["context=100,new=5"] / 1e3, step_seconds(target, 100, 5, rows=4)
    results["batched_verify"] = {
        "rows": 4,
        "new_tokens": 5,
        "one_pass_ms": 1e3 * four_rows,
        "row_by_row_ms": 4e3 * one_row,
        "speedup": 4 * one_row / four_rows,
    }
    results["draft_steps_ms"] = {
        f"context={context},new=1": 1e3 * step_seconds(decoder.drafter.engine, context, 1) for context in (100, 1500)
    }
    release_slots(decoder.drafter.engine, target)
    long_prompt = decoder.apply_chat_template(PASSAGE * 24 + "\n\nSummarise the passage.")
    short_prompt = decoder.apply_chat_template(PASSAGE + "\n\nSummarise the passage.")
    decode_rates = {}
    for label, prompt in (("short", short_prompt), ("long", long_prompt)):
        outs = [decoder.generate(prompt, greedy, num_draft_tokens=0) for _ in range(repeats)]
        decode_rates[label] = {
            "prompt_tokens": outs[0].stats.prompt_tokens,
            "decode_tokens_per_s": statistics.median(
                (o.stats.generated_tokens - 1) / (o.stats.total_s - o.stats.time_to_first_token_s) for o in outs
            ),
        }
    decode_rates["long_vs_short"] = (
        decode_rates["long"]["decode_tokens_per_s"] / decode_rates["short"]["decode_tokens_per_s"]
    )
    results["context"] = decode_rates

    # 5: bandwidth.
    bytes_per_token = weight_bytes_per_token(directory)
    bandwidth = stream_bandwidth(cores)["read"].best
    achieved = bytes_per_token * decode_rates["short"]["decode_tokens_per_s"] / 1e9
    results["bandwidth"] = {
        "machine_read_GBps": bandwidth,
        "weight_bytes_per_token": bytes_per_token,
        "achieved_GBps": achieved,
        "fraction": achieved / bandwidth,
    }

    _print_tables(results, gamma_list)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


def _print_tables(results: dict, gammas: list[int]) -> None:
    print("\n| prompt | prompt tokens | ONNX plain tok/s | transformers tok/s | ONNX / transformers | same tokens |")
    print("|---|---|---|---|---|---|")
    for row in results["generation"]:
        print(
            f"| {row['prompt']} | {row['prompt_tokens']} | {row['plain_tokens_per_s']:.1f} "
            f"| {row['hf_tokens_per_s']:.1f} | {row['plain_vs_hf']:.2f}x "
            f"| {row['same_tokens_as_transformers']} |"
        )
    print("\n| prompt | k | tok/s | speedup | acceptance | tau | c | ideal | measured/ideal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results["generation"]:
        for gamma in gammas:
            s = row["speculative"][gamma]
            print(
                f"| {row['prompt']} | {gamma} | {s['tokens_per_s']:.1f} | {s['speedup']:.2f}x "
                f"| {s['acceptance_rate']:.2f} | {s['tau']:.2f} | {row['cost_ratio']:.2f} "
                f"| {s['ideal_speedup']:.2f}x | {s['efficiency']:.2f} |"
            )
    steps = results["steps_ms"]
    print("\n| context | target T=1 ms | T=5 ms | T=6 ms | T=5 / T=1 | draft T=1 ms |")
    print("|---|---|---|---|---|---|")
    for context in (100, 1500):
        one, five, six = (steps[f"context={context},new={n}"] for n in (1, 5, 6))
        draft = results["draft_steps_ms"][f"context={context},new=1"]
        print(f"| {context} | {one:.1f} | {five:.1f} | {six:.1f} | {five / one:.2f} | {draft:.1f} |")
    batched = results["batched_verify"]
    print(
        f"\n{batched['rows']} rows x {batched['new_tokens']} new tokens after 100: {batched['one_pass_ms']:.1f} ms "
        f"in one pass, {batched['row_by_row_ms']:.1f} ms as single-row passes ({batched['speedup']:.2f}x)"
    )
    ctx = results["context"]
    short, long = ctx["short"], ctx["long"]
    print(
        f"\ndecode tok/s after {short['prompt_tokens']} prompt tokens: {short['decode_tokens_per_s']:.1f}; "
        f"after {long['prompt_tokens']}: {long['decode_tokens_per_s']:.1f} "
        f"(ratio {ctx['long_vs_short']:.2f})"
    )
    bw = results["bandwidth"]
    print(
        f"bandwidth: {bw['weight_bytes_per_token'] / 1e6:.0f} MB of weights per token -> "
        f"{bw['achieved_GBps']:.1f} GB/s of the machine's {bw['machine_read_GBps']:.1f} GB/s "
        f"({100 * bw['fraction']:.0f}%)"
    )


if __name__ == "__main__":
    main()
