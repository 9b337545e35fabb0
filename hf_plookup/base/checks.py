"""Argument checks shared by every layer: one rule for "a positive int" (bools are no ints here)."""

from __future__ import annotations

import numbers


def positive_int(name: str, value, *, minimum: int = 1, none_ok: bool = False,
                 type_error: type[Exception] = TypeError) -> int | None:
    """`value` as an int when it is one (numpy ints included, bools not) of at least `minimum`;
    None when `none_ok` and it is None. Else an error naming `name` and the allowed range: a
    ValueError below `minimum`, `type_error` for anything not an int (a TypeError as Python's
    own calls raise; the wrap options say ValueError for every bad value).

    Example: positive_int("k", 3) == 3; positive_int("k", 0) raises ValueError("k must be greater
    than 0, got 0"); positive_int("k", 2.0) raises TypeError("k must be an int greater than 0,
    got float 2.0")."""
    if value is None and none_ok:
        return None
    allowed = ("greater than 0" if minimum == 1 else f">= {minimum}") + (" or None" if none_ok else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise type_error(f"{name} must be an int {allowed}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)
