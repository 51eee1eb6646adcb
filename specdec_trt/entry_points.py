"""The console scripts that decode. Each restarts once so that glibc gives the weights huge pages
(``specdec_trt.huge_pages``), before it imports anything heavy, then runs its command."""

from __future__ import annotations

from specdec_trt.huge_pages import restart_with_huge_pages


def run() -> None:
    restart_with_huge_pages()
    from specdec_trt.cli import run as command

    command()


def serve() -> None:
    restart_with_huge_pages()
    from specdec_trt.serve.cli import serve as command

    command()


def bench() -> None:
    restart_with_huge_pages()
    from specdec_trt.bench.cli import bench as command

    command()
