"""Protocol-level helpers for the integration tests: every call is a JSON message a host could send."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Reply
from onceflow.protocol.outcome import derive_outcome_id
from onceflow.testing import START, FakeClock

__all__ = ["FIXTURES", "REPO", "START", "TESTS", "FakeClock"]  # re-exported: the suite imports them from here

TESTS = Path(__file__).resolve().parent
"""The tests folder (fixtures/, scripts/ and the support modules live here)."""
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"

# A one-step workflow whose task_comment queues one run for the task's primary agent (no way out of `work`).
ONE_STEP_COMMENT_QUEUES_RUN = """\
id: m
name: Minimal
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_comment:
        - type: queue_run
          config: {target: primary, reason: task_comment}
"""

# A two-step workflow whose task_comment queues one run for the task's primary agent (the runs tests').
COMMENT_QUEUES_RUN = """\
id: m
name: Minimal
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_comment:
        - type: queue_run
          config: {target: primary, reason: task_comment}
  - id: done
    name: Done
    position: 1
"""

OFFICE = "office-default"
REVIEWERS = ("rev-a", "rev-b")
APPROVER = "boss"


async def send(rt: Runtime, message: dict[str, Any] | str) -> Reply:
    """Send one message as a JSON line (a dict is encoded first), as a host on the wire would."""
    return await rt.send(message if isinstance(message, str) else json.dumps(message))


async def ok(rt: Runtime, message: dict[str, Any] | str) -> Reply:
    """Send and insist on success."""
    reply = await send(rt, message)
    assert reply.ok, reply.error
    return reply


async def register(
    rt: Runtime, yaml_text: str, source: str = "test.yml", *, import_path: bool = False
) -> Reply:
    """Register a template (`import_path`: through the import path, so run_code_review and
    configure_session may be declared, and transitions under event triggers)."""
    message = {"type": "register_workflow", "yaml": yaml_text, "source": source, "import_path": import_path}
    return await ok(rt, message)


async def add_participant(rt: Runtime, workflow_id: str, step_id: str, role: str, agent: str) -> int:
    """A template-level participant row; returns its id."""
    reply = await ok(
        rt,
        {
            "type": "add_participant",
            "workflow_id": workflow_id,
            "step_id": step_id,
            "role": role,
            "agent_profile_id": agent,
        },
    )
    return int(reply.result["participant_id"])


async def setup_office(rt: Runtime, template: Path) -> None:
    """Register an office template and seat rev-a, rev-b (review) and boss (approval) on it."""
    await register(rt, template.read_text(encoding="utf-8"), template.name)
    for reviewer in REVIEWERS:
        await add_participant(rt, OFFICE, "review", "reviewer", reviewer)
    await add_participant(rt, OFFICE, "approval", "approver", APPROVER)


async def create_task(
    rt: Runtime, task_id: str, *, workflow_id: str = OFFICE, step_id: str | None = "backlog"
) -> Reply:
    message: dict[str, Any] = {
        "type": "create_task",
        "task_id": task_id,
        "workflow_id": workflow_id,
        "session_id": f"session-{task_id}",
        "primary_agent_id": "worker",
    }
    if step_id is not None:
        message["step_id"] = step_id
    return await ok(rt, message)


async def move(rt: Runtime, task_id: str, step_id: str) -> Reply:
    return await ok(rt, {"type": "move_task", "task_id": task_id, "step_id": step_id})


async def turn_complete(rt: Runtime, task_id: str) -> Reply:
    return await ok(rt, {"type": "turn_complete", "task_id": task_id})


async def decide(
    rt: Runtime, task_id: str, step_id: str, decider: str, decision: str, role: str = "reviewer", **extra: Any
) -> Reply:
    return await ok(
        rt,
        {
            "type": "record_decision",
            "task_id": task_id,
            "step_id": step_id,
            "decider_type": "agent",
            "decider_id": decider,
            "role": role,
            "decision": decision,
            **extra,
        },
    )


async def step_of(rt: Runtime, task_id: str) -> str:
    reply = await ok(rt, {"type": "get_task", "task_id": task_id})
    return str(reply.result["step_id"])


async def every_page(rt: Runtime, command: dict[str, Any], rows: str, *cursor: str) -> list[dict[str, Any]]:
    """Every row of a paged `list_*` query: its `rows` list of each page, following the page's
    `next_<cursor>` values (passed back as the `<cursor>` fields) to the last page."""
    out: list[dict[str, Any]] = []
    while True:
        page = (await ok(rt, command)).result
        out.extend(page[rows])
        following = {field: page[f"next_{field}"] for field in cursor}
        if all(value is None for value in following.values()):
            return out
        command = {**command, **following}


async def list_runs(rt: Runtime, **filters: Any) -> list[dict[str, Any]]:
    return await every_page(rt, {"type": "list_runs", **filters}, "runs", "after_run_id")


async def list_review_runs(rt: Runtime, **filters: Any) -> list[dict[str, Any]]:
    command = {"type": "list_review_runs", **filters}
    return await every_page(rt, command, "review_runs", "after_review_run_id")


async def list_entries(rt: Runtime, task_id: str) -> list[dict[str, Any]]:
    command = {"type": "list_step_entries", "task_id": task_id}
    return await every_page(rt, command, "entries", "after_step_id", "after_entry_seq")


async def list_decisions(rt: Runtime, task_id: str, step_id: str) -> list[dict[str, Any]]:
    command = {"type": "list_decisions", "task_id": task_id, "step_id": step_id}
    return await every_page(rt, command, "decisions", "after_decision_id")


async def to_review(rt: Runtime, task_id: str) -> Reply:
    """Create a task in backlog, move it to work and complete the turn; returns the turn_complete reply."""
    await create_task(rt, task_id)
    await move(rt, task_id, "work")
    return await turn_complete(rt, task_id)


def of_type(events: Iterable[Any], type_: str) -> list[Any]:
    """The events of one type, in order."""
    return [event for event in events if event.type == type_]


def events(reply: Reply, type_: str) -> list[Any]:
    """The reply's events of one type, in emission order."""
    return [event for event in reply.events if event.type == type_]


