"""specdec-bench: the shipped suites, the summary arithmetic, and whole runs of every method on tiny models.

The runs are real: tiny random checkpoints on the PyTorch engine and on ONNX Runtime engines, with
transformers' generate, assisted generation and prompt lookup as peers. Timings are never asserted, only
the structure of what is written and the figures derived from known inputs.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from benchlib.timing import step_seconds
from specdec_trt.bench import runners as bench_runners
from specdec_trt.bench.cli import bench, peer_lengths
from specdec_trt.bench.harness import SCHEMA
from specdec_trt.bench.methods import HEURISTIC, OURS, TRANSFORMERS, Method
from specdec_trt.bench.report import auto_table
from specdec_trt.bench.suites import SUITES, SuiteError, load_suite
from specdec_trt.bench.summary import summarise
from specdec_trt.build import BuildRequest, build
from specdec_trt.build_engines.checkpoint import load_checkpoint, load_tokenizer
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.decoder import AUTO
from specdec_trt.runtime.torch_engine import TorchEngine

SIZE = {"hidden_size": 64, "head_dim": 16}  # exportable to ONNX (head_dim % 16 == 0)
PROMPTS = [
    {"id": "copy", "prompt": "the cat sat on the mat. the cat sat on", "chat": False},
    {"id": "ask", "prompt": "tell me about the sea", "chat": True},
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RUN_FIELDS = {
    "suite": str,
    "temperature": float,
    "prompt_id": str,
    "prompt_tokens": int,
    "repeat": int,
    "seed": int,
    "method": str,
    "generated_tokens": int,
    "total_s": float,
    "ttft_s": float,
    "rounds": int,
    "accepted_tokens": int,
}


# --- suites -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SUITES)
def test_shipped_suites_have_twenty_distinct_prompts(name: str) -> None:
    suite = load_suite(name)
    assert suite.name == name and len(suite.prompts) >= 20
    assert len({p.id for p in suite.prompts}) == len(suite.prompts)
    assert len({p.prompt for p in suite.prompts}) == len(suite.prompts)


@pytest.mark.slow
def test_shipped_suites_fit_the_default_engines_and_long_context_is_long() -> None:
    """With SmolLM2's tokenizer and chat template: long-context prompts have 1,000+ tokens, and every prompt
    leaves room for 128 new tokens and 8 drafts in the default engines' 2,048 positions."""
    tokenizer = load_tokenizer(default_model_path())
    for name in SUITES:
        for prompt in load_suite(name).prompts:
            text = prompt.prompt
            if prompt.chat:
                messages = [{"role": "user", "content": text}]
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            tokens = len(tokenizer.encode(text))
            assert tokens + 128 + 8 <= 2048, prompt.id
            if name == "long-context":
                assert tokens >= 1000, prompt.id


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no prompts"),
        ("{not json\n", ":1: not valid JSON"),
        ('["a list"]\n', ":1: each line must be a JSON object"),
        ('{"prompt": "p"}\n', ":1: needs a non-empty string 'id'"),
        ('{"id": "a", "prompt": "p"}\n{"id": "b", "prompt": " "}\n', ":2: needs a non-empty string 'prompt'"),
        ('{"id": "a", "prompt": "p", "chat": "yes"}\n', ":1: 'chat' must be true or false"),
        ('{"id": "a", "prompt": "p"}\n{"id": "a", "prompt": "q"}\n', "repeated: a"),
    ],
)
def test_malformed_suite_files_are_refused_with_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "suite.jsonl"
    path.write_text(content)
    with pytest.raises(SuiteError, match=message.replace("[", r"\[")):
        load_suite(path)


def test_unknown_suite_names_the_choices() -> None:
    with pytest.raises(SuiteError, match="neither a suite .*code.*nor a JSONL file"):
        load_suite("poetry")


# --- summary arithmetic, by hand --------------------------------------------------------------------------


def run(method: str, prompt: str, total: float, ttft: float, repeat: int = 0, **draft) -> dict:
    base = {
        "suite": "s",
        "temperature": 0.0,
        "prompt_id": prompt,
        "prompt_tokens": 10,
        "repeat": repeat,
        "method": method,
        "generated_tokens": 11,
        "total_s": total,
        "ttft_s": ttft,
        "rounds": 10,
        "accepted_tokens": 0,
        "same_tokens_as_plain": True,
    }
    return base | draft


