"""The decoding commands restart once with glibc's malloc asking for transparent huge pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdec_trt.huge_pages import OPT_OUT, THP_MODE, TUNABLE, wants_restart

MADVISE = "always [madvise] never\n"


@pytest.mark.parametrize(
    ("environ", "mode", "libc", "expected"),
    [
        ({}, MADVISE, "glibc", True),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, MADVISE, "glibc", True),  # added beside the others
        ({"GLIBC_TUNABLES": TUNABLE}, MADVISE, "glibc", False),  # restarted already: once only
        ({OPT_OUT: "1"}, MADVISE, "glibc", False),
        ({}, "[always] madvise never\n", "glibc", False),  # every large allocation has them already
        ({}, "always madvise [never]\n", "glibc", False),
        ({}, MADVISE, "", False),  # musl and others know no such tunable
    ],
)
def test_a_process_restarts_only_where_it_gains_huge_pages(environ, mode, libc, expected) -> None:
    assert wants_restart(environ, mode, libc) is expected


CHILD = (
    "import os, sys; from specdec_trt.huge_pages import restart_with_huge_pages; "
    "print('started', flush=True); restart_with_huge_pages(); print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])"
)


@pytest.mark.skipif(
    not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(), reason="needs THP in madvise mode"
)
def test_the_restart_keeps_the_arguments_and_happens_once() -> None:
    """A real process: it starts twice (the restart), then runs with the tunable and its own arguments."""
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, "--flag", "value"], capture_output=True, text=True, env=environ, check=True
    )
    assert result.stdout.splitlines() == ["started", "started", f"{TUNABLE} ['--flag', 'value']"]
    opted_out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=environ | {OPT_OUT: "1"}, check=True
    )
    assert opted_out.stdout.splitlines() == ["started", "None []"]
