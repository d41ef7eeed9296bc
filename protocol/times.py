"""The one time format of the protocol's results and events: RFC 3339 in UTC with `Z`. Pure.

Results and events carry instants as text such as `2026-03-01T12:00:00.250000Z`: always UTC, always the
`Z` offset, always six fraction digits (microseconds), so two times of one kind sort as strings. The
store keeps Unix seconds (REAL / DOUBLE PRECISION columns); the functions building results convert at the
protocol's edge with `rfc3339`. Commands that take a time (`finish_run.retry_at`, `heartbeat.unix`,
`budget_alert.period_start`) keep Unix seconds, as their fields say. A coordinator envelope's
`occurred_at` (protocol/outcome.py) is read with `RFC3339_UTC`, the same format up to nanoseconds.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

RFC3339_UTC = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?Z$")
"""An RFC 3339 timestamp in UTC with `Z`: seconds, then an optional fraction of 1-9 digits (what Go's
time.Time marshals in UTC, RFC3339Nano). Group 1 is the date and time, group 2 the fraction."""


def rfc3339(seconds: float) -> str:
    """Unix `seconds` as RFC 3339 in UTC, microsecond precision: `2026-03-01T12:00:00.250000Z`.

    Raises:
        ValueError / OverflowError / OSError: `seconds` is not finite or outside years 1..9999.
    """
    # isoformat ends "+00:00" for a UTC datetime; it is faster than strftime and pads a year to 4 digits
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds")[:-6] + "Z"


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
