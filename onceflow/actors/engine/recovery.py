"""The startup recovery scan, Trio side: finish the step entries a crash left open. Trio thread: it plans
and publishes; the store classifies, closes and re-dispatches (store/entries/recovery.py,
store/entries/recovery_set.py).

Once per start, after the store opens and before any command is served, one query selects every
non-terminal entry in (task_id, step_id, entry_seq) order; they are decided in batches of
`store.recovery.BATCH_SIZE`, as many batches per store request as the set path takes
(`store.recovery.REQUEST_SIZE`), one request ahead of the publishing. An entry with an action that waits on
the host is re-dispatched here after its request commits. The scan never stops the runtime from starting:
a failing record, or one whose stored values cannot be decoded, is logged at ERROR and left open.

The same scan runs on PostgreSQL, where other runtimes may be serving the same tasks: each request takes
its entries' task locks (tried, never waited for) and decides the entries whose lock it got, set-oriented
where it can; an entry whose task another runtime held is recovered afterwards alone, waiting for that
lock (`recover_open_entries`). Source: on-enter-action-dispatch.md, "Recovery" and AC-B9.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.engine.common import common_order, common_result
from onceflow.actors.engine.on_enter import OnEnterDispatch
from onceflow.actors.engine.order import dispatch_order
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.services import Services
from onceflow.observability import metrics
from onceflow.observability.logs import get_logger
from onceflow.store.backends import epochs
from onceflow.store.entries import recovery as writer_side
from onceflow.store.entries import step_entries
from onceflow.store.entries.recovery import Busy, Closed, Deferred, Dispatched, Failed, Recovered
from onceflow.store.entries.recovery_set import SetRun, StepPlan, StepPlans
from onceflow.store.entries.step_entries import EntryKey, UndecodableEntry
from onceflow.store.records import StepEntry, TaskRecord

log = get_logger("onceflow.recovery")


async def recover_open_entries(
    services: Services, hub: EventHub, entries: list[tuple[StepEntry, int]] | None = None
) -> int:
    """Run the scan; returns how many entries were re-dispatched. Never raises (but for cancellation,
    which leaves every committed request's effects and the rest of the entries open for the next scan).

    `entries` (each with the greatest entry_seq of its pair) replaces the query for every open entry: the
    periodic sweep of entries left by dead epochs passes its own (actors/runtime/epoch_sweep.py).

    A request whose transaction fails (nothing of it committed) is tried again as its first batch alone;
    when that fails too, each of its entries is logged at ERROR and left open, and the scan goes on after
    it (AC-B9(f)). Each request publishes through its own `Outbox` on `hub` and decides about
    `store.recovery.BATCH_SIZE` entries one by one at most, so the scan never holds every event of a large
    recovery.

    On PostgreSQL, where other runtimes may serve the same tasks meanwhile, a request covers
    `store.recovery.LOCKED_REQUEST_SIZE` entries and holds their tasks' locks; an entry whose task's lock
    another runtime held (`Busy`) is recovered after the scan, alone, in a request that waits for that lock
    (`epochs.CURRENT_TASK`), as a command of the task would. An entry whose actions wait on the host is
    re-dispatched under its task's lock too.
    """
    if entries is None:
        entries = await decodable_open_entries(services)
        if entries is None:
            return 0
    for (workflow_id, step_id), found in Counter((e.workflow_id, e.step_id) for e, _ in entries).items():
        metrics.RECOVERED_OPEN_ENTRIES.add(found, {"workflow_id": workflow_id, "step_id": step_id})
    plans = step_plans(services, (entry for entry, _ in entries))
    redispatched, busy = await _scan(services, hub, plans, entries)
    for item in busy:  # alone, waiting for its task's lock: no other runtime's command holds it for good
        token = epochs.CURRENT_TASK.set(item.entry.task_id)
        try:
            done, still = await _scan(services, hub, plans, [(item.entry, item.latest)])
        finally:
            epochs.CURRENT_TASK.reset(token)
        redispatched += done
        for left in still:  # cannot be: the request ran holding the lock; the sweep would take it
            log.error(
                "recovery_entry_busy",
                task_id=left.entry.task_id,
                step_id=left.entry.step_id,
                entry_seq=left.entry.entry_seq,
            )
    if busy:
        log.info("recovery_busy_entries", entries=len(busy))
    return redispatched


async def _scan(
    services: Services, hub: EventHub, plans: StepPlans, entries: list[tuple[StepEntry, int]]
) -> tuple[int, list[Busy]]:
    """Decide `entries` request after request, one request ahead of the publishing; how many entries were
    re-dispatched, and the ones left `Busy` (PostgreSQL)."""
    batches: trio.MemorySendChannel[tuple[list[Recovered], Outbox]]
    batches, committed = trio.open_memory_channel[tuple[list[Recovered], Outbox]](1)
    store = services.store
    full = writer_side.LOCKED_REQUEST_SIZE if store.postgres else writer_side.REQUEST_SIZE

    @enable_ki_protection
    async def run_batches() -> None:  # one request ahead: the writer works while the last one is published
        async with batches:
            start, size = 0, full
            while start < len(entries):
                out = Outbox(hub, reply=False)
                chunk = entries[start : start + size]
                try:
                    recovered, covered = await store.transact(
                        writer_side.recover_request, plans, chunk, store, services.now(), out.has_audience()
                    )
                except Exception as exc:  # the transaction itself failed: nothing of it committed
                    if size > writer_side.BATCH_SIZE:  # again, its first batch alone: only it fails
                        size = writer_side.BATCH_SIZE
                        continue
                    covered = min(size, len(entries) - start)
                    recovered = [Failed(entry, repr(exc)) for entry, _ in entries[start : start + covered]]
                start, size = start + covered, full
                await batches.send((recovered, out))

    redispatched = 0
    busy: list[Busy] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_batches)
        async for recovered, out in committed:
            for item in recovered:
                if isinstance(item, Busy):
                    busy.append(item)
                else:
                    redispatched += await _publish(services, plans, item, out)
    return redispatched, busy


async def decodable_open_entries(services: Services) -> list[tuple[StepEntry, int]] | None:
    """Every open entry with the greatest entry_seq of its pair, or None when the query itself failed
    (logged at ERROR). A row whose stored values cannot be decoded is logged at ERROR with its identity and
    left out, so it stays open and is reported at every start until repaired (AC-B9(f))."""
    try:
        rows = await services.store.transact(step_entries.open_entries)
    except Exception as exc:
        log.error("recovery_scan_query_failed", cause=repr(exc))
        return None
    entries = []
    for row in rows:
        if isinstance(row, UndecodableEntry):
            log.error(
                "recovery_entry_undecodable",
                rowid=row.rowid,
                task_id=row.task_id,
                step_id=row.step_id,
                entry_seq=row.entry_seq,
                cause=row.cause,
            )
        else:
            entries.append(row)
    return entries


def step_plans(services: Services, entries: Iterable[StepEntry]) -> StepPlans:
    """The `StepPlan` of every (workflow, step, version) of `entries` that the loaded templates still
    resolve: each entry is resumed under the version its task is pinned to."""
    plans: dict[tuple[str, str, int], StepPlan] = {}
    registered, executors = services.workflows, services.executors
    for entry in entries:
        pair = (entry.workflow_id, entry.step_id, entry.workflow_version)
        workflow = registered.at(entry.workflow_id, entry.workflow_version)
        if pair in plans or workflow is None or not workflow.has_step(entry.step_id):
            continue
        step = workflow.step(entry.step_id)
        order = tuple(dispatch_order(step.events.on_enter, "recovery"))
        deferred = any(action.type not in executors for _, action in order)
        plans[pair] = StepPlan(
            workflow, step, order, deferred, common_order(executors, step, "recovery"), executors
        )
    return plans


def _dispatch(
    services: Services, plans: StepPlans, task: TaskRecord, entry: StepEntry, out: Outbox
) -> OnEnterDispatch:
    plan = plans[(entry.workflow_id, entry.step_id, entry.workflow_version)]
    key = EntryKey(entry.task_id, entry.step_id, entry.entry_seq)
    return OnEnterDispatch(services, task, plan.workflow, plan.step, key, "recovery", out)


async def _publish(services: Services, plans: StepPlans, item: Recovered, out: Outbox) -> int:
    """Publish what a committed request did for one entry, or a run of entries the set path finished (or run
    a deferred dispatch); how many entries were re-dispatched."""
    match item:
        case Closed(entry, reason):
            out.diagnostic(
                "warning" if reason == "unresolvable" else "info",
                f"recovery_{reason}",
                task_id=entry.task_id,
                step_id=entry.step_id,
                entry_seq=entry.entry_seq,
            )
        case Dispatched(entry, task, result):
            _dispatch(services, plans, task, entry, out).publish_segment(result)
            return 1
        case SetRun():
            return _publish_set(services, plans, item, out)
        case Deferred(entry, task):
            token = epochs.CURRENT_TASK.set(task.id)  # on PostgreSQL its transactions hold the task's lock
            try:
                await _dispatch(services, plans, task, entry, out).run()
            except Exception as exc:
                item = Failed(entry, repr(exc))
            else:
                return 1
            finally:
                epochs.CURRENT_TASK.reset(token)
    if isinstance(item, Failed):
        log.error(
            "recovery_entry_failed",
            task_id=item.entry.task_id,
            step_id=item.entry.step_id,
            entry_seq=item.entry.entry_seq,
            cause=item.cause,
        )
    return 0


def _publish_set(services: Services, plans: StepPlans, run: SetRun, out: Outbox) -> int:
    """Publish what every entry of a set run did, in order; how many entries that is. Detailed: exactly the
    per-entry path's events and diagnostics. Else (the scan runs before `open_runtime` yields, so at
    startup nobody can subscribe): the same diagnostics logged and the same runs counted, no event built."""
    group = run.group
    if run.detailed:
        for entry, (task, done) in zip(run.entries, run.detailed, strict=True):
            result = common_result(task.id, group.step, group.order, done)
            _dispatch(services, plans, task, entry, out).publish_segment(result)
        return len(run.entries)
    for entry in run.entries:
        for level, code, fields in group.notes:
            out.log(level, code, task_id=entry.task_id, **fields)
    if group.queued:
        metrics.RUNS.add(group.queued * len(run.entries), {"result": "queued"})
    return len(run.entries)
