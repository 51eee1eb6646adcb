"""The specdec-distill pipeline: load the target, build the corpus, label it with the teacher, train the
draft, write a Hugging Face checkpoint directory that ``specdec-build --draft DIR`` accepts.

Work in progress lives in ``<out>/.distill/``: ``data.pt`` (the labelled corpus, reused when the data
settings are unchanged) and ``state.pt`` (the trainer's state), so an interrupted run resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec_trt.build_engines.checkpoint import Checkpoint, load_tokenizer, load_transformers_model, read_config
from specdec_trt.build_engines.default_model import default_model_path
from specdec_trt.build_engines.model import ModelConfig
from specdec_trt.decoder import SpeculativeDecoder
from specdec_trt.distill import corpus
from specdec_trt.distill.draft import first_layers, init_draft
from specdec_trt.distill.labels import TeacherLabels, choose_draft_vocab, label
from specdec_trt.distill.trainer import DistillTrainer, Evaluation, TrainSettings
from specdec_trt.loading import usable_device
from specdec_trt.runtime.torch_engine import TorchEngine

WORK_DIR = ".distill"
REPORT_FILE = "distill.json"


class DistillError(ValueError):
    """The requested distillation cannot run; nothing was trained."""


@dataclass(frozen=True)
class DataSettings:
    """What the corpus is made of; a change invalidates the cached labelled corpus."""

    prompts: tuple[str, ...] = ()  # JSONL files; the shipped seed prompts when empty and self-generating
    texts: tuple[str, ...] = ()  # plain-text files, and directories of them (TEXT_SUFFIXES)
    max_text_tokens: int | None = None  # of the texts, taken file by file in a seeded random order
    self_generate: bool = True
    temperatures: tuple[float, ...] = (0.0, 0.8)
    continuation_tokens: int = 192
    max_prompts: int | None = None
    seq_len: int = 256
    label_top_k: int = 64
    holdout_fraction: float = 0.05  # of the prompts and text files, each held out whole


@dataclass(frozen=True)
class DistillConfig:
    """A whole run. ``target=None`` is the embedded SmolLM2-135M-Instruct; ``draft_vocab_size=0`` keeps
    the whole vocabulary."""

    out: Path
    target: Path | None = None
    num_layers: int = 2
    init_layers: tuple[int, ...] | None = None
    draft_vocab_size: int = 8192
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    device: str = "cpu"
    generate_batch_size: int = 32
    resume: bool = False
    force: bool = False


@dataclass
class DistillReport:
    """What a run did: data sizes, timings, the held-out evaluations."""

    target: str
    layers: list[int]
    draft_vocab_size: int
    train_chunks: int
    train_tokens: int
    holdout_tokens: int
    draft_vocab_coverage: float  # share of the teacher's top-1 mass on held-out text the draft can emit
    evaluations: list[Evaluation]
    best_step: int  # the written weights: the best held-out acceptance (slightly optimistic, being chosen)
    seconds: dict[str, float]


Stage = Callable[[str, int, int, dict], None]  # (stage, done, total, figures) for a progress display


def check_config(config: DistillConfig) -> tuple[Path, list[int]]:
    """Every refusal that needs no work; returns the target's path and the draft's initial layers."""
    out = config.out
    if out.exists() and not out.is_dir():
        raise DistillError(f"--out {out} is a file, not a directory: choose a directory path for --out")
    if out.exists() and any(out.iterdir()) and not (config.force or config.resume):
        raise DistillError(f"{out} exists and is not empty: choose another --out, --resume a run, or --force")
    if config.force and out.exists() and any(out.iterdir()) and not _is_distill_output(out):
        raise DistillError(
            f"{out} holds neither {REPORT_FILE} nor {WORK_DIR}/, so it is not a specdec-distill output and --force "
            "will not delete it: choose another --out, or empty it yourself"
        )
    if config.resume and not (out / WORK_DIR / "data.pt").is_file():
        raise DistillError(f"nothing to resume in {out}: {out / WORK_DIR / 'data.pt'} is missing")
    try:
        usable_device(config.device)
    except ValueError as err:
        raise DistillError(str(err)) from err
    target = config.target or default_model_path()
    target_config = read_config(target)
    if config.init_layers is not None and len(config.init_layers) != config.num_layers:
        raise DistillError(
            f"--init-layers names {len(config.init_layers)} layers but --num-layers is {config.num_layers}"
        )
    layers = list(config.init_layers or first_layers(target_config.num_layers, config.num_layers))
    if any(not 0 <= i < target_config.num_layers for i in layers):
        raise DistillError(f"--init-layers must be in [0, {target_config.num_layers}), got {list(layers)}")
    if not 0 <= config.draft_vocab_size <= target_config.vocab_size:
        raise DistillError(f"--draft-vocab-size must be in [0, {target_config.vocab_size}] (0 keeps all of it)")
    data = config.data
    if not (data.self_generate or data.texts or data.prompts):
        raise DistillError("no training data: give --text files, --prompts, or allow --self-generate")
    for file in data.prompts:
        if not Path(file).is_file():
            raise DistillError(f"{file} does not exist")
    if data.self_generate:
        try:
            corpus.load_prompts([Path(p) for p in data.prompts])
        except ValueError as err:
            raise DistillError(f"--prompts: {err}") from err
    for path in data.texts:
        if not Path(path).exists():
            raise DistillError(f"{path} does not exist")
    if data.texts and not corpus.text_paths([Path(t) for t in data.texts]):
        suffixes = ", ".join(corpus.TEXT_SUFFIXES)
        raise DistillError(f"--text names no files (directories contribute their {suffixes} files)")
    if not 0 < data.holdout_fraction < 1:
        raise DistillError(f"--holdout-fraction must be in (0, 1), got {data.holdout_fraction}")
    return Path(target), layers


def distill(config: DistillConfig, on_stage: Stage = lambda stage, done, total, figures: None) -> DistillReport:
    """Run the whole pipeline and write the draft checkpoint into ``config.out``."""
    target_path, layers = check_config(config)
    if config.force and not config.resume:
        shutil.rmtree(config.out, ignore_errors=True)
    created = not config.out.exists()
    work = config.out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _distill(config, target_path, layers, work, on_stage)
    except BaseException:
        if not (work / "data.pt").is_file():  # nothing to resume: leave no debris that refuses the rerun
            shutil.rmtree(config.out if created else work, ignore_errors=True)
        raise


def _is_distill_output(out: Path) -> bool:
    """Whether ``out`` holds a specdec-distill run (finished or in progress)."""
    return (out / REPORT_FILE).is_file() or (out / WORK_DIR).is_dir()


def _distill(config: DistillConfig, target_path: Path, layers: list[int], work: Path, on_stage: Stage) -> DistillReport:
    """The pipeline itself, from loading the target to writing the draft."""
    seconds: dict[str, float] = {}
    tick = time.perf_counter()
    on_stage("load", 0, 1, {})
    device = torch.device(config.device)
    teacher = load_transformers_model(target_path).to(device)
    tokenizer = load_tokenizer(target_path)
    if tokenizer is None:
        raise DistillError(f"{target_path} has no tokenizer: specdec-distill needs one to read prompts and text")
    seconds["load"] = time.perf_counter() - tick
    on_stage("load", 1, 1, {})
    train, holdout, draft_vocab = _labelled_corpus(config, teacher, tokenizer, work, seconds, on_stage)
    draft = init_draft(teacher, layers, draft_vocab).to(device)
    trainer = DistillTrainer(draft, train, holdout, draft_vocab, config.train, work / "state.pt")
    if config.resume and trainer.state_file.is_file():
        trainer.load_state()
    tick = time.perf_counter()

    def show(t: DistillTrainer) -> None:
        latest = t.evaluations[-1]
        figures = {"loss": t.losses[-1], "acceptance": latest.acceptance, "greedy": latest.greedy_match}
        on_stage("train", t.step, config.train.steps, figures)

    on_stage("train", trainer.step, config.train.steps, {})
    evaluations = trainer.train(show)
    best = trainer.restore_best()
    seconds["train"] = time.perf_counter() - tick
    on_stage("write", 0, 1, {})
    report = DistillReport(
        target=str(target_path),
        layers=layers,
        draft_vocab_size=len(draft_vocab) if draft_vocab is not None else teacher.config.vocab_size,
        train_chunks=len(train),
        train_tokens=int(train.lengths.sum()),
        holdout_tokens=int(holdout.lengths.sum()),
        draft_vocab_coverage=_coverage(holdout, draft_vocab),
        evaluations=evaluations,
        best_step=best.step,
        seconds=seconds,
    )
    _write_checkpoint(config, draft.eval(), tokenizer, report)
    on_stage("write", 1, 1, {})
    return report


def _labelled_corpus(
    config: DistillConfig, teacher, tokenizer, work: Path, seconds: dict[str, float], on_stage: Stage
) -> tuple[TeacherLabels, TeacherLabels, list[int] | None]:
    """The labelled corpus split into train and held-out chunks, and the draft vocabulary; cached in
    ``work/data.pt`` for as long as the data settings and the target stay the same."""
    cache = work / "data.pt"
    key = json.dumps(
        {
            "data": asdict(config.data),
            "target": str(config.target),
            "vocab": config.draft_vocab_size,
            "seed": config.train.seed,
            "split": "by prompt and file",
        },
        sort_keys=True,
    )
    if cache.is_file():
        saved = torch.load(cache, weights_only=True)
        if saved["key"] == key:
            labels = TeacherLabels(*saved["labels"])
            return _split(labels, saved["holdout_rows"], saved["draft_vocab"])
        if config.resume:
            raise DistillError(f"{cache} was made with other data settings: run without --resume (or with --force)")
    data = config.data
    sequences: corpus.Grouped = []
    if data.self_generate:
        tick = time.perf_counter()
        prompts = corpus.load_prompts([Path(p) for p in data.prompts])[: data.max_prompts]
        prompt_ids = corpus.prompt_ids(prompts, tokenizer)
        decoder = _plain_decoder(
            teacher, tokenizer, max(map(len, prompt_ids)) + data.continuation_tokens, config.device
        )
        on_stage("generate", 0, len(prompt_ids) * len(data.temperatures), {})
        sequences += corpus.self_generated(
            decoder,
            prompt_ids,
            data.temperatures,
            data.continuation_tokens,
            config.train.seed,
            config.generate_batch_size,
            lambda done, total: on_stage("generate", done, total, {}),
        )
        decoder.close()
        seconds["generate"] = time.perf_counter() - tick
    chunks = corpus.chunks(sequences, data.seq_len)
    # Text files: each is a group of its own (negative, apart from the prompts' groups).
    texts = corpus.text_files([Path(t) for t in data.texts], tokenizer, data.max_text_tokens, config.train.seed)
    chunks += corpus.chunks([(-1 - n, ids) for n, ids in enumerate(texts)], data.seq_len)
    groups = torch.tensor([g for g, _ in chunks])
    sources = len(groups.unique())
    if sources < 2:
        raise DistillError(
            f"the corpus has {sources} prompt(s) and text file(s); held-out evaluation holds out whole ones, "
            "so give at least two"
        )
    tick = time.perf_counter()
    labels = label(
        teacher, [ids for _, ids in chunks], data.label_top_k, 8, lambda done, total: on_stage("label", done, total, {})
    )
    seconds["label"] = time.perf_counter() - tick
    holdout_rows = _holdout_rows(groups, data.holdout_fraction, config.train.seed)
    train_rows = _complement(holdout_rows, len(labels))
    draft_vocab = None
    if config.draft_vocab_size:
        eos = ModelConfig.from_hf(teacher.config).eos_token_ids
        draft_vocab = choose_draft_vocab(
            labels.subset(train_rows), config.draft_vocab_size, teacher.config.vocab_size, eos
        )
    fields = (labels.tokens, labels.lengths, labels.top_ids, labels.top_logits, labels.logsumexp)
    partial = cache.with_name("data.pt.partial")
    torch.save({"key": key, "labels": fields, "holdout_rows": holdout_rows, "draft_vocab": draft_vocab}, partial)
    os.replace(partial, cache)
    return _split(labels, holdout_rows, draft_vocab)


def _holdout_rows(groups: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """The rows of a seeded ``fraction`` of the groups (at least one, never all): whole prompts and files
    are held out, so no continuation of a held-out prompt, nor any part of a held-out file, is trained on."""
    names = groups.unique()
    order = names[torch.randperm(len(names), generator=torch.Generator().manual_seed(seed))]
    held = order[: min(max(1, round(fraction * len(names))), len(names) - 1)]
    return torch.isin(groups, held).nonzero().squeeze(1)


def _complement(rows: torch.Tensor, count: int) -> torch.Tensor:
    keep = torch.ones(count, dtype=torch.bool)
    keep[rows] = False
    return keep.nonzero().squeeze(1)


def _split(labels: TeacherLabels, holdout_rows: torch.Tensor, draft_vocab: list[int] | None):
    return labels.subset(_complement(holdout_rows, len(labels))), labels.subset(holdout_rows), draft_vocab


def _plain_decoder(teacher, tokenizer, max_context: int, device: str) -> SpeculativeDecoder:
    """Our own decoder over the teacher's weights on a PyTorch engine, for batched plain generation."""
    checkpoint = Checkpoint(
        Path(teacher.name_or_path), ModelConfig.from_hf(teacher.config), teacher.state_dict(), tokenizer
    )
    engine = TorchEngine.from_checkpoint(checkpoint, max_context, device)
    return SpeculativeDecoder(engine, None, tokenizer, checkpoint.config.eos_token_ids, num_draft_tokens=0)


def _coverage(holdout: TeacherLabels, draft_vocab: list[int] | None) -> float:
    """Share of the teacher's top-1 probability mass, on held-out positions, that the draft can emit."""
    if draft_vocab is None:
        return 1.0
    mask = holdout.mask()
    top1 = holdout.top_ids[..., 0][mask].long()
    mass = (holdout.top_logits[..., 0] - holdout.logsumexp)[mask].exp()
    inside = torch.isin(top1, torch.tensor(draft_vocab))
    return float((mass * inside).sum() / mass.sum())


def _write_checkpoint(config: DistillConfig, draft, tokenizer, report: DistillReport) -> None:
    """config.json (with the draft vocabulary), safetensors weights, the tokenizer, and distill.json."""
    draft.save_pretrained(config.out)
    tokenizer.save_pretrained(config.out)
    body = asdict(report) | {"settings": json.loads(json.dumps(asdict(config), default=str))}
    (config.out / REPORT_FILE).write_text(json.dumps(body, indent=2))
