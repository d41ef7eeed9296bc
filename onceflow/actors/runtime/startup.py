"""Opening a runtime: the store, the ledger, the templates, the recovery scan, then serving. Trio thread.

`open_runtime` opens the store (taking the database's OS lock on SQLite), starts the ledger, loads the
registered workflows, runs the recovery scan and the start-up promotion, and only then yields the `Runtime`
(actors/runtime/supervisor.py). Leaving the context closes the runtime (every actor drains what is queued),
stops the outcome actors and the ledger, then closes the store.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import trio
from opentelemetry.trace import TracerProvider
from trio.lowlevel import enable_ki_protection

from onceflow.actors.engine.recovery import recover_open_entries
from onceflow.actors.kernel import task_rows
from onceflow.actors.kernel.clock import RuntimeClock
from onceflow.actors.kernel.event_window import DEFAULT_EVENT_WINDOW, event_window_size
from onceflow.actors.kernel.groups import raise_single
from onceflow.actors.kernel.ledger import LedgerActor
from onceflow.actors.kernel.outbox import EventHub
from onceflow.actors.kernel.services import Announced, Services, WorkflowRegistry
from onceflow.actors.runtime.epoch_sweep import SWEEP_INTERVAL, sweep_forever
from onceflow.actors.runtime.event_eras import first_era, renew_eras_forever
from onceflow.actors.runtime.handlers import load_workflows
from onceflow.actors.runtime.outcome import OutcomeSupervisor
from onceflow.actors.runtime.retention import RETENTION_EVERY, RetentionTrigger, prune_forever
from onceflow.actors.runtime.run_gauges import gauge_open_runs_forever
from onceflow.actors.runtime.runs import LEASE_SWEEP_INTERVAL, sweep_leases_forever
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.observability.logs import get_logger
from onceflow.observability.tracing import Tracing
from onceflow.protocol.coordinator import Coordinator, RetryPolicy
from onceflow.protocol.durations import seconds
from onceflow.protocol.host import BaseHost, Host
from onceflow.protocol.runs import DEFAULT_RETENTION, RunPolicy, retention_seconds
from onceflow.store.backends import clock as store_clock
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, Executor
from onceflow.store.writer import DEFAULT_BUSY_TIMEOUT, Durability, open_store

log = get_logger("onceflow.runtime")

SWITCH_INTERVAL = 0.00005
"""Seconds: the GIL switch interval `onceflow serve` runs with (`open_runtime`'s `switch_interval`): short
enough that the store's writer thread gets the GIL back soon after SQLite's work, so it runs beside the Trio
thread instead of after it (bench/dispatch.py)."""


@asynccontextmanager
@enable_ki_protection
async def open_runtime(
    db_path: str | os.PathLike[str],
    *,
    host: Host | None = None,
    durability: Durability = Durability.FULL,
    max_batch: int = 64,
    clock: Callable[[], float] = time.time,
    executors: Mapping[str, Executor] = DEFAULT_EXECUTORS,
    coordinator: Coordinator | None = None,
    redelivery_interval: float = 60.0,
    retry_policy: RetryPolicy | None = None,
    actor_idle_timeout: float = 0.0,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    epoch_sweep_interval: float = SWEEP_INTERVAL,
    task_row_cache: int = task_rows.DEFAULT_CAPACITY,
    switch_interval: float | None = None,
    run_policy: RunPolicy | None = None,
    lease_sweep_interval: float = LEASE_SWEEP_INTERVAL,
    retention: float = DEFAULT_RETENTION,
    retention_every: int = RETENTION_EVERY,
    tracer_provider: TracerProvider | None = None,
    event_window: int = DEFAULT_EVENT_WINDOW,
) -> AsyncIterator[Runtime]:
    """Open a runtime on a SQLite file, or a `postgresql://` URL, and serve until the context exits.

    - `host` performs session actions, code reviews and transition preflight (default `BaseHost`: nothing,
      every transition accepted). `executors` maps engine-owned action types to their executors (an action
      type without one is reported, never silently skipped).
    - `durability`, `max_batch`, `busy_timeout`: the store's (store/writer.py `open_store`). Group commit:
      up to `max_batch` queued transactions share one COMMIT, each in its own savepoint, and none is answered
      before the COMMIT is durable. A transaction waits `busy_timeout` seconds for another connection's write
      lock, then the command is answered `storage_busy` (retryable). Every storage fault is answered as a
      typed `storage_<kind>` error, and the transaction that met it commits nothing.
    - `clock` is the wall clock (Unix seconds), read once: the runtime's clock (actors/kernel/clock.py)
      starts at its reading and then follows Trio's monotonic clock, so stepping it while the runtime runs
      changes nothing; on PostgreSQL it is not read at all, the database server's clock is (its reading at
      open, and in every lease, expiry and age decision). Runs-queue times written before the restart are
      trusted at most so far (store/backends/clock.py `clamp_restart`; docs/guarantees.md, "Time").
    - `coordinator` delivers outcomes (`outcome_ready`), redelivering every `redelivery_interval` seconds
    until
      acknowledged, each cycle's attempts following `retry_policy` (None: the spec's, AC-CO-18); unfinished
      outcomes resume at once. Without one, outcomes are stored, pending.
    - `actor_idle_timeout`: seconds a task's actor stays with an empty mailbox before it is evicted (0: at
      once, so an idle task costs no actor memory, ~0.6 KiB of peak RSS per idle task in bench/memory.py);
      an idle task's next command runs on its sender's own Trio task, spawning nothing.
    - `epoch_sweep_interval` (PostgreSQL, where several runtimes may serve one database and each command's
      transactions hold its task's lock): every so many seconds the runtime finishes the open entries
      holding no live claim that a dead epoch claimed or created (an entry of unknown creating epoch: after
      `GRACE_INTERVALS` sweeps), then runs the start-up promotion (actors/runtime/epoch_sweep.py).
    - `task_row_cache`: how many task rows a move may start from without reading them
      (actors/kernel/task_rows.py: the admission's compare-and-set verifies the row, a mismatch falls back to
      a fresh read); 0 turns it off, and it is always off on PostgreSQL, where other runtimes write rows too.
    - `switch_interval`, when given, is the interpreter's GIL switch interval in seconds while the runtime is
      open, the previous one restored on exit. It is process-wide, so the host decides: with Python's default
      (0.005 s) the Trio thread keeps the GIL that long before the writer thread may go on, so the two barely
      overlap; `onceflow serve` sets `SWITCH_INTERVAL` (~1.35x entries per second at 64 tasks).

    - `run_policy`: how runs are leased and retried (protocol/runs.py `RunPolicy`; None: Kandev's backoff,
      4 retries, a 24 h age limit, 300 s leases). When a lease ends the runtime returns its run to the
      queue (actors/runtime/runs.py; on PostgreSQL it also looks every `lease_sweep_interval` seconds, for
      the leases other runtimes granted): leases are durable times, so a dead host's or a dead runtime's
      claims are handed out again.
    - `retention`: seconds resolved history is kept (default 7 days, at least the 24 h key window); older
      history is deleted in bounded batches at start-up and after every `retention_every` entries, resolved
      runs, decisions and acknowledged outcomes (actors/runtime/retention.py, store/retention/retention.py).

    - `tracer_provider`: where the runtime's spans go (onceflow/observability/tracing.py;
    docs/observability.md,
      "Tracing"); None: the global one (`opentelemetry.trace.set_tracer_provider`), so without an SDK
      nothing is recorded.
    - `event_window`: how many of the latest events the runtime keeps (a count, 1 to 1,000,000; each event
      is held alive, typically well under 1 KiB) so that `Runtime.events(after=seq)` and `onceflow serve`'s
      `subscribe` with `after` can replay what a subscriber missed; every event is numbered with an
      `event_seq` that increases across restarts on the same database (actors/kernel/event_window.py).

    The ledger is created here, before the runtime object, and lives exactly as long as the runtime.

    Raises:
        DatabaseOwnedError: another runtime owns the SQLite file (at once; never on PostgreSQL).
        ValueError: before anything is opened, for a duration that is not finite and positive (>= 0 for
            `actor_idle_timeout`), a `retention` below the key window, a `retention_every` below 1, a
            negative `task_row_cache`, an `event_window` out of range, or a bad store setting; a
            `RetryPolicy` and a `RunPolicy` validate themselves when built.
        Whatever ends the runtime (a failure to open, or the body's own exception) surfaces as itself, not
        wrapped in the runtime's nurseries' ExceptionGroups; only several causes at once stay a group.
    """
    redelivery_interval = seconds("redelivery_interval", redelivery_interval)
    actor_idle_timeout = seconds("actor_idle_timeout", actor_idle_timeout, allow_zero=True)
    busy_timeout = seconds("busy_timeout", busy_timeout)
    epoch_sweep_interval = seconds("epoch_sweep_interval", epoch_sweep_interval)
    lease_sweep_interval = seconds("lease_sweep_interval", lease_sweep_interval)
    retention = retention_seconds(retention)
    if isinstance(retention_every, bool) or not isinstance(retention_every, int) or retention_every < 1:
        raise ValueError(f"retention_every must be a positive integer, got {retention_every!r}")
    event_window = event_window_size(event_window)
    trigger = RetentionTrigger(retention_every)
    rows = task_rows.TaskRows(task_row_cache)
    tracing = Tracing(tracer_provider)
    previous_interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(seconds("switch_interval", switch_interval))
    try:
        async with (
            open_store(
                db_path, durability=durability, max_batch=max_batch, busy_timeout=busy_timeout
            ) as store,
            trio.open_nursery() as nursery,
        ):
            server = await store.transact(store_clock.server_time)
            runtime_clock = RuntimeClock.anchored(clock() if server is None else server)
            clamped = await store.transact(store_clock.clamp_restart, runtime_clock())
            if clamped.total:
                log.warning(
                    "times_clamped_at_open",
                    leases=clamped.leases,
                    retries=clamped.retries,
                    runs=clamped.runs,
                    keys=clamped.keys,
                )
            ledger = LedgerActor()
            nursery.start_soon(ledger.run)
            promotions, promoted = trio.open_memory_channel[Announced](math.inf)
            services = Services(
                store=store,
                ledger=ledger,
                host=host or BaseHost(),
                workflows=WorkflowRegistry(),
                promotions=promotions,
                executors=executors,
                clock=runtime_clock,
                task_rows=task_rows.TaskRows() if store.postgres else rows,
                run_policy=run_policy or RunPolicy(),
                tracing=tracing,
            )
            era = await first_era(store)
            hub = EventHub(services.run_signals, trigger, size=event_window, era=era, earlier=era > 1)
            outcome_supervisor = OutcomeSupervisor(
                store,
                hub,
                coordinator,
                redelivery_interval=redelivery_interval,
                retry_policy=retry_policy or RetryPolicy(),
                clock=runtime_clock,
                tracing=tracing,
            )
            try:
                await nursery.start(outcome_supervisor.run)
                async with trio.open_nursery() as task_nursery:
                    background: list[trio.CancelScope] = []
                    runtime = Runtime(services, task_nursery, hub, outcome_supervisor, actor_idle_timeout)
                    task_nursery.start_soon(runtime.forward_promotions, promoted)
                    try:
                        await load_workflows(runtime.services)
                        await recover_open_entries(runtime.services, hub)  # under task locks on PostgreSQL
                        await runtime.promote_all()
                        if store.postgres:  # others may die while we run: finish what their epochs left
                            background.append(
                                await task_nursery.start(
                                    sweep_forever,
                                    runtime.services,
                                    hub,
                                    epoch_sweep_interval,
                                    runtime.promote_all,
                                )
                            )
                        background.append(
                            await task_nursery.start(
                                sweep_leases_forever, runtime.services, hub, lease_sweep_interval
                            )
                        )
                        background.append(
                            await task_nursery.start(prune_forever, runtime.services, retention, trigger)
                        )
                        background.append(
                            await task_nursery.start(gauge_open_runs_forever, runtime.services, runtime)
                        )
                        background.append(await task_nursery.start(renew_eras_forever, store, hub))
                        hub.serving()
                        yield runtime
                    finally:
                        for scope in background:
                            scope.cancel()
                        runtime.close()  # the task nursery then waits for every actor to drain its mailbox
                        promotions.close()
            finally:
                outcome_supervisor.close()
                ledger.close()
                hub.close()
    except BaseExceptionGroup as group:
        raise_single(group)  # a single cause surfaces as itself
    finally:
        if switch_interval is not None:
            sys.setswitchinterval(previous_interval)
