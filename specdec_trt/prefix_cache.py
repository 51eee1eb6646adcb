"""Prefix caching: a finished request's slot keeps its keys and values for the next request that shares a prefix.

When a request ends, its slot stays occupied in the engines, idle, with the tokens its target cache holds. A new
request goes where the longest prefix of its prompt (token ids, after the chat template) is cached:

- an idle slot, rolled back to the common prefix by its length pointer (nothing is copied), when the request
  keeps at least half of what the slot holds, or when no empty slot is free;
- otherwise an empty slot (or, with none free, the least recently used idle slot, whose cache is dropped), into
  which the prefix's rows of keys and values are copied from the slot holding them: an idle slot whose longer
  cache stays for later, or a busy one serving another request. A copy is a memory copy of the rows, far
  cheaper than the forward pass that prefilling them takes, so any shared prefix is copied.

At most the prompt's length minus one token is reused: the request's first token needs the logits after its last
prompt token, so at least that token is prefilled. Slots are chosen as llama-server chooses by prompt similarity,
but at token granularity and with copies from busy slots (vLLM and SGLang share blocks of a paged cache instead;
our caches are one contiguous row per slot, so a shared prefix is copied rather than pointed to).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

EmptySlot = Callable[[bool], "int | None"]
"""A slot free in every engine, or None; given True, the caches grow to make one (within their bound)."""


@dataclass(frozen=True)
class Placement:
    """Where a request goes: its ``slot``, the ``cached`` prompt tokens it finds there (its prefill starts after
    them), and the slot they are copied from (``source``; None: they are already in ``slot``)."""

    slot: int
    cached: int
    source: int | None = None


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """The idle slots and their cached tokens, least recently used first, and where each new request goes
    (see the module docstring). ``enabled=False`` keeps nothing: every request starts in an empty slot."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._idle: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def idle_slots(self) -> list[int]:
        """The idle slots, least recently used first."""
        return list(self._idle)

    def cached_tokens(self, slot: int) -> np.ndarray:
        """The tokens idle ``slot`` holds."""
        return self._idle[slot]

    def park(self, slot: int, tokens: Sequence[int]) -> None:
        """Keep ``slot``, whose request has ended, with the ``tokens`` its target cache holds."""
        self._idle[slot] = np.asarray(tokens, dtype=np.int64)
        self._idle.move_to_end(slot)

    def clear(self) -> list[int]:
        """Forget every idle slot; returns them (their caches are the caller's to release)."""
        slots = list(self._idle)
        self._idle.clear()
        return slots

    def forget_unless(self, holds: Callable[[int, int], bool]) -> None:
        """Forget the idle slots for which ``holds(slot, cached tokens)`` is False (a direct use of the engines
        released or refilled them)."""
        for slot in [s for s, tokens in self._idle.items() if not holds(s, len(tokens))]:
            del self._idle[slot]

    def place(
        self, prompt: Sequence[int], busy: Callable[[], Mapping[int, Sequence[int]]], empty_slot: EmptySlot
    ) -> Placement:
        """Where a request with ``prompt`` goes, given the tokens the target holds in each busy slot (``busy()``,
        asked only where no idle slot holds the whole prompt); the slot it gets is no longer idle."""
        if not self.enabled:
            return Placement(self._empty_or_evicted(empty_slot), 0)
        wanted = np.asarray(prompt, dtype=np.int64)[:-1]  # the last prompt token is always prefilled
        idle_slot, idle_cached = self._longest(wanted, reversed(self._idle.items()))  # most recently used first
        busy_slot, busy_cached = None, 0
        if idle_cached < len(wanted):
            busy_slot, busy_cached = self._longest(wanted, busy().items())
        if idle_slot is not None and idle_cached >= busy_cached:
            keeps_most = 2 * idle_cached >= len(self._idle[idle_slot])
            empty = None if keeps_most else empty_slot(False)
            if empty is None:
                del self._idle[idle_slot]
                return Placement(idle_slot, idle_cached)
            return Placement(empty, idle_cached, idle_slot)
        slot = self._empty_or_evicted(empty_slot)
        return Placement(slot, busy_cached, busy_slot) if busy_slot is not None else Placement(slot, 0)

    def _empty_or_evicted(self, empty_slot: EmptySlot) -> int:
        """An empty slot; with none free, the least recently used idle slot; with none idle, a new one."""
        slot = empty_slot(False)
        if slot is None and self._idle:
            slot, _ = self._idle.popitem(last=False)
        return slot if slot is not None else empty_slot(True)

    @staticmethod
    def _longest(wanted: np.ndarray, held: Iterable[tuple[int, Sequence[int]]]) -> tuple[int | None, int]:
        """The first slot of ``held`` (slot, tokens) sharing the longest prefix with ``wanted``, and that prefix's
        length; (None, 0) when none shares a token. The search ends at a slot holding all of ``wanted``."""
        best, longest = None, 0
        for slot, tokens in held:
            if not len(wanted) or not len(tokens) or tokens[0] != wanted[0]:
                continue
            shared = common_prefix(wanted, np.asarray(tokens, dtype=np.int64))
            if shared > longest:
                best, longest = slot, shared
                if shared == len(wanted):
                    break
        return best, longest
