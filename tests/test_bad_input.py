"""Bad and awkward input across specdec-run, specdec-build, specdec-bench, specdec-distill and the Python
API: each is a clear error before any work (one line ``Error: ...`` and exit status 1 or 2 from a command,
never a traceback; a ValueError or TypeError subclass of ours from the API) and leaves nothing behind.

One table row per case. Concurrent use (two builds of one directory, two first runs on an empty cache) and
signals during a build have their own tests below the table; a paused stream resumed after another call
is tested in test_scheduler.py (test_a_paused_stream_is_not_disturbed_by_another_call).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import TEXT_VOCAB_SIZE
from test_build import MAX_CONTEXT, MAX_DRAFT_LEN, SIZE, start_build

from specdec_trt import SamplingParams, SpeculativeDecoder
from specdec_trt.bench.cli import bench
from specdec_trt.build import BuildRequest, build
from specdec_trt.build_engines.manifest import MANIFEST_NAME
from specdec_trt.build_lock import build_lock, lock_path
from specdec_trt.build_request import PRESETS
from specdec_trt.cli import build_command, run
from specdec_trt.distill.cli import distill_command
from specdec_trt.policy import default_engine_dir

TOO_BIG_SEED = str(2**64)
MANY_THREADS = str((os.cpu_count() or 1) + 1)
USER_FILE = "notes.txt"  # what --force must never delete


@dataclass(frozen=True)
class Paths:
    """What a row's arguments may name: ``{tmp}`` (the row's own directory) and the models below."""

    tmp: Path
    target: Path  # a checkpoint with the character tokenizer
    wider: Path  # the same family with 40 token ids
    head_dim_12: Path  # an architecture the exporter refuses
    no_tokenizer: Path
    engines: Path  # built from target with an int4 draft, max draft length 4

    def format(self, text: str) -> str:
        return text.format(**{name: str(getattr(self, name)) for name in self.__dataclass_fields__})


Setup = Callable[[Paths], None]


@dataclass(frozen=True)
class Cli:
    """A command line: the exit status, a fragment of its one ``Error:`` line (or usage error), and paths
    that must not exist (``absent``) or must still exist (``kept``) afterwards."""

    command: object
    args: tuple[str, ...]
    status: int
    message: str
    setup: Setup | None = None
    stdin: bytes | None = None
    absent: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


@dataclass(frozen=True)
class Api:
    """A Python call: the exception type it raises (a subclass of ours) and a fragment of its message."""

    call: Callable[[Paths, SpeculativeDecoder], object]
    error: type[Exception]
    message: str
    setup: Setup | None = None
    absent: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


# --- files the rows are given ---------------------------------------------------------------------------


def write(name: str, content: bytes | str) -> Setup:
    def setup(paths: Paths) -> None:
        path = paths.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)

    return setup


def user_directory(name: str) -> Setup:
    """A directory of the user's that holds no engine: a file that must survive."""
    return write(f"{name}/{USER_FILE}", "mine")


def empty_directory(name: str) -> Setup:
    return lambda paths: (paths.tmp / name).mkdir()


def both(*setups: Setup) -> Setup:
    def setup(paths: Paths) -> None:
        for each in setups:
            each(paths)

    return setup


def results(**changes) -> str:
    """A specdec-bench results file with ``changes`` to its top level."""
    body = {"schema": "specdec-bench/1", "status": "complete", "command": "specdec-bench", "config": {}}
    body |= {"environment": {}, "methods": [], "runs": []}
    return json.dumps({**body, **changes})


def reseal(body: dict) -> dict:
    """The manifest with its own checksum recomputed, so that only the layout checks can catch an edit."""
    rest = {key: value for key, value in body.items() if key != "checksum"}
    return {**rest, "checksum": hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()}


def broken_engines(edit: Callable[[dict], None] | None = None, raw: bytes | None = None) -> Setup:
    """A copy of the engines at ``{tmp}/broken``: the manifest edited and resealed, or replaced by ``raw``."""

    def setup(paths: Paths) -> None:
        copy = Path(shutil.copytree(paths.engines, paths.tmp / "broken"))
        manifest = copy / MANIFEST_NAME
        if raw is not None:
            manifest.write_bytes(raw)
            return
        body = json.loads(manifest.read_text())
        edit(body)
        manifest.write_text(json.dumps(reseal(body), indent=2, sort_keys=True))

    return setup


def drop(*keys: str) -> Callable[[dict], None]:
    def edit(body: dict) -> None:
        entry = body
        for key in keys[:-1]:
            entry = entry[key]
        del entry[keys[-1]]

    return edit


def assign(value: object, *keys: str) -> Callable[[dict], None]:
    def edit(body: dict) -> None:
        entry = body
        for key in keys[:-1]:
            entry = entry[key]
        entry[keys[-1]] = value

    return edit


def prompts(*lines: str) -> str:
    return "\n".join(lines) + "\n"


T = ("--target", "{target}")
E = ("--engines", "{engines}")
BROKEN = ("--engines", "{tmp}/broken")
OUT = ("--out", "{tmp}/out")
BUILD = (*T, "--max-draft-len", str(MAX_DRAFT_LEN), "--max-context", str(MAX_CONTEXT))
NO_BUILD_DEBRIS = ("{tmp}/out.partial", "{tmp}/out.lock")
DISTILL = (
    "--out",
    "{tmp}/d",
    *T,
    "--steps",
    "1",
    "--continuation-tokens",
    "4",
    "--max-prompts",
    "2",
    "--draft-vocab-size",
    "0",
)
NO_DISTILL_DEBRIS = ("{tmp}/d/.distill",)
BENCH = (*T, "--no-peers", "--limit", "1", "--repeats", "1", "-n", "4", "--out", "{tmp}/bench.json")

