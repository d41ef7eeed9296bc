"""The runtime's clock: Unix seconds that only move forward while the process lives. Trio thread.

Every time the runtime persists or compares (a lease's end, a run's request time, a key's window, a
record's stamp) is read from one `RuntimeClock`: anchored once, when the runtime opens, to a wall-clock
reading (`open_runtime(clock=...)` on SQLite; the database server's clock on PostgreSQL), then advanced by
Trio's monotonic clock (`trio.current_time()`). So a step of the wall clock while the process runs (an NTP
correction, a VM resumed, a laptop woken: the monotonic clock does not count a suspend) changes nothing it
decides; only a restart reads the wall clock again (docs/guarantees.md, "Time"). Under
`trio.testing.MockClock` the runtime's time moves exactly as Trio's timers do.
"""

from __future__ import annotations

import attrs
import trio


@attrs.frozen
class RuntimeClock:
    """`anchor` (Unix seconds, the wall reading at open) plus the Trio time elapsed since `started` (the
    `trio.current_time()` of that reading). Call it on the Trio thread (inside `trio.run`)."""

    anchor: float
    started: float

    @classmethod
    def anchored(cls, wall: float) -> RuntimeClock:
        """A clock reading `wall` now. Call it inside `trio.run`."""
        return cls(float(wall), trio.current_time())

    def __call__(self) -> float:
        return self.anchor + (trio.current_time() - self.started)