SPEC = {
    "rounds": 4,
    "accepted_tokens": 6,
    "drafted_tokens": 8,
    "drafted_per_position": [4, 4],
    "accepted_per_position": [4, 2],
    "draft_s": 0.16,
}


def test_summary_figures_match_hand_computation() -> None:
    """Two prompts, two repeats. Plain: prompt a 11 tokens in 1.1 s (0.1 s to the first), b in 2.1 s.
    Speculative k=2: a in 0.6 s, b in 1.1 s, each run 4 rounds drafting 8 and accepting 6 in 0.16 s of
    drafting. transformers generate: 2.2 s on both."""
    plain, spec, hf = Method(OURS, None), Method(OURS, "d", 2), Method(TRANSFORMERS, None)
    runs = []
    for repeat in range(2):
        runs += [
            run(plain.name, "a", 1.1, 0.1, repeat),
            run(plain.name, "b", 2.1, 0.1, repeat),
            run(spec.name, "a", 0.6, 0.1, repeat, **SPEC),
            run(spec.name, "b", 1.1, 0.1, repeat, **SPEC),
            run(hf.name, "a", 2.2, 0.2, repeat),
            run(hf.name, "b", 2.2, 0.2, repeat),
        ]
    rows = {row["method"]: row for row in summarise(runs, [plain, spec, hf])}
    p, s, h = rows[plain.name], rows[spec.name], rows[hf.name]
    assert p["tokens_per_s"] == pytest.approx((10 + 11 / 2.1) / 2)  # median over the two prompts
    assert p["speedup_vs_plain"] == pytest.approx(1.0)
    assert p["speedup_vs_transformers_generate"] == pytest.approx((10 / 5 + (11 / 2.1) / 5) / 2)
    assert s["prompts"] == 2 and s["runs"] == 4
    assert s["tokens_per_s"] == pytest.approx((11 / 0.6 + 10) / 2)
    assert s["tokens_per_s_by_prompt"] == pytest.approx({"a": 11 / 0.6, "b": 10.0})
    # per prompt: a (11/0.6)/10, b 10/(11/2.1); then the median of the two
    assert s["speedup_vs_plain"] == pytest.approx(((11 / 0.6) / 10 + 10 / (11 / 2.1)) / 2)
    assert s["decode_speedup_vs_plain"] == pytest.approx(2.0)  # a: 20/10 tok/s, b: 10/5
    assert s["speedup_vs_transformers_generate"] == pytest.approx(((11 / 0.6) / 5 + 10 / 5) / 2)
    assert s["acceptance_rate"] == pytest.approx(6 / 8)
    assert s["per_position_acceptance"] == pytest.approx([1.0, 0.5])
    assert s["tau"] == pytest.approx((6 + 4) / 4)
    assert s["drafts_per_round"] == pytest.approx(2.0)
    # plain step: (1.0 + 1.0 + 2.0 + 2.0) s over 40 tokens = 0.15 s; a draft token: 0.64 s / 32 = 0.02 s
    assert s["cost_ratio"] == pytest.approx(0.02 / 0.15)
    assert s["ideal_speedup"] == pytest.approx(2.5 / (2 * 0.02 / 0.15 + 1))
    assert s["efficiency"] == pytest.approx(2.0 / (2.5 / (2 * 0.02 / 0.15 + 1)))
    assert s["ttft_ms"] == pytest.approx(100.0)
    assert h["tau"] == pytest.approx(1.0) and h["acceptance_rate"] is None and h["cost_ratio"] is None
    assert h["ttft_ms"] == pytest.approx(200.0)


def test_summary_reports_a_speculative_output_that_differs_from_plain() -> None:
    plain, spec = Method(OURS, None), Method(OURS, "d", 2)
    runs = [run(plain.name, "a", 1.1, 0.1), run(spec.name, "a", 0.6, 0.1, **SPEC, same_tokens_as_plain=False)]
    rows = {row["method"]: row for row in summarise(runs, [plain, spec])}
    assert rows[spec.name]["same_tokens_as_plain"] is False
    assert rows[plain.name]["same_tokens_as_plain"] is True


