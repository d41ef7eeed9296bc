"""onceflow's metrics, through OpenTelemetry's API: no-ops until the host installs an SDK. Any thread (the
writer records commit metrics).

The instruments come from the global meter provider under the meter name `onceflow`; a host that calls
`opentelemetry.metrics.set_meter_provider(...)` (before or after importing onceflow) gets them exported by
its own readers. Names and units (docs/observability.md, "Metrics"):

| name | kind | unit | attributes | what it counts |
|---|---|---|---|---|
| `onceflow.step_entries` | counter | `{entry}` | `workflow_id`, `step_id`, `entry_path` | entries admitted |
| `onceflow.runs` | counter | `{run}` | `result` (queued, coalesced, suppressed) | run enqueues by result |
| `onceflow.store.commit.duration` | histogram | `s` | | one group commit, BEGIN to durable COMMIT |
| `onceflow.store.commit.batch_size` | histogram | `{transaction}` | | store requests sharing that commit |
| `onceflow.recovery.open_entries` | counter | `{entry}` | `workflow_id`, `step_id` | open entries found |
| `onceflow.outcomes` | counter | `{outcome}` | `phase` | outcomes entering each delivery phase |
| `onceflow.run_changes` | counter | `{run}` | `change` | a run's life after its enqueue (1) |
| `onceflow.retention.deleted` | counter | `{row}` | `kind` | rows retention deleted (2) |
| `onceflow.runs.queued` | gauge | `{run}` | `agent_profile_id` | runs waiting to be claimed (3) |
| `onceflow.runs.claimed` | gauge | `{run}` | `agent_profile_id` | runs claimed, not yet resolved (3) |
| `onceflow.host_calls` | counter | `{call}` | `kind`, `status` | host-role calls ended over serve (4) |
| `onceflow.host_call.duration` | histogram | `s` | `kind`, `status` | from a host-role call to its end |

(1) `change`: claimed, finished, retry_scheduled, failed, cancelled, lease_expired.
(2) `kind`: runs, step_entries, review_runs, decisions, decision_receipts, outcomes, history, host_calls
(store/retention/retention.py).
(3) The latest count the runtime read (actors/runtime/run_gauges.py: one grouped query at start with an SDK,
then one after each collection, so a collection shows the counts as of the one before); an agent profile
whose runs are all gone reads 0. With several runtimes in one process, each reports its database's counts.
(4) `kind`: session_action, code_review, preflight, deliver, acknowledge; `status`: answered, refused,
host_unavailable, host_timeout, cancelled (protocol/host_calls.py), plus `dropped` for an ended call the
recorder could not keep up with (logged).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, NoOpMeterProvider, Observation
from opentelemetry.metrics._internal import _ProxyMeterProvider  # the API's stand-in until one is set

from onceflow.protocol.events import Event

_meter = metrics.get_meter("onceflow")

STEP_ENTRIES = _meter.create_counter(
    "onceflow.step_entries", unit="{entry}", description="Step entries admitted, by entry path (E1..E5)."
)
RUNS = _meter.create_counter(
    "onceflow.runs", unit="{run}", description="Run enqueues by result: queued, coalesced or suppressed."
)
COMMIT_DURATION = _meter.create_histogram(
    "onceflow.store.commit.duration",
    unit="s",
    description="Seconds from BEGIN to the end of COMMIT of one store group commit.",
    explicit_bucket_boundaries_advisory=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
COMMIT_BATCH_SIZE = _meter.create_histogram(
    "onceflow.store.commit.batch_size",
    unit="{transaction}",
    description="Store requests committed together in one group commit.",
    explicit_bucket_boundaries_advisory=(1, 2, 4, 8, 16, 32, 64, 128),
)
RECOVERED_OPEN_ENTRIES = _meter.create_counter(
    "onceflow.recovery.open_entries", unit="{entry}", description="Open step entries found by recovery scans."
)
OUTCOMES = _meter.create_counter(
    "onceflow.outcomes",
    unit="{outcome}",
    description="Coordinator outcomes entering a phase: pending, needs-coordinator-ack, acknowledged.",
)

RUN_CHANGES = _meter.create_counter(
    "onceflow.run_changes",
    unit="{run}",
    description="Runs claimed, finished, retried, failed, cancelled, or whose lease expired.",
)
RETENTION_DELETED = _meter.create_counter(
    "onceflow.retention.deleted", unit="{row}", description="Rows retention deleted, by kind."
)
HOST_CALLS = _meter.create_counter(
    "onceflow.host_calls",
    unit="{call}",
    description="Calls to host connections of onceflow serve that ended, by kind and status.",
)
HOST_CALL_DURATION = _meter.create_histogram(
    "onceflow.host_call.duration",
    unit="s",
    description="Seconds from a call to a host connection to its end (answer, refusal, timeout, ...).",
    explicit_bucket_boundaries_advisory=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 10.0, 30.0),
)

_RUN_RESULTS = {"run_queued": "queued", "run_coalesced": "coalesced", "run_suppressed": "suppressed"}

_RUN_CHANGES = {
    "run_claimed": "claimed",
    "run_finished": "finished",
    "run_retry_scheduled": "retry_scheduled",
    "run_failed": "failed",
    "run_cancelled": "cancelled",
    "run_lease_expired": "lease_expired",
}

COUNTED_EVENTS = frozenset((*_RUN_RESULTS, *_RUN_CHANGES))
"""The event types `count_event` counts: an emitter may skip the call for any other."""


def count_entry(workflow_id: str, step_id: str, entry_path: str) -> None:
    """Count one admitted step entry (as its `step_entered` event is emitted: the event names no
    workflow)."""
    STEP_ENTRIES.add(1, {"workflow_id": workflow_id, "step_id": step_id, "entry_path": entry_path})


def count_event(event: Event) -> None:
    """Count a committed event: a run enqueue or a change of a run. Called for every event the runtime
    emits; other events count nothing."""
    if event.type in _RUN_RESULTS:
        RUNS.add(1, {"result": _RUN_RESULTS[event.type]})
    elif event.type in _RUN_CHANGES:
        RUN_CHANGES.add(1, {"change": _RUN_CHANGES[event.type]})


_open_runs: dict[int, Mapping[tuple[str, str], int]] = {}
"""The latest open-run counts, {(status, agent_profile_id): runs}, per reporting runtime (by its id)."""
_readers: dict[int, Callable[[], None]] = {}
"""Per runtime (by its id): asks it for a fresh reading of its counts (callable from any thread)."""


def recording() -> bool:
    """Whether a meter provider with an SDK is set (instruments then export; before that they are
    no-ops, and nothing needs counting)."""
    return not isinstance(metrics.get_meter_provider(), _ProxyMeterProvider | NoOpMeterProvider)


def report_open_runs(owner: object, counts: Mapping[tuple[str, str], int]) -> None:
    """Replace `owner`'s open-run counts ({(status, agent_profile_id): runs}); a pair it reported before and
    no longer has reads 0. Any thread (the gauges read them on the reader's)."""
    before = _open_runs.get(id(owner), {})
    _open_runs[id(owner)] = {**dict.fromkeys(before, 0), **counts}


def watch_open_runs(owner: object, ask: Callable[[], None]) -> None:
    """Have each collection of the gauges call `ask` (from the reader's thread): `owner` then reads its
    counts afresh for the next one."""
    _readers[id(owner)] = ask


def forget_open_runs(owner: object) -> None:
    """`owner` (a runtime) closed: its counts are no longer observed."""
    _open_runs.pop(id(owner), None)
    _readers.pop(id(owner), None)


def _observe(status: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(_: CallbackOptions) -> Iterable[Observation]:
        if status == "queued":  # once per collection (both gauges are collected together)
            for ask in list(_readers.values()):
                ask()
        for counts in list(_open_runs.values()):
            for (kind, agent), count in counts.items():
                if kind == status:
                    yield Observation(count, {"agent_profile_id": agent})

    return observe


QUEUED_RUNS = _meter.create_observable_gauge(
    "onceflow.runs.queued",
    callbacks=[_observe("queued")],
    unit="{run}",
    description="Runs waiting to be claimed, by agent profile.",
)
CLAIMED_RUNS = _meter.create_observable_gauge(
    "onceflow.runs.claimed",
    callbacks=[_observe("claimed")],
    unit="{run}",
    description="Runs claimed and not yet resolved, by agent profile.",
)
