"""Argument checks shared by the public classes: a wrong type is a TypeError,
a value out of range a ValueError, each naming the argument."""

from __future__ import annotations

import numbers


def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int >= minimum (bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)
