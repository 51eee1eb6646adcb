"""One policy for the defaults: the Python API, specdec-run and specdec-serve open the same draft with the same
draft length when none is named, on engine directories with and without a draft of their own and on
checkpoints; and the conflicts the policy refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console
from test_build import MAX_CONTEXT, MAX_DRAFT_LEN, SIZE

from specdec_trt import SpeculativeDecoder
from specdec_trt.backend import BackendOptions
from specdec_trt.bench.session import default_drafts
from specdec_trt.build import BuildRequest, build
from specdec_trt.cli import run
from specdec_trt.decoder import AUTO, DEFAULT_NUM_DRAFT_TOKENS
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.drafting import LookupFirstDrafter, PromptLookupDrafter
from specdec_trt.policy import DEFAULT_DRAFT, DraftLengthWithoutDraftError, choose_draft, is_engines_default
from specdec_trt.serve.options import DecoderOptions
from specdec_trt.validation import ConflictingOptionsError

# What each engine directory opens by default: its own draft behind prompt lookup with "auto", or prompt lookup
# alone with 5 drafts a round capped at what the verify pass was built for.
EXPECTED = {"int4": ("ngram+engine", AUTO), "none": ("ngram", min(DEFAULT_NUM_DRAFT_TOKENS, MAX_DRAFT_LEN))}


@pytest.fixture(scope="module")
def target(make_checkpoint) -> Path:
    return make_checkpoint(family="llama", **SIZE)


@pytest.fixture(scope="module")
def engines(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Engine directories of one tiny target: with its int4 self-draft, and without a draft."""
    root = tmp_path_factory.mktemp("policy-engines")
    for draft in EXPECTED:
        build(BuildRequest(root / draft, target, draft, max_draft_len=MAX_DRAFT_LEN, max_context=MAX_CONTEXT))
    return {draft: root / draft for draft in EXPECTED}


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(run, [*args, "--json", "-n", "4", "hello"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def opened(decoder: SpeculativeDecoder) -> tuple[str, object]:
    return str(decoder.draft), decoder.num_draft_tokens


@pytest.mark.parametrize("built_with", list(EXPECTED))
def test_from_engines_opens_what_specdec_run_and_serve_open(built_with: str, engines: dict[str, Path]) -> None:
    """The README's ``SpeculativeDecoder.from_engines(directory)``, ``specdec-run --engines directory`` and
    specdec-serve's decoder options resolve to the same draft and draft length."""
    directory = engines[built_with]
    decoder = SpeculativeDecoder.from_engines(directory)
    cli = run_json("--engines", str(directory))
    served = DecoderOptions(BackendOptions(engines=directory), DEFAULT_DRAFT, None, 2, 4).open(Console(stderr=True))
    assert opened(decoder) == (cli["draft"], cli["num_draft_tokens"]) == opened(served) == EXPECTED[built_with]
    drafter = LookupFirstDrafter if built_with == "int4" else PromptLookupDrafter
    assert isinstance(decoder.drafter, drafter) and isinstance(served.drafter, drafter)


@pytest.mark.parametrize("built_with", list(EXPECTED))
def test_specdec_bench_measures_the_default_drafter_first(built_with: str, engines: dict[str, Path]) -> None:
    """With no --draft, specdec-bench's first drafter is the one the policy opens by default."""
    directory = engines[built_with]
    assert DraftSpec.parse(default_drafts(directory)[0]) == choose_draft(directory, DEFAULT_DRAFT, None)[0]


def test_from_pretrained_opens_what_specdec_run_opens(target: Path) -> None:
    decoder = SpeculativeDecoder.from_pretrained(target)
    cli = run_json("--target", str(target))
    assert opened(decoder) == (cli["draft"], cli["num_draft_tokens"]) == ("ngram", DEFAULT_NUM_DRAFT_TOKENS)
    assert isinstance(decoder.drafter, PromptLookupDrafter)


def test_a_draft_length_without_a_draft_is_refused(target: Path) -> None:
    with pytest.raises(DraftLengthWithoutDraftError, match="num_draft_tokens=3 needs a draft"):
        choose_draft(None, "none", 3)
    with pytest.raises(ConflictingOptionsError, match="needs a draft"):
        SpeculativeDecoder.from_pretrained(target, "none", num_draft_tokens=3)
    assert choose_draft(None, "none", 0)[1] == 0
    assert opened(SpeculativeDecoder.from_pretrained(target, "none")) == ("none", 0)
    assert opened(SpeculativeDecoder.from_pretrained(target, None)) == ("none", 0)  # None: no draft, as "none"


def test_backend_options_refuse_the_other_backends_options(tmp_path: Path) -> None:
    """Plain data: the conflict is an error of ours, which the commands turn into a usage error."""
    with pytest.raises(ConflictingOptionsError, match="--engines and --target are alternatives"):
        BackendOptions(engines=tmp_path, target=tmp_path)
    with pytest.raises(ConflictingOptionsError, match="--dtype, --compile do not apply to ONNX Runtime engines"):
        BackendOptions(engines=tmp_path, dtype="float16", compile=True)


def test_explicit_choices_are_kept(engines: dict[str, Path]) -> None:
    decoder = SpeculativeDecoder.from_engines(engines["int4"], "engine", num_draft_tokens=2)
    assert opened(decoder) == ("engine", 2)
    assert opened(SpeculativeDecoder.from_engines(engines["int4"], "engine")) == ("engine", MAX_DRAFT_LEN)


def test_the_draft_reserve_is_the_draft_length_or_autos_longest(engines: dict[str, Path]) -> None:
    decoder = SpeculativeDecoder.from_engines(engines["int4"])
    assert decoder.draft_reserve() == decoder.draft_reserve(AUTO) == decoder.max_auto_draft == MAX_DRAFT_LEN
    assert decoder.draft_reserve(2) == 2 and decoder.draft_reserve(0) == 0


@pytest.mark.parametrize(
    ("label", "num_draft_tokens", "expected"),
    [
        ("ngram+int4", AUTO, True),
        ("ngram+engine", AUTO, True),
        ("ngram+int4", 4, False),
        ("ngram", AUTO, False),
        ("int4", AUTO, False),
        ("ngram+distilled", AUTO, False),
    ],
)
def test_the_bench_names_the_engines_default(label: str, num_draft_tokens: object, expected: bool) -> None:
    assert is_engines_default(label, num_draft_tokens) is expected
