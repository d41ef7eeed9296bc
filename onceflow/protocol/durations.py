"""The one check every duration a host can configure goes through (intervals, timeouts, idle timeouts).

A NaN interval would spin a timer loop and an infinite one never fires: neither is a duration. Every
configurable duration is checked here, where it is accepted, so the error names the parameter. Pure.
"""

from __future__ import annotations

import math


def seconds(name: str, value: float, *, allow_zero: bool = False) -> float:
    """Return `value` (seconds) as a float when it is a finite duration, positive (or >= 0 with `allow_zero`).

    Raises:
        ValueError: `value` is not a real number, is NaN or infinite, or is <= 0 (< 0 with `allow_zero`);
            the message names `name`.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float range
        as_float = math.inf
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r:.40}")
    if as_float < 0 or (as_float == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    return as_float
