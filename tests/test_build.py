"""``specdec-build`` and the ``build()`` API behind it: refusals before any work, the engine directory it
writes, ``specdec-run --engines`` on the result, and no partial directory after a failed build.

Most builds run in fresh Python processes (``start_build``), several at once, which also keeps each
failure-injection run isolated; ``test_two_builds_in_one_process`` guards in-process builds. The other
test files import ``build_all`` from here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner, Result
from conftest import CHARS, build_model, char_tokenizer

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build import STAGES, BuildError, BuildRequest, build, check_request
from specdec_trt.build_engines.checkpoint import CheckpointError
from specdec_trt.build_engines.manifest import MANIFEST_NAME, read_manifest
from specdec_trt.build_engines.model import DRAFT_VOCAB_KEY
from specdec_trt.build_engines.onnx_export import ExportError
from specdec_trt.cli import build_command, run
from specdec_trt.loading import VocabularyMismatchError
from specdec_trt.profile_cache import PROFILES_NAME

SIZE = {"hidden_size": 64, "head_dim": 16}  # ONNX Runtime's GroupQueryAttention needs head_dim % 16 == 0
MAX_DRAFT_LEN = 4
MAX_CONTEXT = 64
SENTINEL = "keep.txt"

_BUILD_SCRIPT = """
import json, signal, sys, time
from pathlib import Path
from specdec_trt.build import BuildRequest, build

# Ctrl-C as in a terminal: an ignored or blocked SIGINT is inherited from the test run's process otherwise
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
spec = json.loads(sys.argv[1])
fail_at, pause_at = spec.pop("fail_at"), spec.pop("pause_at")

def on_stage(stage):
    print(stage, flush=True)
    if stage == fail_at:
        raise RuntimeError(f"injected failure at {stage}")
    if stage == pause_at:  # short sleeps: a signal that lands on a worker thread is handled within 0.1 s
        for _ in range(1200):
            time.sleep(0.1)

