"""Argument checks shared by the public classes, with Heat's rule (its users'
code relies on it): an argument of the wrong type -- a string where a dtype,
an int, a float or a bool is expected -- raises TypeError; a value of the
right type that is out of range or not among the choices raises ValueError.
Every message starts with the argument's name."""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional

import torch


def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int >= minimum (bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def check_real(name: str, value, low: Optional[float] = None, high: Optional[float] = None, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a finite float in the interval [low, high] (an end None:
    unbounded; *_open: that end excluded). Ints are accepted where Heat asks
    for a float (1 for 1.0); bool, NaN and infinities are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if not math.isfinite(value) or too_low or too_high:
        left = "-inf" if low is None else f"{low:g}"
        right = "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open or low is None else '['}{left}, {right}" \
                   f"{')' if high_open or high is None else ']'}"
        raise ValueError(f"{name}: expected a finite number in {interval}, got {value!r}")
    return value


def check_dtype(name: str, value, allowed: Iterable[torch.dtype], *, none_ok: bool = False):
    """`value` if it is one of the `allowed` torch dtypes (or None where
    `none_ok`): TypeError for anything that is not a torch.dtype (a string
    such as "bfloat16" included), ValueError for another dtype."""
    allowed = tuple(allowed)
    names = ", ".join(f"torch.{str(d).split('.')[-1]}" for d in allowed)
    if none_ok:
        names = "None, " + names
    if value is None and none_ok:
        return None
    if not isinstance(value, torch.dtype):
        hint = f" (write torch.{value}, not the string)" if isinstance(value, str) and \
            isinstance(getattr(torch, value, None), torch.dtype) else ""
        raise TypeError(f"{name}: expected a torch.dtype ({names}), got "
                        f"{type(value).__name__} {value!r}{hint}")
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {names}, got {value}")
    return value


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """`value` if it is one of the strings `choices`."""
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str ({', '.join(map(repr, choices))}), got "
                        f"{type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value
