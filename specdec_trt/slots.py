"""Slots in the engines' caches for admitted requests: the free ones, growing the caches when too few are, and
handing them out through an admission."""

from __future__ import annotations

from collections import deque

from specdec_trt.drafting import Drafter
from specdec_trt.runtime.engine import Engine

FIRST_SLOTS = 8  # slots reserved at first when the number of slots is not bounded (it doubles as needed)


def empty_slots(target: Engine, drafter: Drafter | None) -> list[int]:
    """The slots free in the target and the drafter, lowest first (a slot that a direct use of the engines left
    occupied, or that holds an idle request's prefix, is not free)."""
    return [
        slot
        for slot in range(target.num_slots)
        if not target.occupied(slot) and not (drafter and drafter.occupied(slot))
    ]


def free_slots(target: Engine, drafter: Drafter | None, count: int, max_batch_size: int | None) -> list[int]:
    """The lowest ``count`` slots free in the target and the drafter; the engines' caches grow, up to
    ``max_batch_size`` where they can, when too few are free. The drafter is grown to the target's slots first:
    another scheduler sharing the target may have grown it alone."""
    if drafter is not None:
        drafter.reserve(target.num_slots)
    while True:
        free = empty_slots(target, drafter)
        if len(free) >= count:
            return free[:count]
        wanted = max(FIRST_SLOTS, 2 * target.num_slots)
        size = max(target.num_slots + count - len(free), min(wanted, max_batch_size or wanted))
        target.reserve(size)
        if drafter is not None:
            drafter.reserve(size)


class SlotSupply:
    """The empty slots of one admission, found once and handed out lowest first: placing each of a burst of
    requests costs no search of every slot."""

    def __init__(self, target: Engine, drafter: Drafter | None, max_batch_size: int | None) -> None:
        self.target, self.drafter, self.max_batch_size = target, drafter, max_batch_size
        if drafter is not None:  # another scheduler sharing the target may have grown it alone
            drafter.reserve(target.num_slots)
        self._free = deque(empty_slots(target, drafter))

    def take(self, grow: bool, still_to_place: int) -> int | None:
        """An empty slot, or None where none is left; given ``grow``, the caches grow first, at once for the
        ``still_to_place`` requests of the admission that are left (this one included)."""
        if not self._free and grow:
            self._free.extend(free_slots(self.target, self.drafter, still_to_place, self.max_batch_size))
        return self._free.popleft() if self._free else None
