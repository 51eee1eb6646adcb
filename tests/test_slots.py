"""Slot-level engines, both backends: requests admitted into free slots and prefilled alone while the other
slots keep their caches, steps over any set of occupied slots with a number of new tokens per row, releases
that keep the occupied rows together, and the self-draft's copy of the target's keys and values. Every slot's
logits must be what the same sequence gives alone in a fresh engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec_trt.build import BuildRequest, build
from specdec_trt.build_engines.checkpoint import load_checkpoint
from specdec_trt.draft_spec import DraftSpec
from specdec_trt.loading import open_engine_directory
from specdec_trt.runtime import ort_engine
from specdec_trt.runtime.engine import ContextOverflowError, Engine
from specdec_trt.runtime.torch_engine import TorchEngine

SIZE = {"hidden_size": 64, "head_dim": 16}  # exportable to ONNX (head_dim % 16 == 0)
MAX_CONTEXT = 48
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint(family="llama", **SIZE)


@pytest.fixture(scope="module")
def engine_dir(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("slots") / "engines"
    build(BuildRequest(out=out, target=checkpoint, draft="int4", max_draft_len=8, max_context=MAX_CONTEXT))
    return out


@pytest.fixture(params=["pytorch", "onnxruntime"])
def make_engine(request, checkpoint: Path, engine_dir: Path):
    """A factory of fresh engines of one backend: the target (or, with ``draft=True``, its int4 self-draft)."""

    def make(draft: bool = False) -> Engine:
        if request.param == "pytorch":
            return TorchEngine.from_checkpoint(load_checkpoint(checkpoint), MAX_CONTEXT)
        loaded = open_engine_directory(engine_dir, [DraftSpec.parse("engine")] if draft else [])
        return loaded.only_drafter().engine if draft else loaded.target

    return make


def alone(make_engine, sequence: list[int]) -> torch.Tensor:
    """The logits after the last token of ``sequence`` in a fresh engine, [V]."""
    engine = make_engine()
    return engine.prefill(torch.tensor([sequence]), torch.tensor([len(sequence)]))[0]


def sequences(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30, (count, length), generator=generator).tolist()


def test_admitted_slots_keep_each_others_caches(make_engine) -> None:
    """Three requests arrive one by one, each prefilled alone into its slot (in chunks for the last), then
    decode together with different numbers of new tokens per row: each row's logits are its own."""
    engine = make_engine()
    engine.reserve(4)
    prompts = sequences(3, 12, seed=1)
    seen = [list(p) for p in prompts]
    for slot, prompt in zip((2, 0, 3), prompts):
        engine.admit(slot)
        chunks = [prompt[:5], prompt[5:]] if slot == 3 else [prompt]
        for chunk in chunks:
            last = engine.step([slot], torch.tensor([chunk]), logits_from=[len(chunk) - 1])
        torch.testing.assert_close(last[0, 0], alone(make_engine, prompt), atol=TOLERANCE, rtol=0)
    new = [[5, 6, 7], [8], [9, 10]]
    block = torch.tensor([row + [0] * (3 - len(row)) for row in new])
    logits = engine.step([2, 0, 3], block, [len(row) for row in new])
    for i, row in enumerate(new):
        seen[i] += row
        torch.testing.assert_close(logits[i, len(row) - 1], alone(make_engine, seen[i]), atol=TOLERANCE, rtol=0)
    assert engine.lengths.tolist() == [13, 0, 15, 14]