def test_auto_is_named_and_matched_with_transformers_heuristic_schedule() -> None:
    assert Method(OURS, "int4", AUTO).name == "int4 auto"
    assert Method(TRANSFORMERS, "small", HEURISTIC).name == "transformers assisted small heuristic"
    assert not Method(OURS, "int4", AUTO).is_fixed and Method(OURS, "int4", 3).is_fixed
    assert peer_lengths((1, AUTO, 4)) == (1, 4, HEURISTIC) and peer_lengths((2, 3)) == (2, 3)
    plain, auto, peer = Method(OURS, None), Method(OURS, "d", AUTO), Method(TRANSFORMERS, "d", HEURISTIC)
    runs = [
        run(plain.name, "a", 1.1, 0.1),
        run(auto.name, "a", 0.6, 0.1, **SPEC),
        run(peer.name, "a", 1.2, 0.1),
    ]
    row = {r["method"]: r for r in summarise(runs, [plain, auto, peer])}[auto.name]
    assert row["num_draft_tokens"] == AUTO and row["drafts_per_round"] == pytest.approx(2.0)
    assert row["speedup_vs_transformers_peer"] == pytest.approx(1.2 / 0.6)  # against the heuristic schedule


def test_auto_table_compares_with_the_best_fixed_gamma() -> None:
    """Per suite, temperature and draft: the fixed gamma with the most tok/s, auto's tok/s and the ratio, and
    the same ratio prompt by prompt (median and range)."""

    def row(draft, k, tokens_per_s, suite="s", family=OURS, drafts_per_round=None, by_prompt=None) -> dict:
        name = Method(family, draft, k).name
        return {"suite": suite, "temperature": 0.0, "method": name, "family": family, "draft": draft} | {
            "num_draft_tokens": k,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_by_prompt": by_prompt or {},
            "drafts_per_round": drafts_per_round,
        }

    summary = [
        row(None, 0, 10.0),
        row("d", 1, 12.0),
        row("d", 4, 15.0, by_prompt={"a": 10.0, "b": 15.0, "c": 20.0}),
        row("d", 8, 14.0),
        row("d", AUTO, 15.3, drafts_per_round=3.4, by_prompt={"a": 9.0, "b": 15.3, "c": 22.0, "only-auto": 5.0}),
        row("n", 2, 20.0),
        row("n", AUTO, 19.0, drafts_per_round=5.0),
        row("d", HEURISTIC, 9.0, family=TRANSFORMERS),
        row("d", 4, 30.0, suite="other"),  # another suite: not a candidate for suite s
    ]
    lines = auto_table(summary).splitlines()
    assert lines[0].startswith("| suite | sampling | draft | best fixed gamma | its tok/s | auto tok/s |")
    # per prompt a 0.9, b 1.02, c 1.1 (the prompt only auto ran is left out): median 1.02, range 0.90-1.10
    assert lines[2] == "| s | greedy | d | k=4 | 15.0 | 15.3 | 1.020 | 1.020 (0.90-1.10) | 3.40 | 9.0 |"
    assert lines[3] == "| s | greedy | n | k=2 | 20.0 | 19.0 | 0.950 | - | 5.00 | - |"
    assert len(lines) == 4
    assert auto_table([r for r in summary if r["num_draft_tokens"] != AUTO]) == ""


# --- whole runs -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(make_checkpoint) -> dict[str, Path]:
    target_kwargs = {"family": "llama", **SIZE}
    return {
        "target": make_checkpoint(**target_kwargs),
        "draft": make_checkpoint(draft_of=(target_kwargs, 0.05), seed=100),
    }


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "tiny.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def engines(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with its int4 self-draft; beside it "small", the draft checkpoint built alone."""
    root = tmp_path_factory.mktemp("engines")
    build(BuildRequest(out=root / "int4", target=models["target"], draft="int4", max_draft_len=3, max_context=128))
    build(BuildRequest(out=root / "small", target=models["draft"], draft="none", max_draft_len=3, max_context=128))
    return root / "int4"


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(bench, list(args))
    return result.exit_code, result.output


