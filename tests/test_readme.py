"""Every command the user guide shows exists as written: the README's and docs' bash blocks name only our
console scripts and scripts that exist, with options those commands take (checked against each one's
``--help``, run as the user would run it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [
    ROOT / "README.md",
    ROOT / "scripts" / "README.md",
    *(ROOT / "docs" / name for name in ("GUIDE.md", "SERVING.md", "GPU.md")),
]
CONSOLE_SCRIPTS = ("specdec-run", "specdec-build", "specdec-bench", "specdec-distill", "specdec-serve")
BIN = Path(sys.executable).parent


def bash_commands(path: Path) -> list[str]:
    """The commands of a markdown file's bash blocks: one per line (continuations joined, comments dropped),
    each ``&&``-joined part on its own."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            part: list[str] = []
            for token in [*tokens, "&&"]:
                if token in ("&&", "|", ";"):
                    if part:
                        commands.append(shlex.join(part))
                    part = []
                else:
                    part.append(token)
    return commands


def ours(command: str) -> list[str] | None:
    """``command`` as argv when it runs one of our programs (a console script, a script in scripts/), else None."""
    argv = shlex.split(command)
    while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):  # leading environment assignments
        argv = argv[1:]
    if not argv:
        return None
    program = Path(argv[0]).name
    if program in CONSOLE_SCRIPTS:
        return [program, *argv[1:]]
    if program in ("python", "python3") and len(argv) > 1 and argv[1].startswith("scripts/"):
        return argv[1:]
    if program == "bash" and len(argv) > 1 and argv[1].startswith("scripts/"):
        return argv[1:]
    return None


@cache
def help_text(program: str) -> str:
    """What ``program --help`` prints: a console script beside this interpreter, or a Python script."""
    if program.endswith(".py"):
        argv = [sys.executable, str(ROOT / program), "--help"]
    else:
        argv = [str(BIN / program), "--help"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, f"{program} --help failed: {result.stderr[-500:]}"
    return result.stdout


def guide_commands() -> list[tuple[str, str]]:
    found = []
    for path in GUIDES:
        if path.is_file():
            found += [(path.relative_to(ROOT).as_posix(), c) for c in bash_commands(path) if ours(c) is not None]
    return found


def test_the_readme_starts_with_the_two_commands() -> None:
    first_screen = (ROOT / "README.md").read_text().split("\n## ")[0]
    commands = bash_commands(ROOT / "README.md")[:4]
    assert commands[:2] == [
        "bash scripts/install.sh",
        ".venv/bin/specdec-run --chat 'What is the capital of France? Answer in one sentence.'",
    ]
    assert commands[2:4] == ["bash scripts/install.sh dev", ".venv/bin/python -m pytest -n 2 --dist worksteal"]
    assert first_screen.count("```bash") == 1


def test_the_guides_show_commands() -> None:
    assert len(guide_commands()) >= 20


@pytest.mark.slow
@pytest.mark.parametrize(("guide", "command"), guide_commands())
def test_every_command_exists_with_its_options(guide: str, command: str) -> None:
    argv = ours(command)
    program = argv[0]
    if program.endswith(".sh"):
        assert (ROOT / program).is_file(), f"{guide}: {program} does not exist"
        return
    if program.endswith(".py"):
        assert (ROOT / program).is_file(), f"{guide}: {program} does not exist"
    text = help_text(program)
    for token in argv[1:]:
        if token.startswith("--"):
            option = token.split("=")[0]
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), f"{guide}: {program} has no {option}"
