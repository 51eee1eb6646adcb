"""The Engine protocol: one model with its own KV cache for a number of slots, each holding one sequence.

The decoder and the scheduler talk to engines through this protocol only, so the backends (ONNX Runtime,
PyTorch) are interchangeable. A request is admitted into a free slot and prefilled there while the other
slots keep their caches; a step runs over any set of occupied slots, each with its own number of new tokens;
a rejection rolls a slot back by moving its length pointer; a finished request releases its slot.

``Engine`` keeps the bookkeeping both backends share. The occupied slots always fill the cache's first
rows (a release moves the last row into the hole), and a step runs over one contiguous range of rows: the
rows of the slots it names, brought together by swapping rows in the rare case that they are not. Steps
therefore cost what the occupied rows cost, never what the capacity would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch


class ContextOverflowError(ValueError):
    """A request would write past the engine's maximum context."""


class Engine(ABC):
    """What the decoder needs from a backend. Token ids go in on the host; logits come back as float32
    tensors on ``device``. Slot ids run from 0 to ``num_slots - 1``."""

    vocab_size: int
    max_context: int
    max_draft_len: int | None  # most drafts one verify pass was built for (None: no limit)
    device: torch.device
    # Whether a pass computes only its rows' real tokens (packed), or every row padded to the widest: what a
    # row's drafts cost beside rows that draft fewer.
    packs_rows: bool = False

    def __init__(self) -> None:
        self._lengths = np.zeros(0, dtype=np.int64)  # per slot: cached tokens (0 when free)
        self._row_of: dict[int, int] = {}  # occupied slot -> cache row
        self._slot_at: list[int] = []  # cache row -> occupied slot, rows 0 .. occupied - 1

    # --- the protocol ------------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Slots the cache holds."""
        return len(self._lengths)

    @property
    def lengths(self) -> torch.Tensor:
        """Cached tokens per slot, int64 [num_slots] on the host (0 for a free slot)."""
        return torch.from_numpy(self._lengths.copy())

    def occupied(self, slot: int) -> bool:
        return slot in self._row_of

    def length(self, slot: int) -> int:
        """Cached tokens of ``slot`` (0 when free)."""
        return int(self._lengths[slot])

    @property
    @abstractmethod
    def slot_cache_bytes(self) -> int:
        """Bytes of keys and values one slot holds at the full context (every slot's row is that size)."""

    def reserve(self, num_slots: int) -> None:
        """Hold at least ``num_slots`` slots, keeping every cached row (the cache is reallocated to grow)."""
        if num_slots > self.num_slots:
            self._resize(num_slots, len(self._slot_at), int(self._lengths.max(initial=0)))
            self._lengths = np.concatenate([self._lengths, np.zeros(num_slots - self.num_slots, dtype=np.int64)])

    def admit(self, slot: int) -> None:
        """Start an empty sequence in free ``slot`` (its prompt goes in through ``step``)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside the engine's {self.num_slots} slots: reserve more")
        if slot in self._row_of:
            raise ValueError(f"slot {slot} is occupied: release it first")
        self._row_of[slot] = len(self._slot_at)
        self._slot_at.append(slot)
        self._lengths[slot] = 0

    def release(self, slot: int) -> None:
        """Free ``slot``; the last occupied row moves into its row, so occupied rows stay contiguous."""
        row = self._row_of.pop(self._check_occupied([slot])[0])
        last = self._slot_at.pop()
        if last != slot:
            self._move_row(len(self._slot_at), row, int(self._lengths[last]))
            self._slot_at[row] = last
            self._row_of[last] = row
        self._lengths[slot] = 0

    def step(
        self,
        slots: Sequence[int],
        token_ids: torch.Tensor,
        num_new: Sequence[int] | None = None,
        logits_from: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append the first ``num_new[i]`` tokens of row i of ``token_ids`` [n, T] (default: all T; the rest is
        padding) after the cached tokens of ``slots[i]``. Returns logits [n, K, V] of row i's new tokens from
        index ``logits_from[i]`` on (default 0: all of them), K the most any row returns; a row's logits past
        its own are 0. A prefill needs only its last token's (``num_new[i] - 1``), a verify pass every token's:
        one pass can hold both, and computes no logits that were not asked for."""
        slots = self._check_occupied(slots)
        width = token_ids.shape[1]
        new = np.full(len(slots), width, dtype=np.int64) if num_new is None else np.asarray(num_new, np.int64)
        if new.shape != (len(slots),) or bool((new < 1).any()) or bool((new > width).any()):
            raise ValueError(f"num_new {new.tolist()} must give each of {len(slots)} rows 1 to {width} tokens")
        first = np.zeros(len(slots), dtype=np.int64) if logits_from is None else np.asarray(logits_from, np.int64)
        if first.shape != (len(slots),) or bool((first < 0).any()) or bool((first >= new).any()):
            raise ValueError(f"logits_from {first.tolist()} must be an index into each row's {new.tolist()} tokens")
        starts = self._lengths[slots]
        check_room(starts + new, 0, self.max_context)
        if int(starts.max()) + width <= self.max_context:
            logits = self._pass(slots, token_ids, new, first)
        else:  # some row has no room for the padding: each row alone, at its own width
            parts = [
                self._pass([s], token_ids[i : i + 1, : new[i]], new[i : i + 1], first[i : i + 1])
                for i, s in enumerate(slots)
            ]
            most = int((new - first).max())
            logits = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, most - p.shape[1])) for p in parts])
        self._lengths[slots] += new
        return logits

    def _pass(self, slots: list[int], token_ids: torch.Tensor, new: np.ndarray, first: np.ndarray) -> torch.Tensor:
        """One backend pass over ``slots``, in the order their rows have in the cache."""
        lo = self._gather(slots)
        order = np.argsort([self._row_of[s] for s in slots], kind="stable")
        if (order == np.arange(len(order))).all():  # already in the cache's order: nothing to permute
            return self._run(lo, token_ids, self._lengths[slots], new, first)
        inverse = torch.from_numpy(np.argsort(order, kind="stable"))
        reordered = token_ids[torch.from_numpy(order).to(token_ids.device)]
        logits = self._run(lo, reordered, self._lengths[slots][order], new[order], first[order])
        return logits[inverse.to(logits.device)]

    def truncate(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Roll each of ``slots`` back to ``lengths`` cached tokens (never forward); nothing is copied."""
        slots = self._check_occupied(slots)
        new = np.asarray(lengths, dtype=np.int64)
        if new.shape != (len(slots),) or bool((new < 0).any()) or bool((new > self._lengths[slots]).any()):
            cached = self._lengths[slots].tolist()
            raise ValueError(f"truncate to {new.tolist()} is outside the cached lengths {cached}")
        self._lengths[slots] = new

    def copy_from(self, source: Engine, slot: int, stop: int, source_slot: int | None = None) -> None:
        """Extend ``slot`` to ``stop`` tokens with the keys and values of ``source_slot`` (default: the same
        slot) of ``source``, an engine with this one's cache layout that holds them: how a self-draft (the
        target quantized) catches up with tokens the target has processed, without a pass of its own."""
        (slot,) = self._check_occupied([slot])
        source_slot = slot if source_slot is None else source_slot
        (source_slot,) = source._check_occupied([source_slot])
        start = int(self._lengths[slot])
        if not start <= stop <= source._lengths[source_slot]:
            raise ValueError(
                f"copy_from extends slot {slot} from {start} to {stop} tokens with a source slot holding "
                f"{int(source._lengths[source_slot])}: it only extends, with tokens the source holds"
            )
        check_room(np.array([stop]), 0, self.max_context)
        if stop > start:
            self._copy_positions(source, source._row_of[source_slot], self._row_of[slot], start, stop)
        self._lengths[slot] = stop

    def close(self) -> None:
        """Release every slot and the cache."""
        self._row_of, self._slot_at = {}, []
        self._lengths = np.zeros(0, dtype=np.int64)
        self._resize(0, 0, 0)

    # --- a whole batch at once (benchmarks, tests, the build's check) -----------------------------------

    def prefill(self, token_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Start a batch in slots 0 .. B-1 (every slot released first): right-padded prompts ``token_ids``
        [B, T] whose real lengths are ``lengths`` [B]; returns the logits at each row's last real token, [B, V]."""
        batch, width = token_ids.shape
        check_room(np.array([width]), 0, self.max_context)
        real = torch.as_tensor(lengths, dtype=torch.int64)
        if real.shape != (batch,) or bool((real < 1).any()) or bool((real > width).any()):
            raise ValueError(f"prefill lengths {real.tolist()} must be {batch} values in [1, {width}]")
        for slot in list(self._slot_at):
            self.release(slot)
        self.reserve(batch)
        for slot in range(batch):
            self.admit(slot)
        return self.step(range(batch), token_ids, real.tolist(), (real - 1).tolist())[:, 0]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``step`` over slots 0 .. B-1 of a batch started by ``prefill``: logits [B, T, V]."""
        if not self._slot_at:
            raise RuntimeError("forward() before prefill(): start a batch with prefill first")
        return self.step(range(token_ids.shape[0]), token_ids)

    def truncate_all(self, lengths: torch.Tensor | int) -> None:
        """``truncate`` slots 0 .. B-1 of a batch started by ``prefill``."""
        slots = range(len(self._slot_at))
        self.truncate(slots, torch.as_tensor(lengths, dtype=torch.int64).expand(len(slots)).tolist())

    # --- what a backend implements ----------------------------------------------------------------------

    @abstractmethod
    def _resize(self, rows: int, keep_rows: int, keep_positions: int) -> None:
        """Hold ``rows`` cache rows, keeping the first ``keep_positions`` positions of the first ``keep_rows``."""

    @abstractmethod
    def _run(
        self, lo: int, token_ids: torch.Tensor, starts: np.ndarray, num_new: np.ndarray, logits_from: np.ndarray
    ) -> torch.Tensor:
        """One pass over cache rows lo .. lo + n - 1 (row i gets row i of ``token_ids`` [n, T] after its
        ``starts[i]`` cached tokens, of which the first ``num_new[i]`` are real); logits as ``step`` returns."""

    @abstractmethod
    def _move_row(self, source: int, destination: int, length: int) -> None:
        """Copy the first ``length`` positions of cache row ``source`` into row ``destination``."""

    @abstractmethod
    def _swap_rows(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` positions of cache rows ``a`` and ``b``."""

    @abstractmethod
    def _copy_positions(self, source: Engine, source_row: int, row: int, start: int, stop: int) -> None:
        """Copy positions ``start`` .. ``stop`` - 1 of ``source``'s cache row into this engine's ``row``."""

    # --- bookkeeping -------------------------------------------------------------------------------------

    def _check_occupied(self, slots: Sequence[int]) -> list[int]:
        slots = [int(s) for s in slots]
        free = [s for s in slots if s not in self._row_of]
        if free or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct occupied slots; {free} are free")
        return slots

    def _gather(self, slots: list[int]) -> int:
        """Make the rows of ``slots`` one contiguous range (swapping rows if they are not) and return its start."""
        rows = sorted(self._row_of[s] for s in slots)
        if rows[-1] - rows[0] + 1 == len(rows):
            return rows[0]
        wanted = set(slots)
        outside = [r for r in rows if r >= len(rows)]  # bring them into rows 0 .. n-1
        holes = [r for r in range(len(rows)) if self._slot_at[r] not in wanted]
        for hole, row in zip(holes, outside):
            a, b = self._slot_at[hole], self._slot_at[row]
            self._swap_rows(hole, row, int(max(self._lengths[a], self._lengths[b])))
            self._slot_at[hole], self._slot_at[row] = b, a
            self._row_of[a], self._row_of[b] = row, hole
        return 0


def check_room(lengths: np.ndarray, num_new: int, max_context: int) -> None:
    """Raise ``ContextOverflowError`` when appending ``num_new`` tokens to any of ``lengths`` would pass
    ``max_context``."""
    longest = int(np.max(lengths, initial=0)) + num_new
    if longest > max_context:
        raise ContextOverflowError(
            f"appending {num_new} tokens would need {longest} positions; the engine holds {max_context}"
        )
