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

_RUN_RESULTS = {"run_queued": "queued", "run_coalesced": "coalesced", "run_suppressed": "suppressed"}

COUNTED_EVENTS = frozenset(("step_entered", *_RUN_RESULTS))
"""The event types `count_event` counts: an emitter may skip the call for any other."""


def count_event(event: Event) -> None:
    """Count a committed event: a step entry or a run enqueue. Called for every event the runtime emits;
    other events count nothing."""
    if event.type == "step_entered":
        STEP_ENTRIES.add(1, {"entry_path": event.entry_path})
    elif event.type in _RUN_RESULTS:
        RUNS.add(1, {"result": _RUN_RESULTS[event.type]})