def check_schema(data: dict, methods: list[str], settings: int, prompts: int, repeats: int, tokens: int = 6) -> None:
    """The JSON holds every method's runs with their raw fields, and one summary row per method and setting."""
    assert data["schema"] == SCHEMA and data["status"] == "complete"
    assert data["command"].startswith("specdec-bench ")
    assert {"cpu", "cores", "threads", "device", "packages", "git_revision"} <= data["environment"].keys()
    assert data["environment"]["packages"]["torch"]
    assert [m["name"] for m in data["methods"]] == methods
    assert len(data["runs"]) == settings * prompts * repeats * len(methods)
    for record in data["runs"]:
        for name, kind in RUN_FIELDS.items():
            assert isinstance(record[name], kind), (name, record)
        assert record["generated_tokens"] == tokens
        assert 0 < record["ttft_s"] < record["total_s"]
    assert len(data["summary"]) == settings * len(methods)
    for row in data["summary"]:
        assert row["tokens_per_s"] > 0 and row["prompts"] == prompts and row["runs"] == prompts * repeats


@pytest.mark.slow
def test_every_method_runs_on_checkpoints(models: dict[str, Path], suite_file: Path, tmp_path: Path) -> None:
    """PyTorch engine: plain, a draft checkpoint and prompt lookup at two gammas, greedy and sampled, with
    transformers generate, assisted generation (the same draft as assistant_model) and prompt lookup."""
    out = tmp_path / "bench.json"
    code, output = invoke(
        *("--target", str(models["target"]), "--draft", str(models["draft"]), "--draft", "ngram"),
        *("--suite", str(suite_file), "-k", "1,2", "-t", "0,0.8", "-n", "6", "--repeats", "2"),
        *("--peer", "transformers", "--out", str(out), "--markdown", str(tmp_path / "docs" / "BENCHMARKS.md")),
    )
    assert code == 0, output
    draft = models["draft"].name
    methods = [
        "plain",
        f"{draft} k=1",
        f"{draft} k=2",
        "ngram k=1",
        "ngram k=2",
        "transformers generate",
        f"transformers assisted {draft} k=1",
        f"transformers assisted {draft} k=2",
        "transformers prompt-lookup k=1",
        "transformers prompt-lookup k=2",
    ]
    data = json.loads(out.read_text())
    check_schema(data, methods, settings=2, prompts=2, repeats=2)
    greedy = [r for r in data["runs"] if r["temperature"] == 0]
    ours = [r for r in greedy if not r["method"].startswith("transformers")]
    assert all(r["same_tokens_as_plain"] for r in ours), "speculative greedy output must equal plain output"
    assert all(r["same_tokens_as_plain"] is None for r in data["runs"] if r["temperature"] > 0)
    seeds: dict[tuple, set[int]] = {}  # per prompt and repeat: the seeds its methods drew with
    for r in data["runs"]:
        seeds.setdefault((r["temperature"], r["prompt_id"], r["repeat"]), set()).add(r["seed"])
    assert all(len(drawn) == 1 for drawn in seeds.values()), "every method must draw with the same seed"
    assert sorted(next(iter(drawn)) for key, drawn in seeds.items() if key[0] > 0) == [0, 1, 2, 3]
    rows = {(r["temperature"], r["method"]): r for r in data["summary"]}
    spec = rows[(0.0, f"{draft} k=2")]
    assert 0 <= spec["acceptance_rate"] <= 1 and len(spec["per_position_acceptance"]) == 2
    assert spec["cost_ratio"] > 0 and spec["ideal_speedup"] > 0 and spec["efficiency"] > 0
    assert spec["speedup_vs_transformers_peer"] > 0
    assert rows[(0.0, "transformers prompt-lookup k=2")]["tau"] >= 1
    for name in ("speedup_vs_gamma", "per_position_acceptance", "measured_vs_ideal"):
        assert (tmp_path / "bench-plots" / f"{name}.png").read_bytes().startswith(PNG_SIGNATURE)
    markdown = tmp_path / "docs" / "BENCHMARKS.md"
    document = markdown.read_text()
    assert data["command"] in document and "## Headline" in document
    assert "](../bench-plots/speedup_vs_gamma.png)" in document
    assert "| plain |" in output  # the tables went to stdout
    rerender = f"specdec-bench --from-json {out} --plots-dir {tmp_path / 'bench-plots'} --markdown {markdown}"
    assert rerender in document  # the page says how to write it again
    markdown.unlink()
    code, rendered = invoke(*shlex.split(rerender)[1:])
    assert code == 0, rendered
    assert markdown.read_text() == document  # regenerated from the JSON alone, nothing measured


