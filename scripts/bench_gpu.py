"""GPU engine figures on random-weight models of SmolLM2-135M's exact shape (no weights travel).

Run from the repository root after ``bash scripts/install.sh`` (``scripts/gpu_check.sh`` runs it with no
install); every figure is a median over ``--repeats`` after warm-up, with the device synchronised around each
timing. Each figure is measured for every mode of our PyTorch engine side by side: "eager" (kernels launched
one by one from Python), on CUDA "graphs" (every step replayed from a CUDA graph, the default on a GPU), and
"compiled" (``torch.compile``'s fused kernels, replayed from CUDA graphs on CUDA, eager on a CPU). The first
generation of each mode, a warm-up, includes its compiling and capturing: its time is reported as well.

1. the engine's per-token decode step (T=1) after 100 and 1,500 cached tokens, the memory bandwidth that
   step achieves (weight bytes / step time), and the verify cost ratio forward(T=5) / forward(T=1);
2. plain decoding tokens/s through ``SpeculativeDecoder`` (num_draft_tokens=0, ignore_eos) against
   transformers' ``model.generate`` (greedy, min_new_tokens = max_new_tokens) on the same weights
   (new tokens / wall time of the whole call, prefill of the 100-token prompt included, for both);
3. the cost ratio c = draft step / target step of a 2-layer draft of the same shape whose output head is
   pruned to 8,192 tokens (and of the same draft unpruned, for comparison);
4. speculative decoding with a copy of the target as its own draft (greedy acceptance is 1, c is about 1):
   measured speedup over plain against the ideal tau / (gamma c + 1); measured / ideal is the loop's
   efficiency, and what is missing is overhead we own;
5. (CUDA only) host synchronisations per round of the decoding loop, counted with CUDA's sync debug mode.

    .venv/bin/python scripts/bench_gpu.py --out /tmp/bench_gpu.json              # on a GPU: ~1-3 min
    .venv/bin/python scripts/bench_gpu.py --device cpu --quick --out /tmp/q.json  # smoke test on a CPU

The JSON is rewritten after every section ("status": "partial" until the end), so an interrupted run
still leaves what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import transformers  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402

from specdec_trt import SamplingParams, SpeculativeDecoder  # noqa: E402
from specdec_trt.build_engines.checkpoint import load_checkpoint  # noqa: E402
from specdec_trt.build_engines.model import DRAFT_VOCAB_KEY  # noqa: E402
from specdec_trt.runtime.torch_engine import TorchEngine  # noqa: E402
from specdec_trt.runtime.transfer import count_host_syncs  # noqa: E402
from specdec_trt.stats import ideal_speedup  # noqa: E402

# HuggingFaceTB/SmolLM2-135M(-Instruct), config.json
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
DRAFT_LAYERS = 2
DRAFT_VOCAB = 8192
QUICK_TARGET_LAYERS = 4
PROMPT_TOKENS = 100
CONTEXTS = (100, 1500)
MAX_CONTEXT = 2048
EAGER, GRAPHS, COMPILED = "eager", "graphs", "compiled"
console = Console(width=None if sys.stdout.isatty() else 140)  # logs: no wrapping at 80 columns


# --- models --------------------------------------------------------------------------------------------------


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """An offline tokenizer covering every id: ``<unk> <s> </s> t3 t4 ...`` (prompts are token ids anyway;
    this makes detokenization during generation as real as with the real model)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def rope_theta(config: LlamaConfig) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 0.0)))


