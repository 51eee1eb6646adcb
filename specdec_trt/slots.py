"""Slots in the engines' caches for admitted requests: the free ones, and growing the caches when too few are."""

from __future__ import annotations

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
