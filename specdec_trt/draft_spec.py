"""What the user asks to draft with, parsed once: the draft ("none", "ngram", "engine", "int4", a path, or
"ngram+" before a model draft; every command and the Python API read drafts through ``DraftSpec``) and the
draft length (a number of drafts per round, or "auto")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec_trt.validation import InvalidValueError

NONE = "none"  # plain decoding: no drafts
NGRAM = "ngram"  # prompt lookup: drafts copied from earlier in the text, no model
ENGINE = "engine"  # an engine directory's own draft, whatever it was built from
INT4 = "int4"  # an engine directory's own draft when it is the target quantized to 4 bits
LOOKUP_FIRST = "ngram+"  # "ngram+<model draft>": prompt lookup where it matches, that model elsewhere
OWN_DRAFTS = (ENGINE, INT4)
AUTO = "auto"  # the draft length chosen every round (``specdec_trt.planner``)
DraftLength = int | str  # a number of drafts per round, or AUTO


@dataclass(frozen=True)
class DraftSpec:
    """A parsed draft name. ``model`` is None (no model), ENGINE or INT4 (the engine directory's own draft), or
    the path of a draft checkpoint or engine directory; ``lookup`` puts prompt lookup first (alone when there
    is no model)."""

    model: str | None = None
    lookup: bool = False

    @classmethod
    def parse(cls, value: str | Path | DraftSpec | None) -> DraftSpec:
        """``value`` as a draft; None and "" mean no draft. A ValueError names what is accepted."""
        if isinstance(value, DraftSpec):
            return value
        text = "" if value is None else str(value).strip()
        if text in ("", NONE):
            return cls()
        if text == NGRAM:
            return cls(lookup=True)
        if text.startswith(LOOKUP_FIRST):
            model = text.removeprefix(LOOKUP_FIRST)
            if model in ("", NONE, NGRAM) or model.startswith(LOOKUP_FIRST):
                raise InvalidValueError(f"draft {text!r}: after 'ngram+' name the model that drafts where lookup fails")
            return cls(model, lookup=True)
        return cls(text)

    @property
    def drafts(self) -> bool:
        """Whether anything drafts (False: plain target-only decoding)."""
        return self.lookup or self.model is not None

    @property
    def is_own(self) -> bool:
        """Whether the model is the engine directory's own draft."""
        return self.model in OWN_DRAFTS

    @property
    def model_path(self) -> Path | None:
        """The path of a draft checkpoint or engine directory, if the model is one."""
        return None if self.model is None or self.is_own else Path(self.model).expanduser()

    def __str__(self) -> str:
        if self.model is None:
            return NGRAM if self.lookup else NONE
        return LOOKUP_FIRST + self.model if self.lookup else self.model
