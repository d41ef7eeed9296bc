"""The one time format of the protocol's results and events: RFC 3339 in UTC with `Z`. Pure.

Results and events carry instants as text such as `2026-03-01T12:00:00.250000Z`: always UTC, always the
`Z` offset, always six fraction digits (microseconds), so two times of one kind sort as strings. The
store keeps Unix seconds (REAL / DOUBLE PRECISION columns); the functions building results convert at the
protocol's edge with `rfc3339`. Commands that take a time (`finish_run.retry_at`, `heartbeat.unix`,
`budget_alert.period_start`) accept the same RFC 3339 UTC text (`Instant`, `WholeInstant`), and also a
JSON number of Unix seconds, as they always did. A coordinator envelope's `occurred_at`
(protocol/outcome.py) is read with `RFC3339_UTC`, the same format up to nanoseconds.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema

from onceflow.protocol.errors import shown
from onceflow.protocol.limits import INT64_MAX, INT64_MIN

RFC3339_UTC = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?Z$")
"""An RFC 3339 timestamp in UTC with `Z`: seconds, then an optional fraction of 1-9 digits (what Go's
time.Time marshals in UTC, RFC3339Nano). Group 1 is the date and time, group 2 the fraction."""


_MIN_SECONDS = -62135596800.0  # 0001-01-01T00:00:00Z
_MAX_SECONDS = 253402300799.0  # 9999-12-31T23:59:59Z
_last_second: tuple[float, str] = (math.nan, "")  # the whole second `rfc3339` formatted last, and its text


def rfc3339(seconds: float) -> str:
    """Unix `seconds` as RFC 3339 in UTC, microsecond precision: `2026-03-01T12:00:00.250000Z`; the same
    text as `datetime.fromtimestamp(seconds, UTC)` gives (microseconds rounded half to even).

    Raises:
        ValueError / OverflowError: `seconds` is not finite or outside years 1..9999.
    """
    global _last_second
    fraction, whole = math.modf(seconds)
    micro = round(fraction * 1e6)  # ValueError for NaN
    if micro >= 1_000_000:
        whole, micro = whole + 1, micro - 1_000_000
    elif micro < 0:
        whole, micro = whole - 1, micro + 1_000_000
    # Times come in runs of the same second (a page of runs, one command's events): the date and time of
    # the last second are kept (~2k instructions a time instead of ~19k through datetime). One tuple,
    # swapped whole: safe from any thread.
    last = _last_second
    if last[0] != whole:
        if not _MIN_SECONDS <= whole <= _MAX_SECONDS:
            raise ValueError(f"{seconds!r} is not a time in years 1..9999")
        last = _last_second = (whole, datetime.fromtimestamp(whole, UTC).isoformat()[:19])
    return f"{last[1]}.{micro:06d}Z"


def rfc3339_or_none(seconds: float | None) -> str | None:
    """`rfc3339(seconds)`, None for None (a time not set)."""
    return None if seconds is None else rfc3339(seconds)


def unix_seconds(text: str) -> float:
    """The Unix seconds an RFC 3339 UTC timestamp (`RFC3339_UTC`) names; a fraction past microseconds is
    rounded.

    Raises:
        ValueError: `text` is not such a timestamp, or names no valid date and time.
    """
    match = RFC3339_UTC.match(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 timestamp in UTC with Z: {text!r}")
    whole = datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    return whole.timestamp() + float(f"0.{match[2] or '0'}")


_NUMBER = re.compile(r"\s*[-+]?\d+(\.\d*)?\s*")
_EXPECTED = "an RFC 3339 timestamp in UTC with Z (2026-03-01T12:00:00Z) or a number of Unix seconds"


def _instant(value: Any) -> Any:
    """A command's time as Unix seconds: RFC 3339 UTC text converted, anything else left to the field's
    own type and bounds (a number of Unix seconds, also as a numeric string, which pydantic reads)."""
    if not isinstance(value, str) or _NUMBER.fullmatch(value):
        return value
    try:
        return unix_seconds(value)
    except ValueError:
        raise ValueError(f"expected {_EXPECTED}, got {shown(value)}") from None


def _whole_instant(value: Any) -> Any:
    """`_instant`, for a field in whole seconds: text with a fraction other than zero is refused."""
    seconds = _instant(value)
    if isinstance(seconds, float):  # converted from text
        if seconds != int(seconds):
            raise ValueError(f"expected whole seconds, got {shown(value)}")
        return int(seconds)
    return seconds


def _schema(number: str, minimum: int) -> WithJsonSchema:
    return WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "format": "date-time", "pattern": RFC3339_UTC.pattern},
                {"type": number, "minimum": minimum, "maximum": INT64_MAX},
            ]
        }
    )


Instant = Annotated[
    float, BeforeValidator(_instant), Field(ge=0, le=INT64_MAX, allow_inf_nan=False), _schema("number", 0)
]
"""A time a command carries: RFC 3339 UTC text (`RFC3339_UTC`), or a number of Unix seconds; held as Unix
seconds (a float)."""

WholeInstant = Annotated[
    int, BeforeValidator(_whole_instant), Field(ge=INT64_MIN, le=INT64_MAX), _schema("integer", INT64_MIN)
]
"""`Instant` in whole seconds (a time that is part of an operation id): RFC 3339 UTC text without a
fraction (or `.0`), or an integer of Unix seconds; held as an int."""