build(BuildRequest(**{**spec, "out": Path(spec["out"])}), on_stage)
"""


@dataclass(frozen=True)
class BuildRun:
    """A finished build process: its exit status, the stages it started and its stderr."""

    returncode: int
    stages: list[str]
    stderr: str


def start_build(request: BuildRequest, fail_at: str | None = None, pause_at: str | None = None) -> subprocess.Popen:
    """Start ``build(request)`` in a fresh Python process; ``fail_at`` injects a failure as that stage starts,
    ``pause_at`` a pause of two minutes (time for a signal to arrive mid-build, however loaded the machine)."""
    spec = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(request).items()}
    command = [sys.executable, "-c", _BUILD_SCRIPT, json.dumps({**spec, "fail_at": fail_at, "pause_at": pause_at})]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_build(process: subprocess.Popen) -> BuildRun:
    stdout, stderr = process.communicate(timeout=300)
    return BuildRun(process.returncode, [line for line in stdout.splitlines() if line in STAGES], stderr)


def build_all(*requests: BuildRequest) -> list[BuildRun]:
    """Build every request, all at once in separate processes; each must succeed."""
    runs = [finish_build(process) for process in [start_build(request) for request in requests]]
    for request, result in zip(requests, runs):
        assert result.returncode == 0, f"building {request.out} failed:\n{result.stderr[-3000:]}"
    return runs


def start_console_build(*args: str) -> subprocess.Popen:
    """The installed ``specdec-build`` console script, in its own process."""
    executable = Path(sys.executable).parent / "specdec-build"
    return subprocess.Popen([str(executable), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def invoke(command, *args: str) -> Result:
    return CliRunner().invoke(command, [str(arg) for arg in args])


def assert_clean_error(result: Result, *fragments: str) -> None:
    """A ClickException: exit status 1, ``Error:`` and the fragments, no traceback."""
    assert result.exit_code == 1, result.output
    assert "Error:" in result.output and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


@dataclass(frozen=True)
class Checkpoints:
    target: Path
    draft: Path
    wider_draft: Path  # 40 token ids instead of 35
    reordered_draft: Path  # 35 token ids, another token-to-id map
    head_dim_12: Path  # qwen3 with its default head_dim of 12


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    target_kwargs = {"family": "llama", **SIZE}
    reordered = tmp_path_factory.mktemp("reordered")
    build_model(seed=5, **target_kwargs).save_pretrained(reordered)
    char_tokenizer(chars=CHARS[::-1]).save_pretrained(reordered)
    return Checkpoints(
        target=make_checkpoint(**target_kwargs),
        draft=make_checkpoint(draft_of=(target_kwargs, 0.05), seed=100),
        wider_draft=make_checkpoint(vocab_size=40, **target_kwargs),
        reordered_draft=reordered,
        head_dim_12=make_checkpoint(family="qwen3", hidden_size=64),
    )


# --- refusals: before any stage starts, nothing written --------------------------------------------------

REFUSALS = {
    "draft vocabulary size": ({"draft": "wider_draft"}, VocabularyMismatchError, "has 40 token ids but the target"),
    "draft tokenizer": ({"draft": "reordered_draft"}, VocabularyMismatchError, "different tokenizers"),
    "context too long": ({"max_context": 512}, BuildError, "exceeds what the target supports (256)"),
    "head_dim": ({"target": "head_dim_12"}, ExportError, "head_dim 12 is not a multiple of 16"),
    "no such target": ({"target": "missing"}, CheckpointError, "does not exist"),
    "out not empty": ({"out": "occupied"}, BuildError, "exists and is not empty"),
}


def refused_request(case: str, checkpoints: Checkpoints, tmp_path: Path) -> BuildRequest:
    """The request of a REFUSALS case: names in its overrides are checkpoints or special paths."""
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / SENTINEL).write_text("mine")
    paths = {**asdict(checkpoints), "missing": tmp_path / "no-such-model", "occupied": occupied}
    overrides = {key: paths.get(value, value) for key, value in REFUSALS[case][0].items()}
    defaults = {"out": tmp_path / "engines", "target": checkpoints.target, "draft": checkpoints.draft}
    return BuildRequest(**{**defaults, "max_draft_len": MAX_DRAFT_LEN, "max_context": MAX_CONTEXT, **overrides})


def assert_nothing_written(request: BuildRequest) -> None:
    assert not request.out.with_name(request.out.name + ".partial").exists()
    if request.out.name == "occupied":
        assert [p.name for p in request.out.iterdir()] == [SENTINEL]
    else:
        assert not request.out.exists()


@pytest.mark.parametrize("case", REFUSALS)
def test_build_api_refuses_before_any_stage(case: str, checkpoints: Checkpoints, tmp_path: Path) -> None:
    request = refused_request(case, checkpoints, tmp_path)
    _, error, message = REFUSALS[case]
    stages: list[str] = []
    with pytest.raises(error, match=re.escape(message)):
        build(request, stages.append)
    assert stages == [], "the refusal came after long work had started"
    assert_nothing_written(request)


@pytest.mark.parametrize("case", REFUSALS)
def test_build_command_refuses_with_a_clear_error(case: str, checkpoints: Checkpoints, tmp_path: Path) -> None:
    request = refused_request(case, checkpoints, tmp_path)
    args = ["--target", request.target, "--draft", request.draft, "--out", request.out]
    args += ["--max-draft-len", request.max_draft_len, "--max-context", request.max_context]
    result = invoke(build_command, *args)
    assert_clean_error(result, REFUSALS[case][2])
    assert_nothing_written(request)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_draft_len": 0}, r"--max-draft-len must be in \[1, 32\], got 0"),
        ({"max_draft_len": 33}, r"--max-draft-len must be in \[1, 32\], got 33"),
        ({"max_context": 9, "max_draft_len": 8}, "--max-context 9 leaves no room"),
        ({"dtype": "bfloat16"}, "dtype 'bfloat16' is not supported"),
        ({"target_quantization": "int8"}, "target quantization 'int8' is not supported: choose none or int4"),
        ({"draft_quantization": "int4"}, "--draft-quantization applies to a draft checkpoint, not to --draft none"),
        ({"draft": "int4", "draft_quantization": "int4"}, r"not to --draft int4 \(already the target quantized"),
        ({"draft": "int4", "target_quantization": "int4"}, "int4 self-draft of an int4 target would be the target"),
    ],
)
def test_build_api_refuses_bad_settings(overrides: dict, message: str, checkpoints: Checkpoints, tmp_path) -> None:
    request = BuildRequest(**{"out": tmp_path / "engines", "target": checkpoints.target, "draft": "none", **overrides})
    with pytest.raises(BuildError, match=message):
        check_request(request)
    with pytest.raises(BuildError, match=message):
        build(request)
    assert_nothing_written(request)


@pytest.mark.parametrize(
    "args",
    [("--max-draft-len", "0"), ("--max-draft-len", "33"), ("--max-context", "8"), ("--dtype", "bfloat16")],
    ids=["draft-len-0", "draft-len-33", "context-8", "dtype"],
)
def test_build_command_rejects_out_of_range_options(args: tuple[str, str], checkpoints: Checkpoints, tmp_path) -> None:
    result = invoke(build_command, "--target", checkpoints.target, "--out", tmp_path / "engines", *args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{args[0]}'" in result.output
    assert not (tmp_path / "engines").exists()


def test_build_command_needs_a_target_and_an_out(checkpoints: Checkpoints, tmp_path: Path) -> None:
    no_target = invoke(build_command, "--out", tmp_path / "engines")
    assert no_target.exit_code == 2 and "give --target" in no_target.output and "--preset" in no_target.output
    no_out = invoke(build_command, "--target", checkpoints.target)
    assert no_out.exit_code == 2 and "give --out" in no_out.output
    assert not (tmp_path / "engines").exists()


# --- successful builds ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    model_draft: Path  # specdec-build --draft CHECKPOINT
    no_draft: Path  # specdec-build --draft none --force over an existing directory
    int4_draft: Path  # build() API, --draft int4
    model_draft_stderr: str
    no_draft_stderr: str
    int4_stages: list[str]


@pytest.fixture(scope="module")
def built(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Three builds of one target, run at once."""
    root = tmp_path_factory.mktemp("built")
    (root / "none").mkdir()
    (root / "none" / SENTINEL).write_text("replace me")
    (root / "none" / MANIFEST_NAME).write_text("{}")  # an engine directory of some earlier build
    common = ["--target", str(checkpoints.target), "--max-draft-len", str(MAX_DRAFT_LEN)]
    common += ["--max-context", str(MAX_CONTEXT)]
    model_draft = start_console_build(*common, "--draft", str(checkpoints.draft), "--out", str(root / "model"))
    no_draft = start_console_build(*common, "--draft", "none", "--force", "--out", str(root / "none"))
    int4 = start_build(
        BuildRequest(
            out=root / "int4",
            target=checkpoints.target,
            draft="int4",
            max_draft_len=MAX_DRAFT_LEN,
            max_context=MAX_CONTEXT,
        )
    )
    outputs = [process.communicate(timeout=300) for process in (model_draft, no_draft)]
    for process, (_, stderr) in zip((model_draft, no_draft), outputs):
        assert process.returncode == 0, stderr[-3000:]
    int4_run = finish_build(int4)
    assert int4_run.returncode == 0, int4_run.stderr[-3000:]
    return Built(root / "model", root / "none", root / "int4", outputs[0][1], outputs[1][1], int4_run.stages)


