"""specdec-distill on a tiny random target: the loss falls and the held-out acceptance estimate rises, the
written checkpoint loads and builds into engines whose speculative output equals plain output, and a run
resumed from its saved state ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import char_tokenizer
from safetensors.torch import load_file

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.build import BuildRequest, build
from specdec_trt.build_engines.checkpoint import read_config
from specdec_trt.build_engines.model import DRAFT_VOCAB_KEY
from specdec_trt.distill import DataSettings, DistillConfig, DistillError, TrainSettings, distill
from specdec_trt.distill.cli import distill_command
from specdec_trt.distill.corpus import text_files, text_paths
from specdec_trt.distill.draft import first_layers
from specdec_trt.distill.pipeline import REPORT_FILE, WORK_DIR, _holdout_rows
from specdec_trt.distill.trainer import DistillTrainer, Evaluation

PROMPTS = ["hello world", "the cat sat on the mat", "why is the sky blue?", "one, two, three, four", "good day!"]
SIZE = {"hidden_size": 64, "head_dim": 16, "num_layers": 3}  # head_dim % 16 == 0: exportable to ONNX
DRAFT_VOCAB = 24


@pytest.fixture(scope="module")
def target(make_checkpoint) -> Path:
    return make_checkpoint(family="llama", seed=3, **SIZE)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [json.dumps({"id": str(i), "prompt": p, "chat": i % 2 == 0}) for i, p in enumerate(PROMPTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def settings(out: Path, target: Path, prompts: Path, steps: int = 40, **overrides) -> DistillConfig:
    data = DataSettings(prompts=(str(prompts),), temperatures=(0.0, 1.0), continuation_tokens=48, seq_len=32)
    train = TrainSettings(steps=steps, batch_size=4, learning_rate=3e-3, warmup_steps=4, eval_every=10, seed=1)
    return DistillConfig(
        out=out, target=target, num_layers=1, draft_vocab_size=DRAFT_VOCAB, data=data, train=train, **overrides
    )


@pytest.fixture(scope="module")
def distilled(target, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "draft"
    return out, distill(settings(out, target, prompts_file))


def test_loss_falls_and_acceptance_rises(distilled) -> None:
    out, report = distilled
    first, last = report.evaluations[0], report.evaluations[-1]
    assert [e.step for e in report.evaluations] == [0, 10, 20, 30, 40]
    assert last.kl < 0.6 * first.kl
    assert last.acceptance > first.acceptance + 0.1
    assert last.greedy_match > first.greedy_match
    losses = torch.load(out / WORK_DIR / "state.pt", weights_only=True)["losses"]
    assert len(losses) == 40 and sum(losses[-10:]) < 0.6 * sum(losses[:10])


def test_checkpoint_is_a_pruned_draft_that_builds_and_decodes_losslessly(distilled, target, tmp_path) -> None:
    out, report = distilled
    config = read_config(out)
    assert config.num_layers == 1 and len(config.draft_vocab) == report.draft_vocab_size <= DRAFT_VOCAB
    assert 2 in config.draft_vocab, "EOS must stay in the draft vocabulary"
    assert json.loads((out / REPORT_FILE).read_text())["evaluations"][-1]["step"] == 40
    engines = tmp_path / "engines"
    build(BuildRequest(out=engines, target=target, draft=out, max_draft_len=4, max_context=128))
    decoder = SpeculativeDecoder.from_engines(engines, "engine")
    draft_logits = decoder.drafter.engine.prefill(torch.tensor([[4, 5, 6]]), torch.tensor([3]))
    outside = torch.ones(config.vocab_size, dtype=torch.bool)
    outside[list(config.draft_vocab)] = False
    assert torch.isinf(draft_logits[0, outside]).all() and torch.isfinite(draft_logits[0, ~outside]).all()
    decoder.drafter.engine.release(0)  # the decoder's scheduler admits its requests into the engine's slots
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, params, num_draft_tokens=0)
        speculative = decoder.generate(prompt, params, num_draft_tokens=4)
        assert speculative.token_ids == plain.token_ids
        accepted += speculative.stats.accepted_tokens
    assert accepted > 0


def test_resumed_run_equals_uninterrupted_run(distilled, target, prompts_file, tmp_path) -> None:
    out, _ = distilled
    resumed = tmp_path / "resumed"

    def stop_at_step_20(stage: str, done: int, total: int, figures: dict) -> None:
        if stage == "train" and done == 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(settings(resumed, target, prompts_file), stop_at_step_20)
    assert torch.load(resumed / WORK_DIR / "state.pt", weights_only=True)["step"] == 20
    distill(settings(resumed, target, prompts_file, resume=True))
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(out / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_refusals_before_any_work(distilled, target, prompts_file, tmp_path) -> None:
    out, _ = distilled
    with pytest.raises(DistillError, match="not empty"):
        distill(settings(out, target, prompts_file))
    with pytest.raises(DistillError, match="nothing to resume"):
        distill(settings(tmp_path / "fresh", target, prompts_file, resume=True))
    with pytest.raises(DistillError, match="names 2 layers"):
        distill(settings(tmp_path / "a", target, prompts_file, init_layers=(0, 1)))
    with pytest.raises(DistillError, match="no training data"):
        config = settings(tmp_path / "b", target, prompts_file)
        distill(
            DistillConfig(out=config.out, target=target, draft_vocab_size=0, data=DataSettings(self_generate=False))
        )


def test_cli_trains_from_text_files(target, tmp_path) -> None:
    texts = [tmp_path / "fox.txt", tmp_path / "cat.txt"]
    texts[0].write_text("the quick brown fox jumps over the lazy dog. " * 40)
    texts[1].write_text("the cat sat on the mat, and the dog sat on the log. " * 40)
    out = tmp_path / "draft"
    args = ["--out", out, "--target", target, "--text", texts[0], "--text", texts[1], "--no-self-generate"]
    args += ["--num-layers", "2"]
    args += ["--init-layers", "2,0", "--draft-vocab-size", "0", "--steps", "3", "--seq-len", "64", "--eval-every", "3"]
    result = CliRunner().invoke(distill_command, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    config = read_config(out)
    assert config.num_layers == 2 and config.draft_vocab is None
    assert DRAFT_VOCAB_KEY not in json.loads((out / "config.json").read_text())
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["layers"] == [2, 0] and report["draft_vocab_coverage"] == 1.0
    again = CliRunner().invoke(distill_command, [str(a) for a in args])
    assert again.exit_code != 0 and "not empty" in again.output
    alone = ["--out", tmp_path / "alone", "--target", target, "--text", texts[0], "--no-self-generate"]
    alone += ["--draft-vocab-size", "0"]
    single = CliRunner().invoke(distill_command, [str(a) for a in alone])
    assert single.exit_code != 0 and "at least two" in single.output


def test_first_layers() -> None:
    assert first_layers(30, 2) == [0, 1]
    with pytest.raises(ValueError, match="1 to 5"):
        first_layers(5, 6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_cuda_device_is_refused(target, prompts_file, tmp_path) -> None:
    with pytest.raises(DistillError, match="no CUDA device"):
        distill(settings(tmp_path / "draft", target, prompts_file, device="cuda"))


def test_holdout_takes_whole_prompts() -> None:
    """Every continuation of a held-out prompt is held out: near-copies in training would inflate the
    held-out acceptance (seen: 0.55 held out by chunk, against 0.28 on the benchmark's prompts)."""
    groups = torch.tensor([g for g in range(40) for _ in range(3)])
    rows = _holdout_rows(groups, 0.1, seed=0)
    held = set(groups[rows].tolist())
    assert len(held) == 4 and len(rows) == 12
    assert held.isdisjoint(set(groups.tolist()) - held) and all(groups.tolist().count(g) == 3 for g in held)
    assert torch.equal(rows, _holdout_rows(groups, 0.1, seed=0))
    two_prompts = torch.tensor([5, 5, 7])
    assert len(two_prompts[_holdout_rows(two_prompts, 0.9, seed=1)].unique()) == 1, "never every prompt"


def test_text_directories_give_their_text_files(tmp_path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/a.py", "pkg/b.md", "pkg/sub/c.txt", "pkg/notes.rst", "pkg/data.bin", "single.log"):
        (tmp_path / name).write_text(f"text of {name}\n")
    found = text_paths([tmp_path / "pkg", tmp_path / "single.log", tmp_path / "pkg" / "a.py"])
    names = ["pkg/a.py", "pkg/b.md", "pkg/notes.rst", "pkg/sub/c.txt", "single.log"]
    assert found == sorted(tmp_path / n for n in names), "a named file is kept whatever its suffix, once"


def test_text_is_capped_file_by_file_in_a_seeded_order(tmp_path) -> None:
    tokenizer = char_tokenizer()
    for n in range(6):
        (tmp_path / f"f{n}.txt").write_text("abcdef"[n] * 30)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 5)
    whole = text_files([tmp_path], tokenizer)
    assert len(whole) == 6, "the file that is not UTF-8 is skipped"
    capped = text_files([tmp_path], tokenizer, max_tokens=50, seed=3)
    assert sum(map(len, capped)) == 50 and len(capped) < 6
    assert capped == text_files([tmp_path], tokenizer, max_tokens=50, seed=3)
    assert any(capped != text_files([tmp_path], tokenizer, max_tokens=50, seed=s) for s in range(4, 8))


def test_text_files_are_held_out_whole(target, tmp_path) -> None:
    """Chunks of one text file share its group: a file is held out entirely or not at all."""
    for n in range(10):
        (tmp_path / f"doc{n}.txt").write_text("abcdefghij"[n] * 100)  # a file's chunks: its one letter
    out = tmp_path / "draft"
    data = DataSettings(texts=(str(tmp_path),), self_generate=False, seq_len=16, holdout_fraction=0.2)
    train = TrainSettings(steps=1, batch_size=2, warmup_steps=1, eval_every=1)
    distill(DistillConfig(out=out, target=target, num_layers=1, draft_vocab_size=0, data=data, train=train))
    saved = torch.load(out / WORK_DIR / "data.pt", weights_only=True)
    tokens, lengths = saved["labels"][0], saved["labels"][1]
    held = set(saved["holdout_rows"].tolist())
    by_file: dict[int, set[bool]] = {}
    for row in range(len(tokens)):
        letter = int(tokens[row, : lengths[row]].mode().values)
        by_file.setdefault(letter, set()).add(row in held)
    assert all(len(states) == 1 for states in by_file.values()), "a file was split across train and held-out"
    assert sum(True in states for states in by_file.values()) == 2


def test_the_best_held_out_weights_are_the_ones_kept(distilled, target, prompts_file, tmp_path, monkeypatch) -> None:
    """With a held-out acceptance that peaks mid-run (scripted), the weights restored are those of the peak,
    not the last step's."""
    out, _ = distilled
    scripted = iter([0.1, 0.3, 0.6, 0.4, 0.2])
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def evaluate(self, batch_size: int = 16) -> Evaluation:
        snapshots[self.step] = {k: v.clone() for k, v in self._trainable_weights().items()}
        return Evaluation(self.step, 1.0, next(scripted), 0.0)

    monkeypatch.setattr(DistillTrainer, "evaluate", evaluate)
    report = distill(settings(tmp_path / "draft", target, prompts_file))
    assert report.best_step == 20 and [e.step for e in report.evaluations] == [0, 10, 20, 30, 40]
    written = load_file(tmp_path / "draft" / "model.safetensors")
    assert all(torch.equal(written[name], snapshots[20][name]) for name in snapshots[20])
    assert not all(torch.equal(written[name], snapshots[40][name]) for name in snapshots[40])
