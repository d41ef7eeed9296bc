"""Time in the runtime tests, moved by hand: Trio's MockClock, which the runtime's clock follows
(actors/kernel/clock.py), and on PostgreSQL the database server's clock, frozen at the same reading and moved
with it (pg_support.freeze_server_clock), so on both backends every time the runtime stamps or judges is
`HandClock.now` exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing
from pg_support import freeze_server_clock

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.backends.urls import is_postgres_url
from onceflow.testing import START


class HandClock(trio.abc.Clock):
    """A Trio clock (ask for it as a test's fixture, `hand_clock`, and pytest-trio runs the test on it): a
    `trio.testing.MockClock` that stands still until `advance`d. `wall` is the wall clock to open runtimes
    with: `START` plus Trio's time, so across a restart the runtime's clock goes on where it was. On
    PostgreSQL (`db` a URL) the server's clock stands still at `now` too."""

    def __init__(self, db: Path | str, start: float = START) -> None:
        self.mock = trio.testing.MockClock()
        self.db = db
        self.start = start
        self.wall_steps = 0.0
        self.server_steps = 0.0
        self.freeze()

    def start_clock(self) -> None:
        self.mock.start_clock()

    def current_time(self) -> float:
        return self.mock.current_time()

    def deadline_to_sleep_time(self, deadline: float) -> float:
        return self.mock.deadline_to_sleep_time(deadline)

    def wall(self) -> float:
        """The wall clock's reading, Unix seconds (what `open_runtime(clock=...)` reads at open): `now`
        plus every `step_wall` so far."""
        return self.now + self.wall_steps

    @property
    def now(self) -> float:
        """The runtime's time: `start` plus Trio's."""
        return self.start + self.current_time()

    @property
    def postgres(self) -> bool:
        return is_postgres_url(self.db)

    def freeze(self) -> None:
        """Stand the server's clock at `now` plus every `step_server` so far (PostgreSQL; a no-op on
        SQLite)."""
        if self.postgres:
            freeze_server_clock(str(self.db), self.now + self.server_steps)

    def advance(self, seconds: float) -> None:
        """Move Trio's clock and the server's `seconds` forward at once (no checkpoint in between). The
        timers that expired run at the caller's next checkpoint."""
        self.mock.jump(seconds)
        self.freeze()

    def step_wall(self, seconds: float) -> None:
        """Step the wall clock alone (an NTP correction, a VM resumed): Trio's monotonic clock and the
        server's do not move. A runtime reads the wall clock only when it opens."""
        self.wall_steps += seconds

    def step_server(self, seconds: float) -> None:
        """Step the database server's clock alone (PostgreSQL; a no-op on SQLite): it judges every lease
        there, and anchors a runtime that opens."""
        self.server_steps += seconds
        self.freeze()

    async def elapse(self, rt: Runtime, seconds: float, step: float | None = None) -> None:
        """`advance` by `seconds` (in steps of `step`, default all at once), letting every timer that expired
        run to its end each time: the store's thread is real, so Trio's clock is moved by hand (an autojump
        clock would jump while a store reply is pending), and a store request queued behind the timers'
        answers once they committed."""
        moved = 0.0
        while moved < seconds or seconds == 0:
            delta = seconds - moved if step is None else min(step, seconds - moved)
            await trio.testing.wait_all_tasks_blocked()
            self.advance(delta)
            moved += delta
            for _ in range(2):  # twice: the writer may answer a timer's request and ours in one batch
                await trio.testing.wait_all_tasks_blocked()
                await rt.services.store.transact(_nothing)
            await trio.testing.wait_all_tasks_blocked()
            if seconds == 0:
                return


def _nothing(conn: object) -> None:
    return None


def run_still(fn: Callable[..., Any], *args: Any) -> Any:
    """`trio.run(fn, *args)` on a MockClock that never moves: every time a runtime stamps in it is the same
    from one run to the next (`START`, with `FakeClock`), so two runs' databases compare equal."""
    return trio.run(fn, *args, clock=trio.testing.MockClock())
