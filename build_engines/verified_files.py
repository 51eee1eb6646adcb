"""Engine files whose sha256 was checked, remembered by their identity on disk (device, inode, size, modification
and change times), so that opening the same engines again skips re-reading hundreds of megabytes. A file
written, replaced, moved in or touched since has another identity and is read and checked again. Kept in the
cache directory the caller names, not beside the engines: a copied directory is checked afresh."""

from __future__ import annotations

import json
import os
from pathlib import Path


def identity(path: Path) -> list[int]:
    """What changes whenever the file's content can have: device, inode, size, modification and change times."""
    stat = path.stat()
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


class VerifiedFiles:
    """The record of checked files at ``path`` (unreadable or absent: an empty one)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._files: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._files = {}
        if not isinstance(self._files, dict):
            self._files = {}
        self._added = False

    def holds(self, path: Path, sha256: str) -> bool:
        """Whether ``path`` was found to have ``sha256`` and is, by its identity, the same file still."""
        known = self._files.get(str(path.resolve()))
        return isinstance(known, dict) and known.get("sha256") == sha256 and known.get("identity") == identity(path)

    def add(self, path: Path, sha256: str) -> None:
        self._files[str(path.resolve())] = {"sha256": sha256, "identity": identity(path)}
        self._added = True

    def save(self) -> None:
        """Write the record if anything was added (atomically; a cache that cannot be written is left alone: the
        files are then checked again next time)."""
        if not self._added:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(self._files))
            os.replace(partial, self.path)
        except OSError:
            pass