def save_random_model(directory: Path, tokenizer, seed: int, draft_vocab: list[int] | None = None, **shape) -> Path:
    """A random-weight Llama of SmolLM2-135M's shape (``shape`` overrides), saved as a HF checkpoint."""
    config = LlamaConfig(**(SMOLLM2_135M | shape))
    if rope_theta(config) != SMOLLM2_135M["rope_theta"]:
        raise RuntimeError(f"this transformers did not take rope_theta: {config}")
    if draft_vocab is not None:
        setattr(config, DRAFT_VOCAB_KEY, draft_vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --- timing --------------------------------------------------------------------------------------------------


class Timer:
    """Wall-clock seconds of a call with the device synchronised before and after."""

    def __init__(self, device: torch.device) -> None:
        self.sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def __call__(self, function: Callable[[], object]) -> tuple[float, object]:
        self.sync()
        start = time.perf_counter()
        result = function()
        self.sync()
        return time.perf_counter() - start, result


def step_ms(engine, timer: Timer, context: int, new_tokens: int, repeats: int, warmup: int) -> float:
    """Median ms of one forward of ``new_tokens`` tokens after ``context`` cached tokens (rolled back after
    each, so every sample sees the same context). The slot is released after, so a decoder over the engine
    can admit requests into it again."""
    generator = torch.Generator().manual_seed(context + new_tokens)
    prompt = torch.randint(3, engine.vocab_size, (1, context), generator=generator)
    tokens = torch.randint(3, engine.vocab_size, (1, new_tokens), generator=generator)
    engine.prefill(prompt, torch.tensor([context]))
    samples = []
    for i in range(warmup + repeats):
        seconds, _ = timer(lambda: engine.forward(tokens))
        engine.truncate_all(context)
        if i >= warmup:
            samples.append(seconds)
    engine.release(0)
    return 1e3 * statistics.median(samples)


def host_syncs_of(decoder: SpeculativeDecoder, prompt: list[int], params: SamplingParams, gamma: int) -> dict:
    """Synchronising CUDA calls during one generation (``count_host_syncs``), and their ratio to its rounds
    (the request's own syncs included)."""
    syncs, out = count_host_syncs(lambda: decoder.generate(prompt, params, num_draft_tokens=gamma))
    rounds = out.stats.rounds
    return {"syncs": syncs, "rounds": rounds, "syncs_per_round": syncs / rounds if rounds else None}


# --- the benchmark -------------------------------------------------------------------------------------------


def environment(device: torch.device, threads: int) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": transformers.__version__,
        "device": str(device),
        "gpu": gpu,
        "cpu_threads": threads,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


@click.command()
@click.option("--device", default="cuda", show_default=True, help="torch device: cuda, cuda:1, cpu.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="JSON file to write.")
@click.option("--quick", is_flag=True, help=f"A {QUICK_TARGET_LAYERS}-layer target, 32 new tokens, fewer repeats.")
@click.option("--max-new-tokens", "-n", type=int, default=None, help="[default: 128, or 32 with --quick]")
@click.option("--gamma", "-k", type=int, default=4, show_default=True, help="Drafts per round (self-draft).")
@click.option("--repeats", type=int, default=None, help="Timed generations per method [default: 3, 2 with --quick].")
@click.option("--step-repeats", type=int, default=None, help="Timed forwards per figure [default: 20, 5 with --quick].")
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
def main(
    device: str,
    out: Path,
    quick: bool,
    max_new_tokens: int | None,
    gamma: int,
    repeats: int | None,
    step_repeats: int | None,
    threads: int | None,
) -> None:
    """Measure the PyTorch engine on random SmolLM2-135M-shaped models; print tables, write JSON."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device")
    if threads:
        torch.set_num_threads(threads)
    new_tokens = max_new_tokens or (32 if quick else 128)
    repeats = repeats or (2 if quick else 3)
    step_repeats = step_repeats or (5 if quick else 20)
    target_layers = QUICK_TARGET_LAYERS if quick else SMOLLM2_135M["num_hidden_layers"]
    timer = Timer(dev)
    results: dict = {
        "status": "partial",
        "environment": environment(dev, torch.get_num_threads()),
        "settings": {
            "quick": quick,
            "target_layers": target_layers,
            "draft_layers": DRAFT_LAYERS,
            "draft_vocab": DRAFT_VOCAB,
            "shape": SMOLLM2_135M | {"num_hidden_layers": target_layers},
            "prompt_tokens": PROMPT_TOKENS,
            "max_new_tokens": new_tokens,
            "gamma": gamma,
            "repeats": repeats,
            "step_repeats": step_repeats,
            "warmup": 1,
            "dtype": "float32",
        },
        "seconds": {},
    }
    started = time.perf_counter()

    def save(section: str | None = None) -> None:
        if section:
            results["seconds"][section] = round(time.perf_counter() - started, 1)
            console.print(f"[dim]{section}: done at {results['seconds'][section]} s[/dim]")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))

    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        root = Path(tmp)
        tokenizer = word_tokenizer(SMOLLM2_135M["vocab_size"])
        target_dir = save_random_model(root / "target", tokenizer, seed=0, num_hidden_layers=target_layers)
        draft_vocab = list(range(DRAFT_VOCAB))
        draft_dir = save_random_model(
            root / "draft", tokenizer, seed=1, num_hidden_layers=DRAFT_LAYERS, draft_vocab=draft_vocab
        )
        save("models")
        run = Run(dev, timer, random_prompt(), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        run.repeats, run.step_repeats = repeats, step_repeats
        modes = engine_modes(dev)
        results["modes"] = list(modes)

        plain = {
            mode: SpeculativeDecoder.from_pretrained(target_dir, "none", device=dev, max_context=MAX_CONTEXT, **options)
            for mode, options in modes.items()
        }
        results["weight_bytes"] = weight_bytes(plain[EAGER].target)
        results["first_generation_s"] = {mode: run.first_generation(decoder) for mode, decoder in plain.items()}
        save("first generation")
        results["target_steps"] = {mode: run.target_steps(decoder.target) for mode, decoder in plain.items()}
        save("target steps")
        results["plain"] = run.plain_vs_transformers(plain, target_dir)
        save("plain vs transformers")
        results["draft_cost"] = {
            mode: run.draft_cost(plain[mode].target, draft_dir, options) for mode, options in modes.items()
        }
        save("draft cost")
        for decoder in plain.values():
            decoder.close()
        del plain
        if dev.type == "cuda":
            torch.cuda.empty_cache()

        results["self_draft"], results["host_syncs"] = {}, {}
        for mode, options in modes.items():
            spec = SpeculativeDecoder.from_pretrained(
                target_dir, target_dir, device=dev, max_context=MAX_CONTEXT, **options
            )
            results["self_draft"][mode] = run.self_draft(spec, gamma)
            save(f"self-draft ({mode})")
            if dev.type == "cuda":
                results["host_syncs"][mode] = run.host_syncs(spec, gamma)
                save(f"host syncs ({mode})")
            spec.close()

    results["status"] = "complete"
    save()
    print_tables(results)
    console.print(f"wrote {out} in {time.perf_counter() - started:.0f} s")


def engine_modes(device: torch.device) -> dict[str, dict[str, bool]]:
    """Our engine's modes on ``device``, as ``TorchEngine`` options."""
    if device.type != "cuda":
        return {EAGER: {"compiled": False}, COMPILED: {"compiled": True}}
    return {
        EAGER: {"cuda_graphs": False, "compiled": False},
        GRAPHS: {"cuda_graphs": True, "compiled": False},
        COMPILED: {"cuda_graphs": True, "compiled": True},
    }


def random_prompt() -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, SMOLLM2_135M["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()


def weight_bytes(engine: TorchEngine) -> int:
    """Bytes of the engine's parameters (tied embeddings counted once): what one decode step must read."""
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


class Run:
    """The measurements, sharing one device, timer, prompt and greedy parameters."""

    def __init__(self, device: torch.device, timer: Timer, prompt: list[int], greedy: SamplingParams) -> None:
        self.device, self.timer, self.prompt, self.greedy = device, timer, prompt, greedy
        self.new_tokens = greedy.max_new_tokens
        self.repeats, self.step_repeats = 3, 20

    def step(self, engine, context: int, new_tokens: int = 1) -> float:
        return step_ms(engine, self.timer, context, new_tokens, self.step_repeats, warmup=1)

    def first_generation(self, decoder: SpeculativeDecoder) -> float:
        """Seconds of a decoder's first plain generation (8 tokens), which compiles and captures what it needs."""
        seconds, _ = self.timer(
            lambda: decoder.generate(self.prompt, dataclasses.replace(self.greedy, max_new_tokens=8))
        )
        return seconds

    def target_steps(self, target: TorchEngine) -> dict:
        """1: the target's step cost at each context, T=1 and T=5, and the bandwidth of the T=1 step."""
        steps = {f"context={c},T={t}": self.step(target, c, t) for c in CONTEXTS for t in (1, 5)}
        weights = weight_bytes(target)
        return {
            "steps_ms": steps,
            "decode_ms_per_token": {f"context={c}": steps[f"context={c},T=1"] for c in CONTEXTS},
            "weight_GB_per_s": {f"context={c}": weights / steps[f"context={c},T=1"] / 1e6 for c in CONTEXTS},
            "verify_cost_ratio": {
                f"context={c}": steps[f"context={c},T=5"] / steps[f"context={c},T=1"] for c in CONTEXTS
            },
        }

    def plain_vs_transformers(self, plain: dict[str, SpeculativeDecoder], target_dir: Path) -> dict:
        """2: plain decoding through our decoder (each mode) vs transformers' generate, alternating, same weights."""
        hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(self.device).eval()
        hf_input = torch.tensor([self.prompt], device=self.device)

        def hf_generate() -> list[int]:
            with torch.inference_mode():
                output = hf.generate(
                    hf_input,
                    attention_mask=torch.ones_like(hf_input),
                    do_sample=False,
                    max_new_tokens=self.new_tokens,
                    min_new_tokens=self.new_tokens,
                    pad_token_id=SMOLLM2_135M["pad_token_id"],
                )
            return output[0, len(self.prompt) :].tolist()

        seconds: dict[str, list[float]] = {mode: [] for mode in plain} | {"transformers": []}
        ids: dict[str, list[int]] = {}
        for i in range(1 + self.repeats):  # the first round is the warm-up (it compiles and captures)
            for mode, decoder in plain.items():
                elapsed, output = self.timer(lambda d=decoder: d.generate(self.prompt, self.greedy, num_draft_tokens=0))
                ids[mode] = output.token_ids
                if i:
                    seconds[mode].append(elapsed)
            elapsed, ids["transformers"] = self.timer(hf_generate)
            if i:
                seconds["transformers"].append(elapsed)
        tps = {name: self.new_tokens / statistics.median(s) for name, s in seconds.items()}
        return {
            "tokens_per_s": tps,
            "ms_per_token": {name: 1e3 / t for name, t in tps.items()},
            "vs_transformers": {mode: tps[mode] / tps["transformers"] for mode in plain},
            "same_prefix_tokens_as_transformers": {mode: same_prefix(ids[mode], ids["transformers"]) for mode in plain},
        }

    def draft_cost(self, target: TorchEngine, draft_dir: Path, options: dict[str, bool]) -> dict:
        """3: c of the 2-layer draft with its pruned head, and with the full head, against the target."""
        checkpoint = load_checkpoint(draft_dir)
        full = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, draft_vocab=None))
        pruned = TorchEngine.from_checkpoint(checkpoint, MAX_CONTEXT, self.device, **options)
        unpruned = TorchEngine.from_checkpoint(full, MAX_CONTEXT, self.device, **options)
        rows = {}
        for context in CONTEXTS:
            target_ms, pruned_ms, unpruned_ms = (self.step(e, context) for e in (target, pruned, unpruned))
            rows[f"context={context}"] = {
                "target_ms": target_ms,
                "pruned_draft_ms": pruned_ms,
                "unpruned_draft_ms": unpruned_ms,
                "c_pruned": pruned_ms / target_ms,
                "c_unpruned": unpruned_ms / target_ms,
            }
        pruned.close()
        unpruned.close()
        return rows

    def self_draft(self, spec: SpeculativeDecoder, gamma: int) -> dict:
        """4: a copy of the target as the draft, against plain decoding on the same decoder, alternating."""
        plain_s, spec_s, stats = [], [], []
        for i in range(1 + self.repeats):
            seconds, plain = self.timer(lambda: spec.generate(self.prompt, self.greedy, num_draft_tokens=0))
            spec_seconds, out = self.timer(lambda: spec.generate(self.prompt, self.greedy, num_draft_tokens=gamma))
            if i:
                plain_s.append(seconds)
                spec_s.append(spec_seconds)
                stats.append(out.stats)
        middle = PROMPT_TOKENS + self.new_tokens // 2
        cost_ratio = self.step(spec.drafter.engine, middle) / self.step(spec.target, middle)
        plain_tps = self.new_tokens / statistics.median(plain_s)
        spec_tps = self.new_tokens / statistics.median(spec_s)
        tau = statistics.median(s.mean_accepted_tokens for s in stats)
        ideal = ideal_speedup(tau, gamma, cost_ratio)
        return {
            "gamma": gamma,
            "plain_tokens_per_s": plain_tps,
            "speculative_tokens_per_s": spec_tps,
            "speedup": spec_tps / plain_tps,
            "acceptance_rate": statistics.median(s.acceptance_rate for s in stats),
            "tau": tau,
            "cost_ratio": cost_ratio,
            "ideal_speedup": ideal,
            "efficiency": spec_tps / plain_tps / ideal,
            "same_tokens_as_plain": out.token_ids == plain.token_ids,
        }

    def host_syncs(self, spec: SpeculativeDecoder, gamma: int) -> dict:
        """5: host synchronisations per round, plain and speculative, greedy and sampled (a diagnostic: errors
        are recorded). A request's own syncs (around its prefill) cancel out: two lengths are counted, and their
        extra rounds divide their extra syncs."""
        lengths = (16, 48)
        try:
            rows = {}
            cases = (
                ("plain", 0, 0.0),
                (f"self-draft k={gamma}", gamma, 0.0),
                (f"self-draft k={gamma} t=0.8", gamma, 0.8),
            )
            for name, k, temperature in cases:
                params = [
                    SamplingParams(max_new_tokens=n, temperature=temperature, seed=0, ignore_eos=True) for n in lengths
                ]
                for p in params:  # capture every shape first: a capture synchronises
                    spec.generate(self.prompt, p, num_draft_tokens=k)
                counts = [host_syncs_of(spec, self.prompt, p, k) for p in params]
                extra_rounds = counts[1]["rounds"] - counts[0]["rounds"]
                rows[name] = {f"max_new_tokens={n}": count for n, count in zip(lengths, counts)} | {
                    "syncs_per_round": (counts[1]["syncs"] - counts[0]["syncs"]) / extra_rounds
                }
            return rows
        except Exception as err:  # noqa: BLE001 - keep the other figures
            return {"error": f"{type(err).__name__}: {err}"}


def same_prefix(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def print_tables(results: dict) -> None:
    env, settings, modes = results["environment"], results["settings"], results["modes"]
    title = f"{env['gpu'] or env['device']} | torch {env['torch']} (CUDA {env['cuda']})"
    title += f" | transformers {env['transformers']}"
    console.print(f"\n[bold]{title}[/bold]")
    console.print(
        f"random SmolLM2-135M shape, {settings['target_layers']} target layers, float32 "
        f"({results['weight_bytes'] / 1e6:.0f} MB of weights), {settings['prompt_tokens']} prompt tokens, "
        f"{settings['max_new_tokens']} new tokens, greedy"
    )

    steps = Table(title="Engine steps (ms, medians)")
    columns = ("mode", "context", "target T=1", "GB/s", "target T=5", "T=5 / T=1", "pruned draft T=1", "c pruned")
    for column in (*columns, "c unpruned"):
        steps.add_column(column, justify="left" if column == "mode" else "right")
    for mode in modes:
        t = results["target_steps"][mode]
        for context in CONTEXTS:
            key = f"context={context}"
            d = results["draft_cost"][mode][key]
            steps.add_row(
                mode,
                str(context),
                f"{t['steps_ms'][f'{key},T=1']:.2f}",
                f"{t['weight_GB_per_s'][key]:.0f}",
                f"{t['steps_ms'][f'{key},T=5']:.2f}",
                f"{t['verify_cost_ratio'][key]:.2f}",
                f"{d['pruned_draft_ms']:.2f}",
                f"{d['c_pruned']:.3f}",
                f"{d['c_unpruned']:.3f}",
            )
    console.print(steps)

    p = results["plain"]
    gen = Table(title="Generation (tokens/s, medians)")
    for column in ("method", "tok/s", "vs plain", "notes"):
        gen.add_column(column, justify="left" if column in ("method", "notes") else "right")
    hf = p["tokens_per_s"]["transformers"]
    gen.add_row("transformers generate", f"{hf:.1f}", "", f"{p['ms_per_token']['transformers']:.2f} ms/token")
    for mode in modes:
        gen.add_row(
            f"ours, plain, {mode}",
            f"{p['tokens_per_s'][mode]:.1f}",
            "1.00x",
            f"{p['ms_per_token'][mode]:.2f} ms/token; {p['vs_transformers'][mode]:.2f}x transformers; first "
            f"{p['same_prefix_tokens_as_transformers'][mode]} tokens as transformers'; first generation "
            f"{results['first_generation_s'][mode]:.1f} s",
        )
        s = results["self_draft"][mode]
        gen.add_row(
            f"ours, self-draft k={s['gamma']}, {mode}",
            f"{s['speculative_tokens_per_s']:.1f}",
            f"{s['speedup']:.2f}x",
            f"acceptance {s['acceptance_rate']:.2f}, tau {s['tau']:.2f}, c {s['cost_ratio']:.2f}, ideal "
            f"{s['ideal_speedup']:.2f}x, efficiency {s['efficiency']:.2f}; same tokens: {s['same_tokens_as_plain']}",
        )
    console.print(gen)
    for mode, syncs in results.get("host_syncs", {}).items():
        parts = [
            f"{name}: {v['syncs_per_round']:.2f} per round" if isinstance(v, dict) else f"{name}: {v}"
            for name, v in syncs.items()
        ]
        console.print(f"host syncs ({mode}): " + "; ".join(parts))


if __name__ == "__main__":
    main()
