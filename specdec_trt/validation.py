"""Strict checks of the values users hand the Python API, before any work is done.

Python's own comparisons let a ``bool`` pass as a number, a ``float`` be truncated to a token id and
``nan`` slip through every range check; these checks refuse such values with one line naming the value
and what to give instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Integral, Real

MAX_SEED = 2**64 - 1  # seeds are unsigned 64-bit integers
MAX_INT64 = 2**63 - 1  # the most a count may be: the engines hold counts in int64 tensors


class InvalidValueError(ValueError):
    """A value of the right type lies outside what is accepted."""


class ConflictingOptionsError(InvalidValueError):
    """Options that cannot go together, such as a draft length with plain decoding (a command reports it as a
    usage error)."""


class InvalidTypeError(TypeError, ValueError):
    """A value has a type that cannot mean what was asked for (also a ValueError, so that callers that
    catch bad arguments as ValueError keep catching it)."""


def is_integer(value: object) -> bool:
    """An integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_integer(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int if it is an integer in [minimum, maximum], else an error naming ``name``."""
    if not is_integer(value):
        raise InvalidTypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InvalidValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        most = "2^63 - 1 (a 64-bit integer)" if maximum == MAX_INT64 else str(maximum)
        raise InvalidValueError(f"{name} must be an integer from {minimum} to {most}, got {value!r}")
    return int(value)


def check_number(name: str, value: object) -> float:
    """``value`` as a float if it is a finite real number (not a bool, a string or None)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise InvalidValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_bounded(name: str, value: object, ok: Callable[[float], bool], bounds: str) -> float:
    """``value`` as a float if it is a finite number for which ``ok`` holds, else an error naming ``bounds``."""
    number = check_number(name, value)
    if not ok(number):
        raise InvalidValueError(f"{name} must be {bounds}, got {value!r}")
    return number


def check_token_ids(ids: Sequence[object], vocab_size: int) -> list[int]:
    """A token-id prompt as ints, each an integer in [0, vocab_size)."""
    bad_types = [t for t in ids if not is_integer(t)]
    if bad_types:
        raise InvalidTypeError(
            f"token ids must be integers, got {bad_types[0]!r} ({type(bad_types[0]).__name__}): pass a list of ints"
        )
    bad = [int(t) for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}): check the ids")
    return [int(t) for t in ids]


def check_prompt_type(prompt: object) -> None:
    """A prompt is a str or a sequence of token ids."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, (bytes, bytearray)):
        raise InvalidTypeError("a prompt must be text or a list of token ids, got bytes: decode it to a str first")
    if not isinstance(prompt, Sequence):
        raise InvalidTypeError(
            f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}: pass text or a list of ints"
        )


def check_threads(threads: object, available: int) -> int | None:
    """A thread count from 1 to the ``available`` cores (None: the backend's default): more threads than
    cores only take turns on them, and many more slow every step."""
    if threads is None:
        return None
    count = check_integer("threads", threads, 1)
    if count > available:
        raise InvalidValueError(
            f"threads={count} is more than the {available} CPU cores here, which cannot help: give at most {available}"
        )
    return count
