"""The engines' profile is measured outside requests and kept beside the engines: a build and a server start
measure it once per directory and machine, later decoders load it, and no request ever waits for one."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from test_scheduler import GREEDY, checkpoints  # noqa: F401 - the fixture

import specdec_trt.scheduler
from specdec_trt import SpeculativeDecoder
from specdec_trt.backend import BackendOptions
from specdec_trt.build_progress import build_with_progress
from specdec_trt.build_request import BuildRequest
from specdec_trt.profile import PROFILED_ROWS
from specdec_trt.profile_cache import PROFILES_NAME
from specdec_trt.serve.options import DecoderOptions

QUIET = Console(quiet=True)


@pytest.fixture(scope="module")
def built(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811 - the fixture
    """Engines built as specdec-build builds them: the profile measured after the build."""
    out = tmp_path_factory.mktemp("profiled") / "engines"
    request = BuildRequest(out=out, target=checkpoints[0], draft="int4", max_draft_len=4, max_context=128)
    build_with_progress(request, QUIET)
    return out


def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the engines were measured")

    monkeypatch.setattr(specdec_trt.scheduler, "measure_engines", refuse)


def test_a_build_keeps_a_profile_that_later_decoders_load(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (stored,) = json.loads((built / PROFILES_NAME).read_text()).values()
    assert stored["rows"] == list(PROFILED_ROWS) and stored["passes"] and stored["drafts"]
    no_measuring(monkeypatch)
    decoder = SpeculativeDecoder.from_engines(built)  # the default drafter, as the build profiled it
    assert decoder.profiled and decoder.scheduler.planner.costs.round_s is None
    assert decoder.scheduler.planner.costs.fixed_s > 0  # seeded from the profile's passes
    assert decoder.generate("the cat", GREEDY).token_ids
    other = SpeculativeDecoder.from_engines(built, "ngram")  # another drafter: none of its own yet
    assert not other.profiled


def test_no_request_waits_for_a_profile(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a profile a decoder starts from the planner's prior: its requests run, measuring nothing."""
    bare = tmp_path / "bare"
    shutil.copytree(built, bare)
    (bare / PROFILES_NAME).unlink()
    no_measuring(monkeypatch)
    decoder = SpeculativeDecoder.from_engines(bare)
    assert not decoder.profiled
    reference = SpeculativeDecoder.from_engines(built)
    assert decoder.generate("the cat", GREEDY).token_ids == reference.generate("the cat", GREEDY).token_ids
    assert not (bare / PROFILES_NAME).exists()


def test_a_server_measures_a_missing_profile_before_serving_then_keeps_it(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(built, bare)
    (bare / PROFILES_NAME).write_text("{not json")  # unreadable: measured again and replaced
    options = DecoderOptions(BackendOptions(engines=bare), "default", None, max_batch_size=2, max_queue=4)
    decoder = options.open(QUIET)
    assert decoder.profiled
    (stored,) = json.loads((bare / PROFILES_NAME).read_text()).values()
    assert stored["rows"] == [1, 2]  # the numbers of rows this server runs, no more
    no_measuring(monkeypatch)
    again = options.open(QUIET)
    assert again.profiled
    bigger = DecoderOptions(BackendOptions(engines=bare), "default", None, max_batch_size=4, max_queue=4)
    with pytest.raises(AssertionError, match="measured"):  # 4 rows were never timed: measured at its start
        bigger.open(QUIET)


def test_profiling_refuses_while_requests_are_in_flight(built: Path) -> None:
    decoder = SpeculativeDecoder.from_engines(built)
    long = dataclasses.replace(GREEDY, max_new_tokens=100, ignore_eos=True)
    handle = decoder.submit("the cat", long)
    with pytest.raises(RuntimeError, match="in flight"):
        decoder.profile()
    handle.cancel()
    assert handle.result().finish_reason in ("cancelled", "length")