CLI_ROWS: dict[str, Cli] = {
    # specdec-run: sampling values that pass a shallow check
    "run: -t inf": Cli(run, (*T, "-t", "inf", "x"), 2, "'inf' is not a finite number"),
    "run: -t nan": Cli(run, (*T, "-t", "nan", "x"), 2, "'nan' is not a finite number"),
    "run: -t word": Cli(run, (*T, "-t", "hot", "x"), 2, "'hot' is not a valid float"),
    "run: --top-p nan": Cli(run, (*T, "--top-p", "nan", "x"), 2, "is not a finite number"),
    "run: --top-p 1.5": Cli(run, (*T, "--top-p", "1.5", "x"), 2, "--top-p"),
    "run: --min-p 1": Cli(run, (*T, "--min-p", "1", "x"), 2, "--min-p"),
    "run: --top-k -1": Cli(run, (*T, "--top-k", "-1", "x"), 2, "--top-k"),
    "run: --top-k 1.5": Cli(run, (*T, "--top-k", "1.5", "x"), 2, "'1.5' is not a valid integer"),
    "run: seed 2^64": Cli(run, (*T, "--seed", TOO_BIG_SEED, "x"), 2, "0<=x<=18446744073709551615"),
    "run: seed -1": Cli(run, (*T, "--seed", "-1", "x"), 2, "--seed"),
    "run: -n 0": Cli(run, (*T, "-n", "0", "x"), 2, "--max-new-tokens"),
    "run: -n past the context": Cli(run, (*T, "-n", "100000", "x"), 1, "more than the max context"),
    "run: -k superscript two": Cli(run, (*T, "-k", "²", "x"), 2, "'²' is neither a draft length"),
    "run: -k 1.5": Cli(run, (*T, "-k", "1.5", "x"), 2, "'1.5' is neither a draft length"),
    "run: -k with --draft none": Cli(run, (*T, "--draft", "none", "-k", "3", "x"), 2, "-k 3 needs a draft"),
    "run: --stop empty": Cli(run, (*T, "--stop", "", "x"), 1, "stop must be a non-empty string"),
    # specdec-run: threads and the PyTorch engine's options
    "run: --threads many": Cli(run, (*T, "--threads", MANY_THREADS, "x"), 2, "CPU cores here, which cannot help"),
    "run: --threads 0": Cli(run, (*T, "--threads", "0", "x"), 2, "threads must be an integer >= 1"),
    "run: --threads word": Cli(run, (*T, "--threads", "all", "x"), 2, "'all' is not an integer"),
    "run: --max-context -5": Cli(run, (*T, "--max-context", "-5", "x"), 2, "--max-context"),
    "run: --device tpu9": Cli(run, (*T, "--device", "tpu9", "x"), 1, "'tpu9' is not a torch device"),
    "run: engines and target": Cli(run, (*T, *E, "x"), 2, "--engines and --target are alternatives"),
    "run: --device with engines": Cli(run, (*E, "--device", "cpu", "x"), 2, "--device does not apply to ONNX"),
    # specdec-run: undecodable or empty prompts
    "run: stdin not UTF-8": Cli(run, (*T, "-"), 1, "standard input is not valid UTF-8 (byte 0xff", stdin=b"\xffab"),
    "run: PROMPT not UTF-8": Cli(run, (*T, "ab\udcff"), 1, "PROMPT is not valid UTF-8"),
    "run: empty PROMPT": Cli(run, (*T, ""), 1, "the prompt is empty"),
    "run: empty stdin": Cli(run, (*T, "-"), 1, "the prompt is empty", stdin=b""),
    # specdec-run: models that are not what they should be
    "run: draft missing": Cli(run, (*T, "--draft", "{tmp}/none-here", "x"), 1, "does not exist"),
    "run: draft vocabulary": Cli(run, (*T, "--draft", "{wider}", "x"), 1, "has 40 token ids but the target"),
    "run: own draft of a checkpoint": Cli(run, (*T, "--draft", "engine", "x"), 1, "names an engine directory's own"),
    "run: target is an empty dir": Cli(
        run, ("--target", "{tmp}/empty", "x"), 1, "config.json is missing", setup=user_directory("empty")
    ),
    "run: target config not JSON": Cli(
        run, ("--target", "{tmp}/ckpt", "x"), 1, "config.json is not valid JSON", setup=write("ckpt/config.json", "{")
    ),
    "run: target config not UTF-8": Cli(
        run,
        ("--target", "{tmp}/ckpt", "x"),
        1,
        "config.json is not valid JSON",
        setup=write("ckpt/config.json", b"\xff"),
    ),
    "run: target is a text file": Cli(
        run, ("--target", "{tmp}/model.bin", "x"), 1, "is not a checkpoint directory", setup=write("model.bin", "hi")
    ),
    "run: engines on a file": Cli(run, ("--engines", "{tmp}/f", "x"), 2, "is a file", setup=write("f", "x")),
    "run: engines without manifest": Cli(
        run, ("--engines", "{tmp}/empty", "x"), 1, "is not an engine directory", setup=user_directory("empty")
    ),
    "run: engines -k past the build": Cli(run, (*E, "-k", "9", "x"), 1, "exceeds the 4 drafts the engine was built"),
    "run: engines --threads many": Cli(run, (*E, "--threads", MANY_THREADS, "x"), 2, "CPU cores here"),
    "run: engines draft a checkpoint": Cli(run, (*E, "--draft", "{target}", "x"), 1, "is not an engine directory"),
    # specdec-run: engine directories whose manifest is not what specdec-build writes
    "manifest not UTF-8": Cli(run, (*BROKEN, "x"), 1, "is not UTF-8 text", setup=broken_engines(raw=b'{"\xff": 1}')),
    "manifest truncated": Cli(run, (*BROKEN, "x"), 1, "is not valid JSON", setup=broken_engines(raw=b'{"target": ')),
    "manifest a list": Cli(run, (*BROKEN, "x"), 1, "does not hold a JSON object", setup=broken_engines(raw=b"[]")),
    "manifest key removed": Cli(
        run, (*BROKEN, "x"), 1, "the manifest lacks files", setup=broken_engines(drop("files"))
    ),
    "manifest key added": Cli(
        run, (*BROKEN, "x"), 1, "the manifest has unknown keys extra", setup=broken_engines(assign(1, "extra"))
    ),
    "manifest entry key removed": Cli(
        run, (*BROKEN, "x"), 1, "the target entry lacks head_dim", setup=broken_engines(drop("target", "head_dim"))
    ),
    "manifest entry key added": Cli(
        run, (*BROKEN, "x"), 1, "the draft entry has unknown keys", setup=broken_engines(assign(0, "draft", "bias"))
    ),
    "manifest entry a string": Cli(
        run,
        (*BROKEN, "x"),
        1,
        "target.num_layers is 'two'",
        setup=broken_engines(assign("two", "target", "num_layers")),
    ),
    "manifest entry negative": Cli(
        run, (*BROKEN, "x"), 1, "target.max_context is -1", setup=broken_engines(assign(-1, "target", "max_context"))
    ),
    "manifest entry zero": Cli(
        run, (*BROKEN, "x"), 1, "target.vocab_size is 0", setup=broken_engines(assign(0, "target", "vocab_size"))
    ),
    "manifest entry a bool": Cli(
        run, (*BROKEN, "x"), 1, "draft.head_dim is True", setup=broken_engines(assign(True, "draft", "head_dim"))
    ),
    "manifest dtype": Cli(
        run, (*BROKEN, "x"), 1, "target.dtype 'float64'", setup=broken_engines(assign("float64", "target", "dtype"))
    ),
    "manifest graph not checksummed": Cli(
        run, (*BROKEN, "x"), 1, "is not among its checksummed", setup=broken_engines(assign("../x", "target", "graph"))
    ),
    "manifest draft kind": Cli(
        run, (*BROKEN, "x"), 1, "draft_kind 'big' is none of", setup=broken_engines(assign("big", "draft_kind"))
    ),
    "manifest draft removed": Cli(
        run, (*BROKEN, "x"), 1, "does not match the draft entry", setup=broken_engines(assign(None, "draft"))
    ),
    "manifest files malformed": Cli(
        run, (*BROKEN, "x"), 1, "'files' must map each file", setup=broken_engines(assign({"a": 1}, "files"))
    ),
    "manifest layers changed": Cli(
        run, (*BROKEN, "x"), 1, "2 layers of cache, not 3", setup=broken_engines(assign(3, "target", "num_layers"))
    ),
    "manifest vocabulary changed": Cli(
        run,
        (*BROKEN, "x"),
        1,
        f"logits over {TEXT_VOCAB_SIZE} tokens, not 99",
        setup=broken_engines(assign(99, "target", "vocab_size")),
    ),
    "manifest context changed": Cli(
        run,
        (*BROKEN, "x"),
        1,
        "tables for 64 positions, not 128",
        setup=broken_engines(assign(128, "draft", "max_context")),
    ),
    # specdec-build: output directories
    "build: no target": Cli(build_command, OUT, 2, "give --target"),
    "build: no out": Cli(build_command, T, 2, "give --out"),
    "build: out is a file": Cli(
        build_command, (*BUILD, *OUT), 1, "is a file, not a directory", setup=write("out", "mine"), kept=("{tmp}/out",)
    ),
    "build: out not empty": Cli(
        build_command,
        (*BUILD, *OUT),
        1,
        "exists and is not empty",
        setup=user_directory("out"),
        kept=(f"{{tmp}}/out/{USER_FILE}",),
    ),
    "build: force onto a user directory": Cli(
        build_command,
        (*BUILD, *OUT, "--force"),
        1,
        "holds no manifest.json, so it is not an engine directory",
        setup=user_directory("out"),
        absent=NO_BUILD_DEBRIS,
        kept=(f"{{tmp}}/out/{USER_FILE}",),
    ),
    "build: out under a file": Cli(
        build_command, (*BUILD, "--out", "{tmp}/f/out"), 1, "check the path", setup=write("f", "x"), kept=("{tmp}/f",)
    ),
    # specdec-build: settings and checkpoints
    "build: target missing": Cli(
        build_command, ("--target", "{tmp}/no", *OUT), 1, "does not exist", absent=("{tmp}/out",)
    ),
    "build: --max-draft-len 0": Cli(build_command, (*T, *OUT, "--max-draft-len", "0"), 2, "--max-draft-len"),
    "build: --max-draft-len 33": Cli(build_command, (*T, *OUT, "--max-draft-len", "33"), 2, "--max-draft-len"),
    "build: --max-context 10": Cli(build_command, (*T, *OUT, "--max-context", "10"), 2, "--max-context"),
    "build: context past the model": Cli(
        build_command, (*T, *OUT, "--max-context", "512"), 1, "exceeds what the target supports", absent=("{tmp}/out",)
    ),
    "build: --dtype float64": Cli(build_command, (*T, *OUT, "--dtype", "float64"), 2, "--dtype"),
    "build: --preset unknown": Cli(build_command, ("--preset", "gpt5", *OUT), 2, "--preset"),
    "build: quantize the int4 draft": Cli(
        build_command, (*BUILD, *OUT, "--draft-quantization", "int4"), 1, "applies to a draft checkpoint"
    ),
    "build: int4 draft of an int4 target": Cli(
        build_command, (*BUILD, *OUT, "--target-quantization", "int4"), 1, "would be the target itself"
    ),
    "build: draft vocabulary": Cli(build_command, (*BUILD, *OUT, "--draft", "{wider}"), 1, "has 40 token ids"),
    "build: head_dim": Cli(
        build_command,
        ("--target", "{head_dim_12}", *OUT),
        1,
        "head_dim 12 is not a multiple of 16",
        absent=("{tmp}/out",),
    ),
    "build: target config not UTF-8": Cli(
        build_command,
        ("--target", "{tmp}/ckpt", *OUT),
        1,
        "is not valid JSON",
        setup=write("ckpt/config.json", b"\xfe"),
    ),
    # specdec-bench --from-json
    "bench: results truncated": Cli(
        bench,
        ("--from-json", "{tmp}/r.json"),
        1,
        "is not valid JSON, perhaps truncated",
        setup=write("r.json", results()[:40]),
    ),
    "bench: results a list": Cli(
        bench, ("--from-json", "{tmp}/r.json"), 1, "holds a JSON list, not an object", setup=write("r.json", "[1, 2]")
    ),
    "bench: results binary": Cli(
        bench, ("--from-json", "{tmp}/r.json"), 1, "is not a text file", setup=write("r.json", bytes(range(256)))
    ),
    "bench: results another JSON": Cli(
        bench, ("--from-json", "{tmp}/r.json"), 1, "has schema None, not 'specdec-bench/1'", setup=write("r.json", "{}")
    ),
    "bench: results lack runs": Cli(
        bench,
        ("--from-json", "{tmp}/r.json"),
        1,
        "lacks runs",
        setup=write("r.json", json.dumps({k: v for k, v in json.loads(results()).items() if k != "runs"})),
    ),
    "bench: results damaged runs": Cli(
        bench,
        ("--from-json", "{tmp}/r.json"),
        1,
        "holds damaged methods or runs",
        setup=write("r.json", results(runs=[7])),
    ),
    "bench: results damaged methods": Cli(
        bench, ("--from-json", "{tmp}/r.json"), 1, "holds damaged methods", setup=write("r.json", results(methods=[{}]))
    ),
    "bench: results a directory": Cli(bench, ("--from-json", "{tmp}"), 2, "is a directory"),
    "bench: results missing": Cli(bench, ("--from-json", "{tmp}/no.json"), 2, "does not exist"),
    # specdec-bench: settings
    "bench: -k superscript two": Cli(bench, (*BENCH, "-k", "²"), 2, "'²' is neither a draft length"),
    "bench: -k 0": Cli(bench, (*BENCH, "-k", "0"), 2, "'0' is neither a draft length"),
    "bench: -t inf": Cli(bench, (*BENCH, "-t", "inf"), 2, "give one or more finite values"),
    "bench: -t -1": Cli(bench, (*BENCH, "-t", "0,-1"), 2, "each >= 0"),
    "bench: --seed 2^64": Cli(bench, (*BENCH, "--seed", TOO_BIG_SEED), 2, "--seed"),
    "bench: --threads many": Cli(bench, (*BENCH, "--threads", MANY_THREADS), 2, "CPU cores here"),
    "bench: --repeats 0": Cli(bench, (*BENCH, "--repeats", "0"), 2, "--repeats"),
    "bench: --max-new-tokens 1": Cli(bench, (*BENCH, "-n", "1"), 2, "--max-new-tokens"),
    "bench: --out a directory": Cli(bench, (*T, "--out", "{tmp}"), 2, "is a directory"),
    "bench: peers options without peers": Cli(
        bench, (*BENCH, "--hf-target", "{target}"), 2, "need the peers (--peers)"
    ),
    "bench: unknown suite": Cli(bench, (*BENCH, "--suite", "poetry"), 1, "'poetry' is neither a suite"),
    "bench: suite not UTF-8": Cli(
        bench, (*BENCH, "--suite", "{tmp}/s.jsonl"), 1, "s.jsonl is not valid UTF-8", setup=write("s.jsonl", b"\xc3(")
    ),
    "bench: suite line not an object": Cli(
        bench, (*BENCH, "--suite", "{tmp}/s.jsonl"), 1, "s.jsonl:1: each line must be", setup=write("s.jsonl", "[1]\n")
    ),
    "bench: suite empty": Cli(
        bench, (*BENCH, "--suite", "{tmp}/s.jsonl"), 1, "holds no prompts", setup=write("s.jsonl", "\n")
    ),
    "bench: engines -k past the build": Cli(
        bench, (*E, "--no-peers", "--suite", "code", "-k", "9", "--out", "{tmp}/b.json"), 1, "exceeds the 4 drafts"
    ),
    # specdec-distill
    "distill: prompts not JSON": Cli(
        distill_command,
        (*DISTILL, "--prompts", "{tmp}/p.jsonl"),
        1,
        "--prompts: {tmp}/p.jsonl:2: not valid JSON",
        setup=write("p.jsonl", prompts('{"id": "a", "prompt": "hi"}', "{oops")),
        absent=("{tmp}/d",),
    ),
    "distill: prompts not UTF-8": Cli(
        distill_command,
        (*DISTILL, "--prompts", "{tmp}/p.jsonl"),
        1,
        "p.jsonl is not valid UTF-8",
        setup=write("p.jsonl", b'{"id": "a", "prompt": "\xff"}\n'),
        absent=("{tmp}/d",),
    ),
    "distill: prompts empty": Cli(
        distill_command,
        (*DISTILL, "--prompts", "{tmp}/p.jsonl"),
        1,
        "holds no prompts",
        setup=write("p.jsonl", ""),
        absent=("{tmp}/d",),
    ),
    "distill: one prompt, after loading": Cli(
        distill_command,
        (*DISTILL, "--prompts", "{tmp}/p.jsonl"),
        1,
        "give at least two",
        setup=write("p.jsonl", prompts('{"id": "a", "prompt": "hello"}')),
        absent=("{tmp}/d",),
    ),
    "distill: one prompt into an existing out": Cli(
        distill_command,
        (*DISTILL, "--prompts", "{tmp}/p.jsonl"),
        1,
        "give at least two",
        setup=both(write("p.jsonl", prompts('{"id": "a", "prompt": "hi"}')), empty_directory("d")),
        absent=NO_DISTILL_DEBRIS,
        kept=("{tmp}/d",),
    ),
    "distill: target without tokenizer": Cli(
        distill_command,
        ("--out", "{tmp}/d", "--target", "{no_tokenizer}", "--steps", "1", "--draft-vocab-size", "0"),
        1,
        "has no tokenizer",
        absent=("{tmp}/d",),
    ),
    "distill: out is a file": Cli(
        distill_command, (*DISTILL,), 1, "is a file, not a directory", setup=write("d", "mine"), kept=("{tmp}/d",)
    ),
    "distill: out not empty": Cli(
        distill_command,
        (*DISTILL,),
        1,
        "exists and is not empty",
        setup=user_directory("d"),
        kept=(f"{{tmp}}/d/{USER_FILE}",),
    ),
    "distill: force onto a user directory": Cli(
        distill_command,
        (*DISTILL, "--force"),
        1,
        "is not a specdec-distill output and --force will not delete it",
        setup=user_directory("d"),
        kept=(f"{{tmp}}/d/{USER_FILE}",),
    ),
    "distill: nothing to resume": Cli(distill_command, (*DISTILL, "--resume"), 1, "nothing to resume"),
    "distill: --init-layers past the target": Cli(
        distill_command, (*DISTILL, "--num-layers", "1", "--init-layers", "5"), 1, "--init-layers must be in [0, 2)"
    ),
    "distill: --init-layers count": Cli(distill_command, (*DISTILL, "--init-layers", "0"), 1, "names 1 layers"),
    "distill: --draft-vocab-size past the target": Cli(
        distill_command, (*DISTILL, "--draft-vocab-size", "1000000"), 1, "--draft-vocab-size must be in"
    ),
    "distill: --holdout-fraction 1.5": Cli(distill_command, (*DISTILL, "--holdout-fraction", "1.5"), 1, "(0, 1)"),
    "distill: --holdout-fraction nan": Cli(distill_command, (*DISTILL, "--holdout-fraction", "nan"), 1, "(0, 1)"),
    "distill: --threads many": Cli(distill_command, (*DISTILL, "--threads", MANY_THREADS), 2, "CPU cores here"),
    "distill: --seed 2^64": Cli(distill_command, (*DISTILL, "--seed", TOO_BIG_SEED), 2, "--seed"),
    "distill: --lr inf": Cli(distill_command, (*DISTILL, "--lr", "inf"), 2, "'inf' is not a finite number"),
    "distill: --kd-temperature 0": Cli(distill_command, (*DISTILL, "--kd-temperature", "0"), 2, "--kd-temperature"),
    "distill: --temperatures inf": Cli(distill_command, (*DISTILL, "--temperatures", "0,inf"), 2, "finite values"),
    "distill: --device tpu9": Cli(distill_command, (*DISTILL, "--device", "tpu9"), 1, "'tpu9' is not a torch device"),
    "distill: --text missing": Cli(distill_command, (*DISTILL, "--text", "{tmp}/no.txt"), 2, "does not exist"),
    "distill: --text without text files": Cli(
        distill_command, (*DISTILL, "--text", "{tmp}/data"), 1, "--text names no files", setup=write("data/x.bin", "")
    ),
    "distill: no data": Cli(distill_command, (*DISTILL, "--no-self-generate"), 1, "no training data"),
}


