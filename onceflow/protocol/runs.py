"""What a run's life is: leases, retries with backoff, the age limit, and retention. Pure: a runtime setting
a host passes to `open_runtime(run_policy=..., retention=...)`.

A run is work handed to an agent: `queued` until a host claims it (`claim_run` mints a fencing token and
a lease), `claimed` while the host works and renews, then `finished`, `failed` or `cancelled`. A lease that
expires returns the run to `queued` (its attempt used); a retryable failure with retries left returns it to
`queued` for a later time (backoff); a failure past them, or not retryable, is `failed`. The statuses,
backoff and limits are Kandev's runs queue's (apps/backend/internal/runs, office/service/retry.go), with
one age limit where Kandev has two: Kandev cancels a retried run older than 2 h at claim
(`execution_too_old`), which makes its own fourth retry (2 min + 10 min + 30 min + 2 h of backoff)
unreachable; here a run older than `max_age` (24 h) is never retried and never handed out (`run_too_old`),
so every retry the policy allows is reachable.
"""

from __future__ import annotations

import math

import attrs

from onceflow.protocol.durations import seconds

KEY_WINDOW = 24 * 60 * 60.0
"""Seconds an idempotency key stays honoured after its run resolves: retention never goes below it."""

DEFAULT_RETENTION = 7 * 24 * 60 * 60.0
"""Seconds resolved history is kept (`open_runtime(retention=...)`): 7 days."""


def _durations(_: object, attribute: attrs.Attribute[tuple[float, ...]], value: tuple[float, ...]) -> None:
    if not value:
        raise ValueError(f"{attribute.name} needs at least one delay")
    for delay in value:
        seconds(attribute.name, delay)


def _duration(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    seconds(attribute.name, value)


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"{attribute.name} must be a number in [0, 1], got {value!r}")


def _count(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000:
        raise ValueError(f"{attribute.name} must be an integer in [0, 1000], got {value!r}")


@attrs.frozen
class RunPolicy:
    """How runs are leased and retried; times in seconds.

    - `backoff`: the delay before retry N (1-based) is `backoff[min(N, len) - 1]`, times a random factor in
      [1, 1 + `jitter`]; Kandev's: 2 min, 10 min, 30 min, 2 h (clamped), jitter +25 %.
    - `max_retries`: failed attempts retried at most this many times (4); the next failure is final.
    - `max_age`: a run requested this long ago is not retried and not handed out: it is cancelled
      (`run_too_old`).
    - `lease`: the lease a claim gets when it names none; `max_lease`: the longest a claim or renewal may
      ask for.
    - `max_attempts`: claims at most (leases that expired included) before the run fails
      (`too_many_attempts`), so a run that kills every host it reaches stops being handed out.
    - `aging_s`: a queued run waiting longer than this is promoted one priority class per `aging_s` waited,
      never into class 0 (human) (docs/flow.md).
    - `max_causation_depth`: the deepest a run caused by runs may be (a root is 0); an enqueue deeper is
      refused `rate_limited` (limit `max_causation_depth`).

    Every time is measured on the runtime's clock, monotonic while the process lives (on PostgreSQL the
    database server's clock): a wall-clock step changes no lease, retry or age (docs/guarantees.md, "Time").

    Raises:
        ValueError: a time is not finite and positive, `jitter` is outside [0, 1], a count is outside
            [0, 1000] (`max_attempts` at least 1), or `lease` > `max_lease`; the message names the field.
    """

    backoff: tuple[float, ...] = attrs.field(default=(120.0, 600.0, 1800.0, 7200.0), validator=_durations)
    jitter: float = attrs.field(default=0.25, validator=_fraction)
    max_retries: int = attrs.field(default=4, validator=_count)
    max_age: float = attrs.field(default=24 * 60 * 60.0, validator=_duration)
    lease: float = attrs.field(default=300.0, validator=_duration)
    max_lease: float = attrs.field(default=3600.0, validator=_duration)
    max_attempts: int = attrs.field(default=20, validator=_count)
    aging_s: float = attrs.field(default=900.0, validator=_duration)
    max_causation_depth: int = attrs.field(default=8, validator=_count)

    def __attrs_post_init__(self) -> None:
        if self.lease > self.max_lease:
            raise ValueError(f"lease ({self.lease} s) must not exceed max_lease ({self.max_lease} s)")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")

    def delay(self, retry: int, draw: float) -> float:
        """Seconds before retry `retry` (1-based), with `draw` in [0, 1) scaling the jitter."""
        base = self.backoff[min(retry, len(self.backoff)) - 1]
        return base * (1 + self.jitter * min(max(draw, 0.0), 1.0))


def retention_seconds(value: float) -> float:
    """`value` (seconds) as a retention: finite, and never below the 24 h key window (`KEY_WINDOW`), so an
    idempotency key is honoured for its whole window whatever is pruned.

    Raises:
        ValueError: not a finite number of seconds, or below `KEY_WINDOW` (the message names `retention`).
    """
    checked = seconds("retention", value)
    if checked < KEY_WINDOW or not math.isfinite(checked):
        raise ValueError(f"retention must be at least {KEY_WINDOW:.0f} s (the key window), got {value!r}")
    return checked
