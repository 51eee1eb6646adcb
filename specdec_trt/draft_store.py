"""Drafts from what earlier requests said: a bounded store of their token sequences, searched by n-gram.

Agents call a model again and again with the same tools and formats, so a request often goes on as an earlier
one did (a tool call, a schema, a quoted result) where its own text has no match (SuffixDecoding; vLLM's
``suffix`` method; llama.cpp's ``ngram-cache``). Each ended request's prompt and output go in; a row's last
``min_ngram`` tokens are looked up in a hash index of every stored n-gram of that length (its latest
occurrence), the match is extended backwards up to ``max_ngram`` tokens to measure it, and the tokens that
followed are the draft. Memory is bounded in tokens: past ``max_tokens``, the least recently used sequence (last
added or drafted from) goes, with its index entries. Drafts are deterministic given the committed text and the
store, never the target's verdict on them, so they are as lossless as any other draft.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

DEFAULT_STORE_TOKENS = 262_144  # stored tokens, about 30 MB with their index entries
STORE_MIN_NGRAM = 4  # the shortest match drafted from: a shorter one is too often a common phrase
STORE_MAX_NGRAM = 16  # the longest match measured (its length is the draft's confidence)


class DraftStore:
    """Earlier requests' tokens, searchable by their last ``min_ngram`` tokens (see the module docstring)."""

    def __init__(
        self, max_tokens: int = DEFAULT_STORE_TOKENS, min_ngram: int = STORE_MIN_NGRAM, max_ngram: int = STORE_MAX_NGRAM
    ) -> None:
        if max_tokens < 0 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need max_tokens >= 0 and 1 <= min_ngram <= max_ngram, got {max_tokens}, {min_ngram}")
        self.max_tokens, self.min_ngram, self.max_ngram = max_tokens, min_ngram, max_ngram
        self.num_tokens = 0
        self._sequences: OrderedDict[int, np.ndarray] = OrderedDict()  # least recently used first
        self._index: dict[int, tuple[int, int]] = {}  # n-gram key -> (sequence id, index after the n-gram)
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, tokens: Sequence[int]) -> None:
        """Keep an ended request's ``tokens``, dropping the least recently used sequences past the bound."""
        array = np.asarray(tokens, dtype=np.int64)
        if len(array) <= self.min_ngram or len(array) > self.max_tokens:
            return
        while self.num_tokens + len(array) > self.max_tokens:
            self._drop_oldest()
        key = self._next_id
        self._next_id += 1
        self._sequences[key] = array
        self.num_tokens += len(array)
        for end, gram in enumerate(self._keys(array), start=self.min_ngram):
            if end < len(array):  # an n-gram with a token after it
                self._index[gram] = (key, end)

    def clear(self) -> None:
        """Drop every stored sequence."""
        self._sequences.clear()
        self._index.clear()
        self.num_tokens = 0

    def match(self, sequence: np.ndarray, num_tokens: int) -> tuple[int, np.ndarray]:
        """The match of ``sequence``'s suffix (its length, ``min_ngram`` to ``max_ngram`` tokens) and up to
        ``num_tokens`` stored tokens that followed it; (0, empty) if there is none."""
        if num_tokens == 0 or len(sequence) < self.min_ngram:
            return 0, sequence[:0]
        found = self._index.get(_key(sequence[-self.min_ngram :]))
        if found is None:
            return 0, sequence[:0]
        key, end = found
        stored = self._sequences[key]
        self._sequences.move_to_end(key)
        length = self.min_ngram
        while length < min(self.max_ngram, end, len(sequence)) and stored[end - 1 - length] == sequence[-1 - length]:
            length += 1
        if not np.array_equal(stored[end - self.min_ngram : end], sequence[-self.min_ngram :]):
            return 0, sequence[:0]  # a hash collision
        return length, stored[end : end + num_tokens]

    def _drop_oldest(self) -> None:
        key, array = self._sequences.popitem(last=False)
        self.num_tokens -= len(array)
        for gram in self._keys(array):
            if self._index.get(gram, (None,))[0] == key:
                del self._index[gram]

    def _keys(self, array: np.ndarray) -> list[int]:
        """The key of every ``min_ngram``-token window of ``array``, in order."""
        windows = np.lib.stride_tricks.sliding_window_view(array, self.min_ngram)
        return [_key(window) for window in windows]


def _key(gram: np.ndarray) -> int:
    return hash(gram.tobytes())