def diagnostics(reply: Reply, code: str) -> list[Any]:
    return [event for event in events(reply, "diagnostic") if event.code == code]


def metric_points(reader: Any) -> dict[tuple[str, tuple[tuple[str, Any], ...]], float]:
    """Cumulative metric values from an OpenTelemetry `InMemoryMetricReader`, keyed by (name, attributes):
    a counter's sum, or a histogram's count (its sum under `name + ".sum"`)."""
    values: dict[tuple[str, tuple[tuple[str, Any], ...]], float] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    attributes = tuple(sorted((point.attributes or {}).items()))
                    if hasattr(point, "bucket_counts"):
                        values[(metric.name, attributes)] = point.count
                        values[(metric.name + ".sum", attributes)] = point.sum
                    else:
                        values[(metric.name, attributes)] = point.value
    return values


def metric_delta(
    before: dict[tuple[str, tuple[tuple[str, Any], ...]], float],
    after: dict[tuple[str, tuple[tuple[str, Any], ...]], float],
) -> dict[tuple[str, tuple[tuple[str, Any], ...]], float]:
    """What moved between two `metric_points` readings (keys that did not move are left out)."""
    return {key: value - before.get(key, 0) for key, value in after.items() if value != before.get(key, 0)}


ENVELOPE_SHA = "0123456789abcdef" * 4


def gascity_envelope(**overrides: Any) -> dict[str, Any]:
    """A valid Gas City outcome envelope as JSON data, keys in Go's order; `outcome_id` is derived after the
    overrides unless one is given."""
    data: dict[str, Any] = {
        "contract_version": 1,
        "outcome_id": None,
        "producer": "direct-worker",
        "store_ref": "city:gascity",
        "work_id": "gc-1234",
        "source_root_id": "gc-1000",
        "step_key": "implement",
        "summary": "Implemented the parser.",
        "impact": "Commands are parsed strictly.",
        "state": "terminal",
        "evidence": [{"kind": "commit", "uri": "git:repo@abc123", "sha256": ENVELOPE_SHA}],
        "fence": {"producer_id": "worker-7", "generation": 3, "token": "tok-9"},
        "occurred_at": "2023-11-14T22:13:20.5Z",
    }
    data.update(overrides)
    if data["outcome_id"] is None:
        data["outcome_id"] = derive_outcome_id(
            producer=data["producer"],
            store_ref=data["store_ref"],
            work_id=data["work_id"],
            state=data["state"],
            fence=data["fence"],
        )
    return data