@pytest.mark.slow
def test_build_command_writes_an_engine_directory(built: Built, checkpoints: Checkpoints) -> None:
    stderr = " ".join(built.model_draft_stderr.split())  # rich wraps long lines at 80 columns off a terminal
    steps = len(STAGES) + 1  # the stages, then the profile of the engines built
    assert "done" in stderr and f"{steps}/{steps}" in stderr, stderr
    assert (built.model_draft / PROFILES_NAME).is_file()
    assert "Built" in stderr and "draft (model)" in stderr, stderr
    for name in ("target/model.onnx", "target/model.onnx.data", "draft/model.onnx", "draft/model.onnx.data"):
        assert (built.model_draft / name).is_file(), name
    assert (built.model_draft / MANIFEST_NAME).is_file()
    assert (built.model_draft / "tokenizer" / "tokenizer.json").is_file()
    assert not (built.model_draft / "raw").exists(), "the unoptimised graphs should not be shipped"
    assert not built.model_draft.with_name("model.partial").exists()
    manifest = read_manifest(built.model_draft)
    assert manifest.draft_kind == "model" and manifest.draft is not None
    assert manifest.draft.quantization == "none" and manifest.draft.source == str(checkpoints.draft)
    assert manifest.target.source == str(checkpoints.target)


@pytest.mark.slow
def test_draft_none_with_force_replaces_the_directory(built: Built) -> None:
    assert "Built" in built.no_draft_stderr
    assert not (built.no_draft / SENTINEL).exists(), "--force should replace the old directory"
    assert not (built.no_draft / "draft").exists()
    assert (built.no_draft / "target" / "model.onnx").is_file()
    manifest = read_manifest(built.no_draft)
    assert manifest.draft_kind == "none" and manifest.draft is None
    assert not [name for name in manifest.files if name.startswith("draft/")]


