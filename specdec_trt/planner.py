"""How far each row of a round drafts: the one place a request's draft length is decided.

The scheduler's round calls ``plan`` before drafting and ``observe`` after verifying. A request with a fixed
``num_draft_tokens`` drafts that many (fewer near its end or the context's); an "auto" request's length
comes from its kind of draft's ``DraftLengthController``, planned into the verify pass as the other rows
leave it: prompt lookup's rows first, then the rows drafting from earlier requests' text (the store; both
copy tokens that cost nearly nothing to make), then the model draft's around the width those take. Each kind
that drafts gets a stop rule: auto's cost-aware stop, or, with ``confidence_threshold``, a fixed cut-off for
model drafts (a probability threshold means nothing for copied tokens, whose rounds then draft the planned
length). Rows with a fixed length keep a round going while they draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specdec_trt.costs import Costs, PassContext
from specdec_trt.draft_length import AcceptanceEvidence, DraftLengthController
from specdec_trt.drafting import LOOKUP, MODEL, STORE, Drafter, DraftPlan, Part, StopRule, confidence_below
from specdec_trt.request import Request
from specdec_trt.speculation import RoundResult


@dataclass(frozen=True)
class RoundPlan:
    """A round's drafts: each row's ``limits``, what the drafter is told (``draft``), the rows whose length
    auto chose (``auto``), and whether a prefill chunk rides in the verify pass (``chunk``)."""

    limits: list[int]
    draft: DraftPlan
    auto: list[int]
    chunk: bool


class DraftPlanner:
    """Plans every round's draft lengths for ``drafter`` and learns from its outcome (see the module docstring).
    ``costs``: the target's, which the scheduler records; the drafts' own costs are recorded here."""

    def __init__(
        self,
        drafter: Drafter | None,
        max_auto_draft: int,
        max_context: int,
        costs: Costs,
        confidence_threshold: float | None = None,
    ) -> None:
        self.drafter, self.max_auto_draft, self.max_context, self.costs = drafter, max_auto_draft, max_context, costs
        self.confidence_threshold = confidence_threshold
        self.controllers = {kind: DraftLengthController(max_auto_draft, costs) for kind in (MODEL, LOOKUP, STORE)}

    def plan(self, rows: Sequence[Request], chunk: bool = False, chunk_follows: bool = False) -> RoundPlan:
        """The round of the decoding ``rows``. ``chunk``: a prefill chunk rides in the verify pass;
        ``chunk_follows``: a chunk's pass of its own follows the round (its fixed cost is the round's too, so
        fewer, fuller rounds pay it fewer times)."""
        parts = self._parts(rows)
        # A pass pads every row to the widest: the row with the least room left bounds the drafts.
        room = min(self.max_context - len(r.sequence) for r in rows)
        limits = [0 if r.auto else min(r.num_draft_tokens, r.remaining - 1, room) for r in rows]
        auto = [i for i, r in enumerate(rows) if r.auto]
        fixed_s = self.costs.fixed_s if chunk_follows else 0.0
        stop_rules = self._plan_auto(rows, auto, parts, limits, room, fixed_s, chunk) if auto else {}
        return RoundPlan(limits, DraftPlan(parts, stop_rules), auto, chunk)

    def _parts(self, rows: Sequence[Request]) -> list[Part | None]:
        """Which part of the drafter drafts each row that ever drafts (None for the others), worked out once a
        round: the plan reads each row's kind of draft, and the drafter drafts from it."""
        parts: list[Part | None] = [None] * len(rows)
        drafting = [i for i, r in enumerate(rows) if r.drafts]
        if drafting and self.drafter is not None:
            for i, part in zip(drafting, self.drafter.parts([rows[i].sequence for i in drafting])):
                parts[i] = part
        return parts

    def observe(self, rows: Sequence[Request], plan: RoundPlan, result: RoundResult) -> None:
        """Feed each kind's controller its auto rows' drafts, acceptances and confidences, and its drafting
        seconds when no other row drafted, except that the model's rows take them beside the rows that copy
        tokens (prompt lookup, the store), whose search on the host is small next to a model step."""
        confidence = None if result.confidence is None else result.confidence.get().numpy()
        for kind, controller in self.controllers.items():
            members = [i for i in plan.auto if plan.draft.parts[i].kind == kind]
            if not members:
                continue
            copied = {i for i in plan.auto if plan.draft.parts[i].kind in (LOOKUP, STORE)}
            besides = (copied if kind == MODEL else set()) | set(members)
            alone = not any(n and i not in besides for i, n in enumerate(result.num_drafted))
            drafted = [result.num_drafted[i] for i in members]
            if alone and max(drafted):
                controller.drafting.add(sum(n > 0 for n in drafted), max(drafted), result.draft_s)
            controller.observe(
                drafted,
                [result.num_accepted[i] for i in members],
                [rows[i].evidence[kind] for i in members],
                None if confidence is None else confidence[members],
            )

    def _plan_auto(
        self,
        rows: Sequence[Request],
        auto: list[int],
        parts: list[Part | None],
        limits: list[int],
        room: int,
        fixed_s: float,
        chunk: bool,
    ) -> dict[str, StopRule]:
        """Fill in ``limits`` for the auto rows, kind of draft by kind of draft, each planned into the pass as
        the others leave it; the stop rules of the kinds that draft."""
        fixed_slots = [r.slot for r, k in zip(rows, limits) if k > 0]
        members = {kind: [i for i in auto if parts[i].kind == kind] for kind in (LOOKUP, STORE, MODEL)}
        planned_tokens = float(len(rows) - len(auto))  # the other rows' own tokens, at least
        unplanned = len(auto)
        stop_rules: dict[str, StopRule] = {}
        for kind, indices in members.items():
            if not indices:
                continue
            controller = self.controllers[kind]
            evidence = [rows[i].evidence.setdefault(kind, controller.evidence()) for i in indices]
            unplanned -= len(indices)  # the rows of kinds planned later count their own token
            context = PassContext.of(limits, self.costs.packed, planned_tokens + unplanned, fixed_s, chunk)
            needed = max(rows[i].remaining - 1 for i in indices)
            tokens = controller.row_tokens(evidence)
            lengths = controller.plan(evidence, min(needed, room), context, tokens)
            for i, length in zip(indices, lengths):
                limits[i] = min(length, rows[i].remaining - 1, room)
            drafting = [n for n, i in enumerate(indices) if limits[i] > 0]
            planned_tokens += float(sum(tokens[n, limits[i]] for n, i in enumerate(indices)))
            if drafting:
                slots = [rows[indices[n]].slot for n in drafting]
                stop_context = replace(context, tokens=context.tokens + len(indices) - len(drafting))
                rule = self._stop_rule(kind, slots, [evidence[n] for n in drafting], stop_context, fixed_slots)
                if rule is not None:
                    stop_rules[kind] = rule
        return stop_rules

    def _stop_rule(
        self,
        kind: str,
        slots: list[int],
        evidence: list[AcceptanceEvidence],
        context: PassContext,
        fixed_slots: list[int],
    ) -> StopRule | None:
        """Auto's cost-aware stop, or the fixed confidence cut-off for a model draft."""
        controller = self.controllers[kind]
        if self.confidence_threshold is None:
            return controller.stop_rule(slots, evidence, context, fixed_slots, controller.best_rate)
        return None if kind != MODEL else confidence_below(self.confidence_threshold, fixed_slots)