@pytest.mark.slow
def test_auto_and_transformers_heuristic_schedule_run(
    models: dict[str, Path], suite_file: Path, tmp_path: Path
) -> None:
    """-k 1,auto with --peer-num-draft-tokens 1,heuristic: ours at k=1 and auto for a draft checkpoint and
    prompt lookup; transformers' assisted generation at k=1 and with its heuristic schedule (prompt lookup
    has none: k=1 only). The report compares auto with the best fixed gamma. 24 tokens: where drafts do not
    pay, auto probes them only now and then, and a shorter run may hold no drafting round to report."""
    out, document = tmp_path / "bench.json", tmp_path / "BENCHMARKS.md"
    code, output = invoke(
        *("--target", str(models["target"]), "--draft", str(models["draft"]), "--draft", "ngram"),
        *("--suite", str(suite_file), "-k", "1,auto", "--peer-num-draft-tokens", "1,heuristic", "-n", "24"),
        *("--repeats", "1", "--peer", "transformers", "--out", str(out), "--markdown", str(document)),
    )
    assert code == 0, output
    draft = models["draft"].name
    methods = ["plain", f"{draft} k=1", f"{draft} auto", "ngram k=1", "ngram auto", "transformers generate"]
    methods += [f"transformers assisted {draft} k=1", f"transformers assisted {draft} heuristic"]
    methods += ["transformers prompt-lookup k=1"]
    data = json.loads(out.read_text())
    check_schema(data, methods, settings=1, prompts=2, repeats=1, tokens=24)
    assert data["config"]["num_draft_tokens"] == [1, AUTO]
    assert all(r["same_tokens_as_plain"] for r in data["runs"] if not r["method"].startswith("transformers"))
    rows = {r["method"]: r for r in data["summary"]}
    auto = rows[f"{draft} auto"]
    assert auto["num_draft_tokens"] == AUTO and 0 < auto["drafts_per_round"] <= 8
    assert auto["ideal_speedup"] > 0 and auto["speedup_vs_transformers_peer"] > 0  # vs the heuristic schedule
    assert rows["ngram auto"]["speedup_vs_transformers_peer"] is None  # transformers' prompt lookup has none
    assert rows[f"transformers assisted {draft} heuristic"]["tau"] >= 1
    table = f"| tiny | greedy | {draft} | k=1 | {rows[f'{draft} k=1']['tokens_per_s']:.1f} | "
    table += f"{auto['tokens_per_s']:.1f} | {auto['tokens_per_s'] / rows[f'{draft} k=1']['tokens_per_s']:.3f} |"
    assert "### auto vs the best fixed gamma" in output and table in output
    assert "## Auto draft length vs the best fixed gamma" in document.read_text() and table in document.read_text()
    assert (tmp_path / "bench-plots" / "speedup_vs_gamma.png").read_bytes().startswith(PNG_SIGNATURE)
    code, rendered = invoke("--from-json", str(out), "--plots-dir", str(tmp_path / "again"))
    assert code == 0 and table in rendered


@pytest.mark.slow
def test_engines_backend_runs_every_kind_of_draft(engines: Path, suite_file: Path, tmp_path: Path) -> None:
    """ONNX Runtime engines with their int4 self-draft, another engine directory as the draft, and prompt
    lookup; transformers runs the checkpoints they were built from, the draft's as assistant_model."""
    out = tmp_path / "bench.json"
    small = str(engines.parent / "small")
    code, output = invoke(
        *("--engines", str(engines), "--draft", "int4", "--draft", small, "--draft", "ngram"),
        *("--suite", str(suite_file), "-k", "2,3", "-n", "6", "--repeats", "1"),
        *("--peer-num-draft-tokens", "3", "--peer", "transformers", "--out", str(out)),
    )
    assert code == 0, output
    methods = ["plain", "int4 k=2", "int4 k=3", "small k=2", "small k=3", "ngram k=2", "ngram k=3"]
    methods += ["transformers generate", "transformers assisted small k=3", "transformers prompt-lookup k=3"]
    data = json.loads(out.read_text())
    check_schema(data, methods, settings=1, prompts=2, repeats=1)
    assert all(r["same_tokens_as_plain"] for r in data["runs"] if not r["method"].startswith("transformers"))
    int4 = next(r for r in data["summary"] if r["method"] == "int4 k=3")
    assert 0 < int4["acceptance_rate"] <= 1
    ngram = next(r for r in data["summary"] if r["method"] == "ngram k=3")
    assert ngram["speedup_vs_transformers_peer"] > 0  # matched with transformers' prompt lookup at k=3
    small_draft = next(r for r in data["summary"] if r["method"] == "small k=3")
    assert small_draft["speedup_vs_transformers_peer"] > 0  # matched with assisted generation at k=3
    assert next(r for r in data["summary"] if r["method"] == "int4 k=2")["speedup_vs_transformers_peer"] is None
    # the bandwidth limit: the machine's read rate, every plain method's weight bytes, our step's breakdown
    assert data["weights"] == "float32" and data["notes"] == []
    limits = data["limits"]
    assert limits["machine_read_GBps"] == max(limits["machine_read_GBps_before_after"]) > 0
    assert set(limits["weight_bytes_per_token"]) == {"plain", "transformers generate"}
    assert limits["step"]["step_ms"] > 0 and 0 < limits["step"]["not_matrix_share"] < 1
    plain = next(r for r in data["summary"] if r["method"] == "plain")
    assert plain["used_GBps"] > 0 and plain["of_bound"] == pytest.approx(
        plain["used_GBps"] / limits["machine_read_GBps"]
    )
    assert "## Against llama.cpp and onnxruntime-genai: float32 weights" in output