def params(**fields) -> Callable[[Paths, SpeculativeDecoder], object]:
    return lambda paths, decoder: SamplingParams(**fields)


def generate(*args, **kwargs) -> Callable[[Paths, SpeculativeDecoder], object]:
    return lambda paths, decoder: decoder.generate(*args, **kwargs)


def generate_on_engines(engines: Path, num_draft_tokens: int) -> object:
    decoder = SpeculativeDecoder.from_engines(engines)
    try:
        return decoder.generate("x", num_draft_tokens=num_draft_tokens)
    finally:
        decoder.close()


API_ROWS: dict[str, Api] = {
    # SamplingParams
    "top_p None": Api(params(top_p=None), TypeError, "top_p must be a number, got None"),
    "temperature a string": Api(params(temperature="0.8"), TypeError, "temperature must be a number, got '0.8'"),
    "temperature inf": Api(params(temperature=math.inf), ValueError, "temperature must be a finite number"),
    "temperature nan": Api(params(temperature=math.nan), ValueError, "temperature must be a finite number"),
    "temperature negative": Api(params(temperature=-0.5), ValueError, "temperature must be >= 0"),
    "temperature a bool": Api(params(temperature=True), TypeError, "temperature must be a number, got True"),
    "top_p 0": Api(params(top_p=0), ValueError, "top_p must be in (0, 1]"),
    "min_p 1": Api(params(min_p=1.0), ValueError, "min_p must be in [0, 1)"),
    "min_p a list": Api(params(min_p=[0.1]), TypeError, "min_p must be a number"),
    "seed 2^64": Api(params(seed=2**64), ValueError, "seed must be an integer from 0 to 18446744073709551615"),
    "seed -1": Api(params(seed=-1), ValueError, "seed must be an integer >= 0"),
    "seed a float": Api(params(seed=1.5), TypeError, "seed must be an integer, got 1.5"),
    "seed a bool": Api(params(seed=True), TypeError, "seed must be an integer, got True"),
    "seed a string": Api(params(seed="1"), TypeError, "seed must be an integer, got '1'"),
    "max_new_tokens 0": Api(params(max_new_tokens=0), ValueError, "max_new_tokens must be an integer >= 1"),
    "max_new_tokens a float": Api(params(max_new_tokens=2.0), TypeError, "max_new_tokens must be an integer"),
    "top_k a float": Api(params(top_k=1.5), TypeError, "top_k must be an integer"),
    "top_k -1": Api(params(top_k=-1), ValueError, "top_k must be an integer >= 0"),
    "stop empty": Api(params(stop=""), ValueError, "stop must be a non-empty string"),
    "stop a number": Api(params(stop=[1]), ValueError, "stop must be a non-empty string"),
    "stop None": Api(params(stop=None), ValueError, "stop must be a non-empty string"),
    "ignore_eos a string": Api(params(ignore_eos="yes"), TypeError, "ignore_eos must be True or False"),
    # prompts
    "generate(None)": Api(generate(None), TypeError, "a prompt must be a str or a list of token ids, got NoneType"),
    "prompt bytes": Api(generate(b"abc"), TypeError, "got bytes: decode it to a str first"),
    "prompt a number": Api(generate(7), TypeError, "got int"),
    "token ids floats": Api(generate([3.0, 4.7]), TypeError, "token ids must be integers, got 3.0 (float)"),
    "token ids bytes": Api(generate([b"a"]), TypeError, "token ids must be integers, got b'a'"),
    "token ids bools": Api(generate([True, 3]), TypeError, "got True (bool)"),
    "token ids strings": Api(generate(["3"]), TypeError, "got '3' (str)"),
    "token id past the vocabulary": Api(generate([999]), ValueError, "outside the vocabulary"),
    "token id negative": Api(generate([-1]), ValueError, "outside the vocabulary"),
    "no token ids": Api(generate([]), ValueError, "the prompt is empty"),
    "empty text": Api(generate(""), ValueError, "the prompt is empty"),
    "lone surrogate": Api(generate("ab\udcff"), ValueError, "the prompt is not valid UTF-8"),
    "prompt past the context": Api(generate("x" * 300), ValueError, "more than the max context"),
    # params and draft lengths
    "params a dict": Api(generate("x", {"max_new_tokens": 4}), TypeError, "params must be a SamplingParams"),
    "params a string": Api(generate("x", "greedy"), TypeError, "got str"),
    "params a list of dicts": Api(
        lambda paths, decoder: decoder.generate_batch(["x"], [{"seed": 1}]),
        TypeError,
        "params must be a SamplingParams",
    ),
    "params per prompt": Api(
        lambda paths, decoder: decoder.generate_batch(["a", "b"], [SamplingParams()]), ValueError, "for 2 prompts"
    ),
    "no prompts": Api(lambda paths, decoder: decoder.generate_batch([]), ValueError, "non-empty list of prompts"),
    "prompts a string": Api(lambda paths, decoder: decoder.generate_batch("ab"), ValueError, "non-empty list"),
    "draft length superscript": Api(generate("x", num_draft_tokens="²"), ValueError, "got '²'"),
    "draft length negative": Api(generate("x", num_draft_tokens=-1), ValueError, "integer >= 0 or 'auto'"),
    "draft length a bool": Api(generate("x", num_draft_tokens=True), ValueError, "got True"),
    "draft length a float": Api(generate("x", num_draft_tokens=1.5), ValueError, "got 1.5"),
    # opening models
    "max_context -5": Api(
        lambda paths, decoder: SpeculativeDecoder.from_pretrained(paths.target, max_context=-5),
        ValueError,
        "max_context must be an integer >= 1, got -5",
    ),
    "max_context a string": Api(
        lambda paths, decoder: SpeculativeDecoder.from_pretrained(paths.target, max_context="64"),
        TypeError,
        "max_context must be an integer",
    ),
    "from_pretrained draft length": Api(
        lambda paths, decoder: SpeculativeDecoder.from_pretrained(paths.target, num_draft_tokens="²"),
        ValueError,
        "num_draft_tokens must be",
    ),
    "from_pretrained device": Api(
        lambda paths, decoder: SpeculativeDecoder.from_pretrained(paths.target, device="tpu9"),
        ValueError,
        "is not a torch device",
    ),
    "from_pretrained missing": Api(
        lambda paths, decoder: SpeculativeDecoder.from_pretrained(paths.tmp / "no"), ValueError, "does not exist"
    ),
    "confidence threshold": Api(
        lambda paths, decoder: SpeculativeDecoder.from_pretrained(paths.target, draft_confidence_threshold=2),
        ValueError,
        "draft_confidence_threshold must be in [0, 1]",
    ),
    "from_engines threads many": Api(
        lambda paths, decoder: SpeculativeDecoder.from_engines(paths.engines, threads=int(MANY_THREADS)),
        ValueError,
        "CPU cores here, which cannot help",
    ),
    "from_engines threads a string": Api(
        lambda paths, decoder: SpeculativeDecoder.from_engines(paths.engines, threads="2"),
        TypeError,
        "threads must be an integer",
    ),
    "from_engines not an engine directory": Api(
        lambda paths, decoder: SpeculativeDecoder.from_engines(paths.tmp), ValueError, "is not an engine directory"
    ),
    "from_engines manifest not UTF-8": Api(
        lambda paths, decoder: SpeculativeDecoder.from_engines(paths.tmp / "broken"),
        ValueError,
        "is not UTF-8 text",
        setup=broken_engines(raw=b"\x80"),
    ),
    "from_engines draft length": Api(
        lambda paths, decoder: generate_on_engines(paths.engines, 9), ValueError, "exceeds the 4 drafts"
    ),
    "build onto a file": Api(
        lambda paths, decoder: build(BuildRequest(out=paths.tmp / "out", target=paths.target)),
        ValueError,
        "is a file, not a directory",
        setup=write("out", "mine"),
        kept=("{tmp}/out",),
    ),
    "build --force onto a user directory": Api(
        lambda paths, decoder: build(BuildRequest(out=paths.tmp / "out", target=paths.target, force=True)),
        ValueError,
        "holds no manifest.json",
        setup=user_directory("out"),
        absent=NO_BUILD_DEBRIS,
        kept=(f"{{tmp}}/out/{USER_FILE}",),
    ),
}