def test_cache_rows_grow_with_their_sequences_keeping_every_token(
    checkpoint: Path, engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime's cache rows start short and double as a pass needs more positions (a prefill, one token at
    a time, a copy into a self-draft): every row keeps its tokens, and its logits are what a fresh engine gives."""
    monkeypatch.setattr(ort_engine, "FIRST_CACHE_POSITIONS", 4)
    make = lambda draft=False: make_ort(engine_dir, draft)  # noqa: E731 - a fresh engine each call
    engine = make()
    engine.reserve(2)
    first, second = sequences(2, 40, seed=3)
    engine.admit(0)
    engine.step([0], torch.tensor([first[:3]]))
    engine.admit(1)
    engine.step([1], torch.tensor([second[:7]]))  # past 4 positions: both rows grow to 8
    for n in range(3, 40):  # past 8, 16 and 32 positions one token at a time
        logits = engine.step([0], torch.tensor([[first[n]]]))
    torch.testing.assert_close(logits[0, 0], alone(make, first), atol=TOLERANCE, rtol=0)
    logits = engine.step([1], torch.tensor([second[7:]]))
    torch.testing.assert_close(logits[0, -1], alone(make, second), atol=TOLERANCE, rtol=0)
    assert engine._positions == MAX_CONTEXT  # 4 doubled to 32, then to the context (48), no further
    draft = make(draft=True)
    draft.reserve(1)
    draft.admit(0)
    draft.copy_from(engine, 0, 40)  # a self-draft's first copy grows its own rows at once
    assert draft._positions == MAX_CONTEXT and draft.lengths.tolist() == [40]


def make_ort(engine_dir: Path, draft: bool) -> Engine:
    loaded = open_engine_directory(engine_dir, [DraftSpec.parse("engine")] if draft else [])
    return loaded.only_drafter().engine if draft else loaded.target


def test_one_pass_returns_every_token_of_one_row_and_the_last_of_another(make_engine) -> None:
    """A verify row (logits of all its 3 new tokens) and a prefill chunk (its last token's only, of 6) in one
    pass: [2, 3, V], each row's logits its own, and 0 past the chunk's one."""
    engine = make_engine()
    engine.reserve(2)
    decoding, prompt = sequences(1, 7, seed=7)[0], sequences(1, 6, seed=8)[0]
    engine.admit(0)
    engine.step([0], torch.tensor([decoding]))
    engine.admit(1)
    block = torch.tensor([[21, 22, 23, 0, 0, 0], prompt])
    logits = engine.step([0, 1], block, [3, 6], logits_from=[0, 5])
    assert logits.shape == (2, 3, engine.vocab_size)
    for i in range(3):
        expected = alone(make_engine, decoding + [21, 22, 23][: i + 1])
        torch.testing.assert_close(logits[0, i], expected, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits[1, 0], alone(make_engine, prompt), atol=TOLERANCE, rtol=0)
    assert not logits[1, 1:].any()
    assert engine.lengths.tolist() == [10, 6]


def test_release_moves_the_last_row_and_steps_stay_exact(make_engine) -> None:
    """Releasing a slot in the middle moves the last occupied row into its place; the others decode on exactly,
    a step over slots in any order and over a set that is not contiguous returns each row's own logits."""
    engine = make_engine()
    engine.reserve(4)
    prompts = sequences(4, 9, seed=2)
    for slot, prompt in enumerate(prompts):
        engine.admit(slot)
        engine.step([slot], torch.tensor([prompt]))
    engine.release(1)
    assert not engine.occupied(1) and engine.lengths.tolist() == [9, 0, 9, 9]
    for slots in ([3, 0, 2], [0, 3], [2]):
        tokens = torch.tensor([[11 + s] for s in slots])
        logits = engine.step(slots, tokens)
        for i, slot in enumerate(slots):
            prompts[slot] = prompts[slot] + [11 + slot]
            torch.testing.assert_close(logits[i, 0], alone(make_engine, prompts[slot]), atol=TOLERANCE, rtol=0)
    engine.admit(1)  # a freed slot takes a new request, its row fresh
    fresh = sequences(1, 6, seed=3)[0]
    torch.testing.assert_close(
        engine.step([1], torch.tensor([fresh]))[0, -1], alone(make_engine, fresh), atol=1e-4, rtol=0
    )


def test_reserve_grows_the_cache_and_keeps_every_row(make_engine) -> None:
    engine = make_engine()
    engine.reserve(1)
    engine.admit(0)
    prompt = sequences(1, 10, seed=4)[0]
    engine.step([0], torch.tensor([prompt]))
    engine.reserve(3)
    assert engine.num_slots == 3
    logits = engine.step([0], torch.tensor([[7]]))
    torch.testing.assert_close(logits[0, 0], alone(make_engine, prompt + [7]), atol=TOLERANCE, rtol=0)


def test_a_row_without_room_for_the_padding_runs_alone(make_engine) -> None:
    """A row near the end of the context takes one token while another takes eight: padding the first to
    eight would pass the context, so it runs alone, with the same logits."""
    engine = make_engine()
    engine.reserve(2)
    near_end, short = sequences(1, MAX_CONTEXT - 2, seed=5)[0], sequences(1, 5, seed=6)[0]
    for slot, prompt in enumerate((near_end, short)):
        engine.admit(slot)
        engine.step([slot], torch.tensor([prompt]))
    block = torch.tensor([[4] + [0] * 7, list(range(3, 11))])
    logits = engine.step([0, 1], block, [1, 8])
    torch.testing.assert_close(logits[0, 0], alone(make_engine, near_end + [4]), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits[1, 7], alone(make_engine, short + list(range(3, 11))), atol=TOLERANCE, rtol=0)
    with pytest.raises(ContextOverflowError):
        engine.step([0], torch.tensor([[1, 2]]))  # its own two tokens do not fit


def test_rollback_moves_only_the_length_pointer(make_engine) -> None:
    engine = make_engine()
    engine.reserve(1)
    engine.admit(0)
    prompt = sequences(1, 8, seed=7)[0]
    engine.step([0], torch.tensor([prompt + [1, 2, 3]]))
    engine.truncate([0], [8])
    logits = engine.step([0], torch.tensor([[9]]))
    torch.testing.assert_close(logits[0, 0], alone(make_engine, prompt + [9]), atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="outside the cached lengths"):
        engine.truncate([0], [20])


def test_copy_from_gives_a_self_draft_the_targets_keys_and_values(make_engine) -> None:
    """The int4 self-draft copies the target's cached tokens for a slot instead of a pass of its own; its next
    logits are what its own prefill of those tokens would give on the target's keys and values."""
    target, draft = make_engine(), make_engine(draft=True)
    for engine in (target, draft):
        engine.reserve(2)
        engine.admit(1)
    prompt = sequences(1, 10, seed=8)[0]
    target.step([1], torch.tensor([prompt]))
    draft.copy_from(target, 1, 9)
    assert draft.lengths.tolist() == [0, 9]
    copied = draft.step([1], torch.tensor([prompt[-1:]]))[0, 0]
    assert torch.isfinite(copied).all()
    if isinstance(target, TorchEngine):  # the same weights: the copy is the draft's own prefill exactly
        torch.testing.assert_close(copied, alone(make_engine, prompt), atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="only extends"):
        draft.copy_from(target, 1, 20)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e: e.step([0], torch.tensor([[1]])), "are free"),
        (lambda e: (e.admit(0), e.admit(0)), "is occupied"),
        (lambda e: e.admit(5), "outside the engine's 2 slots"),
        (lambda e: (e.admit(0), e.step([0, 0], torch.tensor([[1], [2]]))), "distinct"),
        (lambda e: (e.admit(0), e.step([0], torch.tensor([[1, 2]]), [3])), "1 to 2 tokens"),
        (lambda e: (e.admit(0), e.step([0], torch.tensor([[1, 2]]), [2], [2])), "index into each row's"),
        (lambda e: e.release(1), "are free"),
    ],
)
def test_misuse_is_a_clear_error(make_engine, call, message: str) -> None:
    engine = make_engine()
    engine.reserve(2)
    with pytest.raises(ValueError, match=message):
        call(engine)
