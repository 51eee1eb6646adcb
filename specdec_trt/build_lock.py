"""One build at a time per output directory, across processes: an exclusive ``fcntl`` lock on
``<out>.lock``, a file beside the output that lives only while someone holds or waits for it."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_held: dict[Path, int] = {}  # lock files this process holds -> the holding thread


def lock_path(out: Path) -> Path:
    """The lock file of output directory ``out``."""
    return out.with_name(out.name + ".lock")


@contextmanager
def build_lock(out: Path, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold the lock of ``out`` for the body; ``on_wait`` is called once if another holder makes us wait.
    A thread that holds it already enters at once (the default engines lock around their build).

    The holder removes the lock file on release; a waiter that then wins the lock of the removed file
    takes it again on a fresh one, so two processes never both hold ``out``."""
    path = lock_path(out).absolute()
    if _held.get(path) == threading.get_ident():
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, on_wait)
    _held[path] = threading.get_ident()
    try:
        yield
    finally:
        del _held[path]
        path.unlink(missing_ok=True)
        os.close(fd)


def _acquire(path: Path, on_wait: Callable[[], None]) -> int:
    """A descriptor of the lock file at ``path``, holding its exclusive lock."""
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waited:
                    on_wait()
                    waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if _is_current(fd, path):
            return fd
        os.close(fd)


def _is_current(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not one its last holder removed)."""
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False