@pytest.fixture(scope="module")
def paths(make_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Paths:
    target_kwargs = {"family": "llama", **SIZE}
    target = make_checkpoint(**target_kwargs)
    engines = tmp_path_factory.mktemp("bad-input") / "engines"
    build(BuildRequest(out=engines, target=target, draft="int4", max_draft_len=MAX_DRAFT_LEN, max_context=MAX_CONTEXT))
    return Paths(
        tmp=Path("unused"),
        target=target,
        wider=make_checkpoint(vocab_size=40, **target_kwargs),
        head_dim_12=make_checkpoint(family="qwen3", hidden_size=64),
        no_tokenizer=make_checkpoint(with_tokenizer=False, **target_kwargs),
        engines=engines,
    )


@pytest.fixture(scope="module")
def decoder(paths: Paths) -> SpeculativeDecoder:
    decoder = SpeculativeDecoder.from_pretrained(paths.target, "ngram")
    yield decoder
    decoder.close()


@pytest.fixture
def row_paths(paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Paths:
    """The shared models with this row's own directory; the default engines' cache is kept empty."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return Paths(**{**paths.__dict__, "tmp": tmp_path})


def check_disk(paths: Paths, absent: tuple[str, ...], kept: tuple[str, ...]) -> None:
    for path in absent:
        assert not Path(paths.format(path)).exists(), f"{paths.format(path)} was left behind"
    for path in kept:
        assert Path(paths.format(path)).exists(), f"{paths.format(path)} was deleted"
    user_files = list(paths.tmp.rglob(USER_FILE))
    assert all(f.read_text() == "mine" for f in user_files)


@pytest.mark.parametrize("name", CLI_ROWS)
def test_command_line(name: str, row_paths: Paths) -> None:
    row = CLI_ROWS[name]
    if row.setup is not None:
        row.setup(row_paths)
    args = [row_paths.format(arg) for arg in row.args]
    result = CliRunner().invoke(row.command, args, input=row.stdin)
    assert isinstance(result.exception, SystemExit), f"{type(result.exception).__name__}: {result.exception}"
    assert result.exit_code == row.status, result.output
    assert "Traceback" not in result.output, result.output
    if row.status == 1:
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and result.stderr.endswith(errors[0] + "\n"), result.stderr
    assert row_paths.format(row.message) in " ".join(result.stderr.split()), result.stderr
    check_disk(row_paths, row.absent, row.kept)


@pytest.mark.parametrize("name", API_ROWS)
def test_python_api(name: str, row_paths: Paths, decoder: SpeculativeDecoder) -> None:
    row = API_ROWS[name]
    if row.setup is not None:
        row.setup(row_paths)
    with pytest.raises(row.error) as caught:
        row.call(row_paths, decoder)
    error = caught.value
    assert type(error).__module__.startswith("specdec_trt"), f"{type(error)} is not one of our errors"
    assert row_paths.format(row.message) in str(error) and "\n" not in str(error)
    check_disk(row_paths, row.absent, row.kept)


def test_the_table_is_large_enough() -> None:
    assert len(CLI_ROWS) + len(API_ROWS) >= 100


def test_the_decoder_still_answers_after_the_bad_calls(decoder: SpeculativeDecoder) -> None:
    """Every bad call above was refused before it touched the scheduler: the shared decoder still serves."""
    output = decoder.generate("hello", SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(output.token_ids) == 4


# --- escapes in prompts and stop strings ------------------------------------------------------------------


def test_stop_and_prompt_escapes_are_interpreted_unless_no_escape(paths: Paths) -> None:
    r"""``--stop "\xHH"`` names the character HH, as the README's ``--stop "\n\n"`` names a blank line; the
    prompt's escapes are interpreted too; ``--no-escape`` takes both literally."""
    common = ["--target", str(paths.target), "--draft", "none", "-n", "12", "--json"]
    full = json.loads(CliRunner().invoke(run, [*common, "ab"]).stdout)["text"]
    cut = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # the first fresh character
    stop = "\\n" if full[cut] == "\n" else f"\\x{ord(full[cut]):02x}"
    stopped = json.loads(CliRunner().invoke(run, [*common, "--stop", stop, "ab"]).stdout)
    assert stopped["text"] == full[:cut] and stopped["finish_reason"] == "stop"
    literal = json.loads(CliRunner().invoke(run, [*common, "--no-escape", "--stop", stop, "ab"]).stdout)
    assert literal["text"] == full
    escaped_prompt = json.loads(CliRunner().invoke(run, [*common, "a\\x62"]).stdout)
    assert escaped_prompt["text"] == full
    literal_prompt = json.loads(CliRunner().invoke(run, [*common, "--no-escape", "a\\x62"]).stdout)
    assert literal_prompt["stats"]["prompt_tokens"] == len("a\\x62")


# --- tracebacks on request -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--debug", "SPECDEC_DEBUG=1"])
def test_debug_shows_the_traceback(how: str, tmp_path: Path) -> None:
    executable = Path(sys.executable).parent / "specdec-run"
    args = [str(executable), "--engines", str(tmp_path), "x"]
    environment = dict(os.environ)
    if how == "--debug":
        args.insert(1, how)
    else:
        environment["SPECDEC_DEBUG"] = "1"
    completed = subprocess.run(args, capture_output=True, text=True, timeout=120, env=environment)
    assert completed.returncode == 1
    assert "Traceback" in completed.stderr and "EngineDirectoryError" in completed.stderr
    plain = subprocess.run(args[:1] + args[-3:], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert plain.stderr.startswith("Error: ") and "is not an engine directory" in plain.stderr


# --- concurrent builds and signals ------------------------------------------------------------------------


def console(name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    executable = Path(sys.executable).parent / name
    return subprocess.Popen(
        [str(executable), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_for_line(stream, fragment: str) -> str:
    """Read ``stream`` until a line holding ``fragment``; everything read so far."""
    seen = ""
    for line in stream:
        seen += line
        if fragment in line:
            return seen
    raise AssertionError(f"{fragment!r} never appeared in:\n{seen}")


def assert_no_build_debris(out: Path) -> None:
    assert not out.with_name(out.name + ".partial").exists()
    assert not lock_path(out).exists()


@pytest.mark.slow
def test_two_builds_into_one_out_one_builds_the_other_refuses(paths: Paths, tmp_path: Path) -> None:
    """Started together: one writes the directory, the other (waiting, or arriving after it) refuses
    clearly; the directory is the first one's, whole."""
    out = tmp_path / "out"
    args = ("--target", str(paths.target), "--max-draft-len", "2", "--max-context", "32", "--out", str(out))
    processes = [console("specdec-build", *args) for _ in range(2)]
    finished = [(process.wait(timeout=300), process.stderr.read()) for process in processes]
    codes = sorted(code for code, _ in finished)
    assert codes == [0, 1], finished
    refused = next(stderr for code, stderr in finished if code == 1)
    assert "exists and is not empty" in " ".join(refused.split()) and "Traceback" not in refused
    SpeculativeDecoder.from_engines(out).close()  # checksums and all
    assert_no_build_debris(out)


@pytest.mark.slow
def test_a_build_waits_for_the_one_in_progress(paths: Paths, tmp_path: Path) -> None:
    """While another build holds the directory, specdec-build says it is waiting; when that build has
    written the directory, it refuses to overwrite it."""
    out = tmp_path / "out"
    args = ("--target", str(paths.target), "--max-draft-len", "2", "--max-context", "32", "--out", str(out))
    with build_lock(out):
        process = console("specdec-build", *args)
        wait_for_line(process.stderr, "waiting for it to finish")
        build(BuildRequest(out=out, target=paths.target, draft="none", max_draft_len=2, max_context=32))
    code, stderr = process.wait(timeout=300), " ".join(process.stderr.read().split())
    assert code == 1 and "another build wrote" in stderr and "exists and is not empty" in stderr, stderr
    assert read_kind(out) == "none", "the waiting build must not replace the finished one"
    assert_no_build_debris(out)


def read_kind(directory: Path) -> str:
    return json.loads((directory / MANIFEST_NAME).read_text())["draft_kind"]


@pytest.mark.slow
def test_two_first_runs_on_an_empty_cache_build_the_default_engines_once(paths: Paths, tmp_path: Path) -> None:
    """The second specdec-run on an empty cache waits for the first one's build of the default engines,
    then runs on them without building again (the build is played here by copying finished engines in)."""
    environment = {**os.environ, "SPECDEC_CACHE": str(tmp_path)}
    directory = tmp_path / "engines" / "smollm2-135m"
    with build_lock(directory):
        process = console("specdec-run", "-n", "4", "--json", "hello", env=environment)
        wait_for_line(process.stderr, "is building the default engines")
        shutil.copytree(paths.engines, directory)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "Building" not in stderr
    assert json.loads(stdout)["stats"]["generated_tokens"] > 0
    assert_no_build_debris(directory)


def test_a_corrupt_default_engine_is_rebuilt_with_a_message(
    paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default engines whose weights no longer match their checksums are rebuilt, saying why (the preset
    points at the tiny target here, so that the rebuild takes seconds)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    directory = default_engine_dir()
    shutil.copytree(paths.engines, directory)
    weights = directory / "target" / "model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    built = json.loads((directory / MANIFEST_NAME).read_text())["target"]
    preset = {"target": paths.target, "draft": "int4", "dtype": "float32"}
    preset |= {"max_draft_len": built["max_draft_len"], "max_context": built["max_context"]}
    monkeypatch.setitem(PRESETS, "smollm2-135m", preset)
    result = CliRunner().invoke(run, ["-n", "4", "--json", "hello"])
    assert result.exit_code == 0, result.output
    message = " ".join(result.stderr.split())
    assert "Building the default engines" in message and "does not match its sha256" in message, message
    assert json.loads(result.stdout)["stats"]["generated_tokens"] > 0


def test_default_engines_built_for_another_context_are_rebuilt(
    paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cached default engines built with another context than the preset's (an older release's) are rebuilt,
    saying why."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    directory = default_engine_dir()
    shutil.copytree(paths.engines, directory)
    built = json.loads((directory / MANIFEST_NAME).read_text())["target"]
    preset = {"target": paths.target, "draft": "int4", "max_draft_len": built["max_draft_len"], "dtype": "float32"}
    monkeypatch.setitem(PRESETS, "smollm2-135m", preset | {"max_context": built["max_context"] // 2})
    result = CliRunner().invoke(run, ["-n", "4", "--json", "hello"])
    assert result.exit_code == 0, result.output
    message = " ".join(result.stderr.split())
    assert f"have max_context {built['max_context']}, the smollm2-135m preset {built['max_context'] // 2}" in message
    assert json.loads((directory / MANIFEST_NAME).read_text())["target"]["max_context"] == built["max_context"] // 2


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_build_leaves_nothing(sig: signal.Signals, paths: Paths, tmp_path: Path) -> None:
    """SIGTERM (as Ctrl-C) mid-build removes the staging directory and the lock, and writes no --out. The
    build pauses as the draft's stage starts, so the signal cannot arrive after a quick build has finished."""
    out = tmp_path / "out"
    request = BuildRequest(out=out, target=paths.target, draft="int4", max_context=MAX_CONTEXT)
    process = start_build(request, pause_at="export draft")
    wait_for_line(process.stdout, "export draft")
    assert out.with_name("out.partial").is_dir(), "the target's graph should be staged by now"
    process.send_signal(sig)
    process.communicate(timeout=120)
    assert process.returncode != 0
    assert not out.exists()
    assert_no_build_debris(out)


@pytest.mark.slow
def test_a_stale_partial_directory_is_removed_by_the_next_build(paths: Paths, tmp_path: Path) -> None:
    """A build killed outright leaves its staging directory; the next build of that --out removes it."""
    out = tmp_path / "out"
    request = BuildRequest(out=out, target=paths.target, draft="int4", max_context=MAX_CONTEXT)
    process = start_build(request, pause_at="export draft")  # killed mid-build, however quick the build
    wait_for_line(process.stdout, "export draft")
    process.kill()
    process.communicate(timeout=120)
    assert out.with_name("out.partial").is_dir()
    build(request)
    assert (out / MANIFEST_NAME).is_file()
    assert_no_build_debris(out)


def test_the_lock_admits_one_thread_at_a_time(tmp_path: Path) -> None:
    """Threads of one process take turns too (each holds its own descriptor), and the lock file goes with
    the last holder."""
    out, inside, overlaps = tmp_path / "out", [], []

    def hold() -> None:
        with build_lock(out):
            inside.append(1)
            overlaps.append(len(inside))
            threading.Event().wait(0.05)
            inside.pop()

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [1, 1, 1, 1]
    assert not lock_path(out).exists()