@pytest.mark.slow
def test_build_api_reports_every_stage_in_order(built: Built) -> None:
    assert built.int4_stages == list(STAGES)
    manifest = read_manifest(built.int4_draft)
    assert manifest.draft_kind == "int4" and manifest.draft.quantization == "int4-block32"


def run_json(*args: str) -> dict:
    result = invoke(run, *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_specdec_run_on_built_engines(built: Built) -> None:
    """The target is the same checkpoint in all three directories, so greedy output is the same whatever drafts."""
    prompt = "abcabcabcabc"  # repeats, so prompt lookup finds matches
    model_draft = run_json("--engines", built.model_draft, "--draft", "engine", "--json", "-n", "8", prompt)
    assert model_draft["draft"] == "engine" and model_draft["num_draft_tokens"] == MAX_DRAFT_LEN
    assert model_draft["stats"]["drafted_tokens"] > 0
    default = run_json("--engines", built.model_draft, "--json", "-n", "8", prompt)  # a directory with a draft
    assert default["draft"] == "ngram+engine" and default["num_draft_tokens"] == "auto"
    assert default["stats"]["drafted_tokens"] > 0
    int4 = run_json("--engines", built.int4_draft, "--json", "-n", "8", prompt)
    assert int4["stats"]["drafted_tokens"] > 0
    plain = run_json("--engines", built.no_draft, "--draft", "none", "--json", "-n", "8", prompt)
    assert plain["draft"] == "none" and plain["num_draft_tokens"] == 0 and plain["stats"]["drafted_tokens"] == 0
    ngram = run_json("--engines", built.no_draft, "--json", "-n", "8", prompt)  # no draft in it: prompt lookup
    assert ngram["draft"] == "ngram" and ngram["stats"]["drafted_tokens"] > 0
    assert model_draft["token_ids"] == default["token_ids"] == int4["token_ids"] == plain["token_ids"]
    assert ngram["token_ids"] == plain["token_ids"]
    assert len(plain["token_ids"]) == plain["stats"]["generated_tokens"] > 0
    hello = run_json("--engines", built.model_draft, "--json", "-n", "8", "hello")
    assert hello["stats"]["drafted_tokens"] > 0


# --- failed builds -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_failed_build_leaves_no_partial_directory(checkpoints: Checkpoints, tmp_path: Path) -> None:
    """A failure at any stage removes the staging directory; an existing --out survives it untouched even
    with --force (it is replaced only after the new directory verified)."""
    failing = ("export draft", "verify", "write")
    requests = []
    for stage in failing:
        out = tmp_path / stage.replace(" ", "-")
        out.mkdir()
        (out / SENTINEL).write_text(stage)
        (out / MANIFEST_NAME).write_text("{}")  # an engine directory of some earlier build
        request = BuildRequest(out=out, target=checkpoints.target, draft="int4", max_context=MAX_CONTEXT, force=True)
        requests.append(request)
    fresh = BuildRequest(out=tmp_path / "fresh", target=checkpoints.target, draft="none", max_context=MAX_CONTEXT)
    processes = [start_build(r, stage) for r, stage in zip([*requests, fresh], [*failing, "verify"])]
    runs = [finish_build(process) for process in processes]
    for request, stage, result in zip([*requests, fresh], [*failing, "verify"], runs):
        assert result.returncode != 0 and f"injected failure at {stage}" in result.stderr, result.stderr[-3000:]
        assert result.stages[-1] == stage
        assert not request.out.with_name(request.out.name + ".partial").exists(), stage
    for request, stage in zip(requests, failing):
        assert sorted(p.name for p in request.out.iterdir()) == sorted([MANIFEST_NAME, SENTINEL])
        assert (request.out / SENTINEL).read_text() == stage
    assert not fresh.out.exists()


# --- regressions of bugs found by these tests -----------------------------------------------------------------


def graph_op_types(graph: Path) -> set[str]:
    return {node.op_type for node in onnx.load(graph, load_external_data=False).graph.node}


@pytest.mark.slow
def test_int4_quantized_pruned_draft(checkpoints: Checkpoints, tmp_path: Path) -> None:
    """--draft-quantization int4 on a vocabulary-pruned draft checkpoint (what specdec-distill writes): the
    draft graph runs MatMulNBits, keeps -inf outside its vocabulary, and decoding stays exactly the target's.
    --target-quantization int4 builds the same checkpoint alone (a draft directory for specdec-bench)."""
    pruned = tmp_path / "pruned-draft"
    shutil.copytree(checkpoints.draft, pruned)
    config = json.loads((pruned / "config.json").read_text())
    vocab = list(range(0, config["vocab_size"], 2))
    (pruned / "config.json").write_text(json.dumps(config | {DRAFT_VOCAB_KEY: vocab}))
    common = ["--max-draft-len", str(MAX_DRAFT_LEN), "--max-context", str(MAX_CONTEXT)]
    both = start_console_build(
        "--target", str(checkpoints.target), "--draft", str(pruned), "--draft-quantization", "int4",
        *common, "--out", str(tmp_path / "both"),
    )  # fmt: skip
    alone = start_build(
        BuildRequest(
            out=tmp_path / "alone",
            target=pruned,
            draft="none",
            target_quantization="int4",
            max_draft_len=MAX_DRAFT_LEN,
            max_context=MAX_CONTEXT,
        )
    )
    _, stderr = both.communicate(timeout=300)
    assert both.returncode == 0, stderr[-3000:]
    alone_run = finish_build(alone)
    assert alone_run.returncode == 0, alone_run.stderr[-3000:]
    manifest = read_manifest(tmp_path / "both")
    assert (manifest.target.quantization, manifest.draft.quantization) == ("none", "int4-block32")
    assert manifest.draft_kind == "model"
    assert "MatMulNBits" in graph_op_types(tmp_path / "both" / "draft" / "model.onnx")
    assert "MatMulNBits" not in graph_op_types(tmp_path / "both" / "target" / "model.onnx")
    assert read_manifest(tmp_path / "alone").target.quantization == "int4-block32"
    assert "MatMulNBits" in graph_op_types(tmp_path / "alone" / "target" / "model.onnx")

    decoder = SpeculativeDecoder.from_engines(tmp_path / "both", "engine")
    logits = decoder.drafter.engine.prefill(torch.tensor([[1, 2, 3]]), torch.tensor([3]))[0]
    outside = torch.ones_like(logits, dtype=torch.bool)
    outside[vocab] = False
    assert bool(torch.isneginf(logits[outside]).all()) and bool(torch.isfinite(logits[~outside]).all())
    decoder.drafter.engine.release(0)  # the decoder's scheduler admits its requests into the engine's slots
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = decoder.generate("abcabc hello", params, num_draft_tokens=0)
    fixed = decoder.generate("abcabc hello", params, num_draft_tokens=3)
    assert fixed.token_ids == plain.token_ids and fixed.stats.accepted_tokens > 0
    # auto drafts only when its measured costs say so, so how much it drafts here depends on timing
    assert decoder.generate("abcabc hello", params, num_draft_tokens="auto").token_ids == plain.token_ids


def test_two_builds_in_one_process(checkpoints: Checkpoints, tmp_path: Path) -> None:
    for name in ("first", "second"):
        build(BuildRequest(out=tmp_path / name, target=checkpoints.target, draft="none", max_context=MAX_CONTEXT))
        assert read_manifest(tmp_path / name).draft_kind == "none"


@pytest.mark.slow
def test_every_accepted_context_builds(checkpoints: Checkpoints, tmp_path: Path) -> None:
    """Whatever check_request accepts must build (a refusal would have to come from check_request)."""
    request = BuildRequest(out=tmp_path / "small", target=checkpoints.target, draft="none", max_context=16)
    check_request(request)
    result = finish_build(start_build(request))
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(request.out).target.max_context == 16


def test_float16_build_decodes_like_float32(checkpoints: Checkpoints, tmp_path: Path) -> None:
    """A float16 build (weights and KV cache in float16, logits float32) verifies, records its dtype, and on
    this tiny model decodes the float32 torch engine's greedy tokens, plain and with its int4 draft."""
    out = tmp_path / "fp16"
    build(
        BuildRequest(
            out=out, target=checkpoints.target, draft="int4", max_draft_len=4, max_context=MAX_CONTEXT, dtype="float16"
        )
    )
    assert read_manifest(out).target.dtype == "float16"
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reference = SpeculativeDecoder.from_pretrained(checkpoints.target, "none").generate("hello world", params)
    decoder = SpeculativeDecoder.from_engines(out, "engine")
    for gamma in (0, 3):
        assert decoder.generate("hello world", params, num_draft_tokens=gamma).token_ids == reference.token_ids
