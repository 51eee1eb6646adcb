"""Weights in transparent huge pages: the commands that decode restart once with glibc's malloc asking for them.

A decode step streams every weight once, and with 4 KB pages it walks over a hundred thousand of them a token: the
TLB misses are a measurable share of the step (docs/DECISIONS.md). ONNX Runtime allocates its (prepacked)
weights with malloc, and glibc's malloc asks the kernel for transparent huge pages only under the tunable
``glibc.malloc.hugetlb=1``, which glibc reads when a process starts. So ``specdec-run``, ``specdec-serve`` and
``specdec-bench`` re-execute themselves once with it where the kernel gives huge pages on request (THP mode
"madvise"); a program embedding the runtime sets ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` itself.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
OPT_OUT = "SPECDEC_NO_HUGE_PAGES"  # set (to anything) to keep the process as it started


def wants_restart(environ: dict[str, str], thp_mode: str, libc: str) -> bool:
    """Whether a process with ``environ`` should restart with the tunable: glibc, the kernel's THP mode
    "madvise" (under "always" every large allocation gets them already, under "never" none can), and neither
    the tunable nor the opt-out set."""
    return (
        libc == "glibc"
        and "[madvise]" in thp_mode
        and "glibc.malloc.hugetlb" not in environ.get("GLIBC_TUNABLES", "")
        and OPT_OUT not in environ
    )


def restart_with_huge_pages() -> None:
    """Re-execute this process, same interpreter and arguments, with the tunable added, when ``wants_restart``."""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return  # no THP on this system
    if not wants_restart(dict(os.environ), mode, platform.libc_ver()[0]):
        return
    environ = dict(os.environ)
    environ["GLIBC_TUNABLES"] = ":".join(filter(None, [environ.get("GLIBC_TUNABLES", ""), TUNABLE]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)