@pytest.mark.slow
def test_ctrl_c_leaves_valid_json_with_the_finished_prompts(
    models: dict[str, Path], suite_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (KeyboardInterrupt) during the second prompt: exit 130, the file holds the first prompt."""
    original = bench_runners.OursRunner.run
    calls = 0

    def interrupted_run(self, method, prompt_ids, params):
        nonlocal calls
        calls += 1
        if calls == 5:  # 2 warm-up runs, 2 runs of the first prompt, then the second prompt's first run
            raise KeyboardInterrupt
        return original(self, method, prompt_ids, params)

    monkeypatch.setattr(bench_runners.OursRunner, "run", interrupted_run)
    out = tmp_path / "bench.json"
    code, output = invoke(
        *("--target", str(models["target"]), "--draft", "ngram", "--suite", str(suite_file), "-k", "2"),
        *("-n", "6", "--repeats", "1", "--no-peers", "--out", str(out)),
    )
    assert code == 130, output
    data = json.loads(out.read_text())
    assert data["status"] == "interrupted"
    assert [(r["prompt_id"], r["method"]) for r in data["runs"]] == [("copy", "plain"), ("copy", "ngram k=2")]
    assert [row["method"] for row in data["summary"]] == ["plain", "ngram k=2"]
    assert not list(tmp_path.glob("*.tmp"))


def test_agent_loops_run_warm_and_give_plain_outputs(make_checkpoint, tmp_path: Path) -> None:
    """--suite agents: each method's calls find their history cached (the second agent its system prompt) and
    give plain decoding's tokens; no method finds another's conversations (its first call caches nothing)."""
    target = make_checkpoint(family="llama", **SIZE, max_position_embeddings=8192)  # the long system prompt fits
    out, markdown = tmp_path / "agents.json", tmp_path / "BENCHMARKS.md"
    code, output = invoke(
        *("--target", str(target), "--draft", "ngram", "-k", "2,auto", "--suite", "agents", "--agents", "2"),
        *("--agent-calls", "2", "-n", "6", "--repeats", "2", "--no-peers", "--max-context", "8192"),
        *("--out", str(out), "--markdown", str(markdown)),
    )
    assert code == 0, output
    data = json.loads(out.read_text())
    methods = ["plain", "ngram k=2", "ngram auto"]
    assert len(data["runs"]) == len(methods) * 2 * 2 * 2
    assert all(r["same_tokens_as_plain"] for r in data["runs"]), "every method must give plain decoding's tokens"
    for r in data["runs"]:
        first_of_repeat = r["agent"] == 0 and r["call"] == 0
        assert (r["cached_prompt_tokens"] == 0) == first_of_repeat, r
    rows = {row["method"]: row for row in data["agents"]}
    assert list(rows) == methods
    for row in rows.values():
        assert row["calls"] == 8 and 0.5 < row["cached_share"] < 1 and row["whole_s"] > 0
        assert row["later_calls_ttft_p50_ms"] > 0 and row["same_tokens_as_plain"] is True
    assert rows["plain"]["whole_vs_plain"] == 1 and rows["plain"]["store_acceptance"] is None
    assert "### agents: whole loops" in output and "## Agent loops" in markdown.read_text()


@pytest.mark.parametrize(("limit", "prompts"), [("1", ["copy"]), ("0", ["copy", "ask"])])
def test_limit_takes_the_first_prompts_and_zero_takes_all(
    models: dict[str, Path], suite_file: Path, tmp_path: Path, limit: str, prompts: list[str]
) -> None:
    out = tmp_path / "bench.json"
    code, output = invoke(
        *("--target", str(models["target"]), "--suite", str(suite_file), "--limit", limit, "-k", "1"),
        *("-n", "3", "--repeats", "1", "--no-peers", "--no-warmup", "--out", str(out)),
    )
    assert code == 0, output
    assert list(dict.fromkeys(r["prompt_id"] for r in json.loads(out.read_text())["runs"])) == prompts


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("-k", "4"), "exceeds the 3 drafts the engine was built for"),
        (("-k", "2", "-n", "100"), "prompt copy of suite tiny: the prompt's"),
        (("--draft", "int4", "--draft", "int4"), "two drafts are named 'int4'"),
        (("--device", "cpu"), "--device does not apply to ONNX Runtime engines"),
        (("--enforce-eager",), "--enforce-eager does not apply to ONNX Runtime engines"),
        (("--compile",), "--compile does not apply to ONNX Runtime engines"),
        (("--no-peers", "--peer-num-draft-tokens", "2"), "need the peers (--peers)"),
        (("--no-peers", "--peer", "llama.cpp"), "need the peers (--peers)"),
        (
            ("-k", "2", "-n", "6", "--peer", "llama.cpp"),
            "--peer llama.cpp: ",
        ),  # not installed, or no GGUF of these weights
        (("--peer", "tensorrt"), "Invalid value for '--peer'"),
    ],
)
def test_bad_settings_are_refused_before_timing(
    engines: Path, suite_file: Path, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "bench.json"
    code, output = invoke("--engines", str(engines), "--suite", str(suite_file), "--out", str(out), *args)
    assert code != 0 and message in output and "Traceback" not in output
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("-k", "2,x"),
        ("-k", "0"),
        ("-k", "2,automatic"),
        ("-k", "heuristic"),
        ("--peer-num-draft-tokens", "auto"),
        ("-t", "-1"),
        ("-t", ""),
    ],
)
def test_bad_number_lists_are_usage_errors(option: str, value: str) -> None:
    code, output = invoke(option, value)
    assert code == 2 and "Invalid value" in output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_method_runs_on_cuda(models: dict[str, Path], suite_file: Path, tmp_path: Path) -> None:
    """--device cuda: our PyTorch engine and transformers' peers on the GPU, speculative greedy == plain."""
    out = tmp_path / "bench.json"
    code, output = invoke(
        *("--target", str(models["target"]), "--draft", str(models["draft"]), "--draft", "ngram"),
        *("--device", "cuda", "--suite", str(suite_file), "-k", "2,auto", "-n", "6", "--repeats", "1"),
        *("--out", str(out)),
    )
    assert code == 0, output
    data = json.loads(out.read_text())
    draft = models["draft"].name
    methods = ["plain", f"{draft} k=2", f"{draft} auto", "ngram k=2", "ngram auto", "transformers generate"]
    methods += [f"transformers assisted {draft} k=2", f"transformers assisted {draft} heuristic"]
    methods += ["transformers prompt-lookup k=2"]
    check_schema(data, methods, settings=1, prompts=2, repeats=1)
    assert data["environment"]["device"] != "cpu"
    assert all(r["same_tokens_as_plain"] for r in data["runs"] if not r["method"].startswith("transformers"))


@pytest.mark.parametrize("rows", [1, 3])
def test_step_seconds_times_passes_and_leaves_the_context_cached(make_checkpoint, rows: int) -> None:
    engine = TorchEngine.from_checkpoint(load_checkpoint(make_checkpoint(family="llama")), max_context=64)
    seconds = step_seconds(engine, context=20, new_tokens=3, repeats=3, rows=rows)
    assert 0 < seconds < 5
    assert engine.lengths.tolist() == [20] * rows  # every timed pass was truncated away
