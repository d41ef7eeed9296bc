"""onceflow's metrics, through OpenTelemetry's API: no-ops until the host installs an SDK. Any thread (the
writer records commit metrics).

The instruments come from the global meter provider under the meter name `onceflow`; a host that calls
`opentelemetry.metrics.set_meter_provider(...)` (before or after importing onceflow) gets them exported by
its own readers. Names and units (README, "Metrics"):

| name | kind | unit | attributes | what it counts |
|---|---|---|---|---|
| `onceflow.step_entries` | counter | `{entry}` | `entry_path` (E1..E5) | step entries admitted |
| `onceflow.runs` | counter | `{run}` | `result` (queued, coalesced, suppressed) | run enqueues by result |
| `onceflow.store.commit.duration` | histogram | `s` | | one group commit, BEGIN to durable COMMIT |
| `onceflow.store.commit.batch_size` | histogram | `{transaction}` | | store requests sharing that commit |
| `onceflow.recovery.open_entries` | counter | `{entry}` | | open entries the startup scan found |
| `onceflow.outcomes` | counter | `{outcome}` | `phase` | outcomes entering each delivery phase |
| `onceflow.run_changes` | counter | `{run}` | `change` | a run's life after its enqueue (1) |
| `onceflow.retention.deleted` | counter | `{row}` | `kind` | rows retention deleted (2) |

(1) `change`: claimed, finished, retry_scheduled, failed, cancelled, lease_expired.
(2) `kind`: runs, step_entries, review_runs, decisions, decision_receipts, outcomes (store/retention.py).
"""

from __future__ import annotations

from opentelemetry import metrics

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

_RUN_RESULTS = {"run_queued": "queued", "run_coalesced": "coalesced", "run_suppressed": "suppressed"}

_RUN_CHANGES = {
    "run_claimed": "claimed",
    "run_finished": "finished",
    "run_retry_scheduled": "retry_scheduled",
    "run_failed": "failed",
    "run_cancelled": "cancelled",
    "run_lease_expired": "lease_expired",
}

COUNTED_EVENTS = frozenset(("step_entered", *_RUN_RESULTS, *_RUN_CHANGES))
"""The event types `count_event` counts: an emitter may skip the call for any other."""


def count_event(event: Event) -> None:
    """Count a committed event: a step entry, a run enqueue or a change of a run. Called for every event
    the runtime emits; other events count nothing."""
    if event.type == "step_entered":
        STEP_ENTRIES.add(1, {"entry_path": event.entry_path})
    elif event.type in _RUN_RESULTS:
        RUNS.add(1, {"result": _RUN_RESULTS[event.type]})
    elif event.type in _RUN_CHANGES:
        RUN_CHANGES.add(1, {"change": _RUN_CHANGES[event.type]})
