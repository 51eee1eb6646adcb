"""Copies between the host and a CUDA device that queue behind the device's work instead of waiting for it.

A copy from pageable host memory, or into it, makes the host wait until the device has run everything queued
before it: on a GPU each such copy stalls the loop. Through pinned (page-locked) memory the copy is queued
like a kernel. PyTorch's pinned-memory cache keeps a pinned block alive until the copies that use it have
run, so a temporary pinned tensor is safe to drop at once. On the CPU these are plain copies.
``count_host_syncs`` checks that a piece of code keeps to this.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor bound for a CUDA device is copied through pinned memory."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def copy_into(destination: torch.Tensor, source: torch.Tensor) -> None:
    """``destination[...] = source``, queued (through pinned memory) when a host source goes to a CUDA device."""
    if destination.device.type == "cuda" and source.device.type == "cpu":
        source = source.pin_memory()
    destination.copy_(source, non_blocking=True)


class HostCopy:
    """A host copy of a tensor, queued behind the device's work when the tensor is on a CUDA device: ``get``
    waits only if the copy has not run yet (after the host's next synchronisation with the device, it has)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def get(self) -> torch.Tensor:
        """The copy on the host."""
        if self._done is not None and not self._done.query():
            self._done.synchronize()
        return self._host


def count_host_syncs(function: Callable[[], T]) -> tuple[int, T]:
    """(synchronising CUDA calls that ``function()`` made, its result), counted from the warnings of CUDA's sync
    debug mode: device-to-host reads, pageable host-to-device copies, stream and device synchronisations."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = function()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), result
