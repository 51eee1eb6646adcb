"""Incremental detokenization of one request's output, with stop-string detection."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class TextTracker:
    """Turns generated token ids into text one token at a time and reports a completed stop string.

    The text never includes a stop string. ``stable_text`` withholds a tail that could still grow into a
    stop string, so a stream never shows text that is later retracted."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: tuple[str, ...] = ()) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if isinstance(backend, Tokenizer) else None
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend else None
        self._ids: list[int] = []

    def add(self, token_id: int) -> bool:
        """Append one token; True when the text now contains a stop string (the text is cut before it)."""
        if self.tokenizer is None:
            return False
        before = len(self.text)
        if self._stream is not None:
            self.text += self._stream.step(self._backend, token_id) or ""
        else:
            self._ids.append(token_id)
            self.text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        return self._cut_at_stop(max(0, before - max((len(s) for s in self.stop), default=0)))

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)

    def stable_text(self, finished: bool) -> str:
        """The text that can no longer change: all of it once finished, else without a tail that is the
        beginning of a stop string."""
        if finished:
            return self.text
        held = max((n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        return self.text[: len(self.text) - held]
