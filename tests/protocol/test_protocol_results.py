"""`Reply.result` is typed per command: every result a handler builds has its model's shape.

The handlers build plain dicts; `protocol/results.py` declares each command's result type. Here a board is
driven through every command type, on a real SQLite file, and every reply's result, as the JSON a host
receives, is validated twice: by the pydantic model (strict, unknown keys refused) and by the JSON Schema
`onceflow schema` prints under `results` (with the `jsonschema` package, as a host in another language
would). Every variant of every declared union must occur, so no declared shape is dead.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import OFFICE
from pydantic import TypeAdapter, ValidationError

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.cli.main import main
from onceflow.protocol import results
from onceflow.protocol.commands import COMMAND_TYPES
from onceflow.protocol.events import Reply
from onceflow.protocol.outcome import derive_outcome_id

# Through the import path: run_code_review on_enter, transitions under event triggers.
FLOW = """\
id: flow
name: Flow
steps:
  - id: start
    name: Start
    position: 0
    is_start_step: true
    events:
      on_enter:
        - type: run_code_review
          config: {agent_profile_id: review-bot}
      on_agent_error:
        - type: move_to_next
  - id: end
    name: End
    position: 1
    events:
      on_children_completed:
        - type: queue_run
          config: {target: "agent_profile_id:parent-bot", reason: children_done}
"""


def envelope() -> dict[str, Any]:
    """A valid coordinator outcome envelope, as JSON data."""
    identity = {"producer": "direct-worker", "store_ref": "city:gc", "work_id": "gc-1", "state": "terminal"}
    fence = {"producer_id": "worker-7", "generation": 3, "token": "tok-9"}
    return {
        "contract_version": 1,
        "outcome_id": derive_outcome_id(**identity, fence=fence),
        **identity,
        "source_root_id": "gc-1000",
        "step_key": "implement",
        "summary": "Implemented the parser.",
        "impact": "Commands are parsed strictly.",
        "evidence": [{"kind": "commit", "uri": "git:repo@abc123", "sha256": "0123456789abcdef" * 4}],
        "fence": fence,
        "occurred_at": "2023-11-14T22:13:20.5Z",
    }


class Checked:
    """Sends JSON lines and validates each reply's result against its command's declared type."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.schemas = results.results_schema()
        self.seen: dict[str, set[str]] = {}

    async def send(self, message: dict[str, Any]) -> Any:
        reply = await self.rt.send(json.dumps(message))
        assert reply.ok, (message, reply.error)
        return self.check(reply)

    def check(self, reply: Reply) -> Any:
        wire = json.loads(reply.model_dump_json())["result"]  # what a host on the wire receives
        jsonschema.validate(wire, self.schemas[reply.command])
        results.result_adapter(reply.command).validate_json(json.dumps(wire), strict=True)
        self.seen.setdefault(reply.command, set()).add(_shape_of(results.RESULTS[reply.command], wire))
        return wire


def _shape_of(declared: Any, value: object) -> str:
    """The name of the variant of `declared` that `value` has (typed dicts are plain dicts at run time, so
    the variant is the one that validates: unknown keys are refused, so at most one does)."""
    if value is None:
        return "None"
    options = typing.get_args(declared) if isinstance(declared, types.UnionType) else (declared,)
    for option in options:
        if typing.get_origin(option) is list:
            if isinstance(value, list):
                return f"list[{typing.get_args(option)[0].__name__}]" if value else "list[]"
            continue
        if option is type(None):
            continue
        try:
            TypeAdapter(option).validate_python(value, strict=True)
        except ValidationError:
            continue
        return str(option.__name__)
    raise AssertionError(f"{value!r} has none of the shapes of {declared}")


def _declared_shapes(tp: Any) -> set[str]:
    if typing.get_origin(tp) is list:
        return {f"list[{typing.get_args(tp)[0].__name__}]"}
    if isinstance(tp, types.UnionType):
        return set().union(*(_declared_shapes(arg) for arg in typing.get_args(tp)))
    return {"None" if tp is type(None) else tp.__name__}


async def drive_every_command(rt: Runtime, templates: Path) -> Checked:
    """A board through every command type: office review round, event triggers, WIP-free flow, outcomes."""
    c = Checked(rt)
    office = (templates / "office-default.yml").read_text()
    await c.send({"type": "register_workflow", "yaml": office, "source": "office-default.yml"})
    await c.send({"type": "register_workflow", "yaml": FLOW, "source": "flow.yml", "import_path": True})
    for step, role, agent in [("review", "reviewer", "rev-a"), ("review", "reviewer", "rev-b")]:
        seat = {"workflow_id": OFFICE, "step_id": step, "role": role, "agent_profile_id": agent}
        await c.send({"type": "add_participant", **seat})
    for task in ("T1", "T2"):
        await c.send(
            {"type": "create_task", "task_id": task, "workflow_id": OFFICE, "step_id": "backlog"}
            | {"session_id": f"s-{task}", "primary_agent_id": "worker", "ceo_agent_id": "ceo"}
        )
    watcher = await c.send(
        {"type": "add_participant", "task_id": "T1", "step_id": "review", "role": "watcher"}
    )
    await c.send({"type": "remove_participant", "participant_id": watcher["participant_id"]})

    # the review round: a move, a turn, two runs, a claim, a redelivered vote, a rejection
    await c.send({"type": "move_task", "task_id": "T1", "step_id": "work"})
    await c.send({"type": "move_task", "task_id": "T1", "step_id": "work"})  # already there
    await c.send({"type": "turn_start", "task_id": "T1"})
    await c.send({"type": "turn_complete", "task_id": "T1"})
    await c.send({"type": "list_runs", "task_id": "T1"})
    run = await c.send({"type": "claim_run", "agent_profile_id": "rev-a"})
    await c.send({"type": "claim_run", "agent_profile_id": "nobody"})
    await c.send({"type": "renew_run", "run_id": run["id"], "claim_token": run["claim_token"]})
    await c.send({"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]})
    other = await c.send({"type": "claim_run", "agent_profile_id": "rev-b"})
    await c.send({"type": "cancel_run", "run_id": other["id"]})
    await c.send({"type": "get_run", "run_id": other["id"]})
    retried = await c.send({"type": "retry_run", "run_id": other["id"]})
    again = await c.send({"type": "claim_run", "agent_profile_ids": ["rev-b", "rev-a"]})
    assert again["id"] == retried["run_id"]
    await c.send({"type": "requeue_run", "run_id": again["id"], "claim_token": again["claim_token"]})
    await c.send({"type": "set_limits", "scope": "agent", "id": "rev-b", "max_concurrent": 2})
    await c.send({"type": "pause", "scope": "agent", "id": "rev-b", "reason": "maintenance"})
    await c.send({"type": "list_pauses"})
    await c.send({"type": "queue_stats"})
    await c.send({"type": "resume", "scope": "agent", "id": "rev-b"})
    vote = {"type": "record_decision", "task_id": "T1", "step_id": "review", "decider_type": "agent"}
    await c.send(vote | {"decider_id": "rev-a", "decision": "approved", "decision_id": "d-1"})
    await c.send(vote | {"decider_id": "rev-a", "decision": "approved", "decision_id": "d-1"})
    await c.send(vote | {"decider_id": "rev-b", "decision": "rejected", "role": "reviewer"})
    await c.send({"type": "list_decisions", "task_id": "T1"})
    await c.send({"type": "list_step_entries", "task_id": "T1"})

    # event triggers, each with what its operation id is built from
    for trigger in [
        {"type": "task_comment", "comment_id": "c-1"},
        {"type": "task_comment", "comment_id": "c-1"},  # redelivered: idempotent
        {"type": "blockers_resolved"},
        {"type": "approval_resolved", "approval_id": "a-1"},
        {"type": "heartbeat", "step_id": "work", "unix": 1_700_000_000},
        {"type": "budget_alert", "workspace_id": "w", "scope": "agent", "scope_id": "x", "pct": 80}
        | {"period_start": 1_700_000_000},
        {"type": "agent_error", "run_id": "r-1"},
    ]:
        await c.send(trigger | {"task_id": "T1"})

    # switch_workflow (into a run_code_review entry), deferred transitions, children
    switch = {"type": "switch_workflow", "task_id": "T2", "workflow_id": "flow"}
    await c.send(switch | {"operation_id": "sw-1"})
    await c.send(switch | {"operation_id": "sw-1"})  # redelivered: idempotent
    await c.send(switch | {"step_id": "start"})  # already there
    await c.send({"type": "list_review_runs", "task_id": "T2"})
    await c.send({"type": "agent_error", "task_id": "T2", "session_id": "s-T2", "execution_id": "e-1"})
    kids = {"type": "children_completed", "task_id": "T2"}
    await c.send(kids | {"children": [{"task_id": "k1", "state": "IN_PROGRESS"}]})
    await c.send(kids | {"children": [{"task_id": "k1", "state": "COMPLETED"}]})
    await c.send(kids | {"children": [{"task_id": "k1", "state": "COMPLETED"}]})  # redelivered

    # task updates and queries
    await c.send({"type": "update_task", "task_id": "T1", "title": "renamed", "priority": "high"})
    await c.send({"type": "start_task", "task_id": "T1", "session_id": "s-T1b", "step_id": "backlog"})
    await c.send({"type": "get_task", "task_id": "T1"})
    await c.send({"type": "list_tasks", "limit": 1})
    await c.send({"type": "task_history", "task_id": "T1", "limit": 3})
    await c.send({"type": "list_host_calls", "task_id": "T1"})  # tests/runtime/test_host_broker.py: full rows
    await c.send({"type": "list_participants", "task_id": "T1"})

    # versions: a second version of the office flow, a dry run, the migration, its replay
    v2 = office.replace("name: Review\n", "name: Peer review\n")
    await c.send({"type": "register_workflow", "yaml": v2, "source": "office-default.yml"})
    await c.send({"type": "list_workflows"})
    await c.send({"type": "get_workflow", "workflow_id": OFFICE, "version": 1})
    migrate = {"type": "migrate_tasks", "workflow_id": OFFICE, "to_version": 2, "operation_id": "mig-1"}
    await c.send(migrate | {"dry_run": True})
    await c.send(migrate)
    await c.send(migrate)  # a replay: idempotent
    await c.send({"type": "delete_task", "task_id": "T2"})

    # coordinator outcomes
    env = envelope()
    await c.send({"type": "outcome_ready", "envelope": env})
    await c.send({"type": "outcome_ready", "envelope": env})  # a repeat: duplicate
    ack = {k: env[k] for k in ("store_ref", "outcome_id", "work_id")}
    await c.send({"type": "coordinator_ack", **ack, "coordinator_fence": "f-1", "acknowledged_by": "mayor"})
    await c.send({"type": "get_outcome", "outcome_id": env["outcome_id"]})
    return c


async def test_every_result_has_its_declared_shape(runtime: Runtime, kandev_templates: Path) -> None:
    """Every command type is driven, every result validates (model and JSON Schema), and every declared
    variant of a command's result occurs at least once (a list query returned at least one row)."""
    checked = await drive_every_command(runtime, kandev_templates)
    assert set(checked.seen) == set(results.RESULTS)
    for command, declared in results.RESULTS.items():
        assert _declared_shapes(declared) <= checked.seen[command], command


def test_every_command_type_declares_a_result_type() -> None:
    commands = {model.model_fields["type"].default for model in COMMAND_TYPES}
    assert set(results.RESULTS) == commands


@pytest.mark.parametrize(
    ("command", "result"),
    [
        ("get_task", {"task_id": "T1"}),  # missing fields
        ("move_task", {"moved": True, "step_id": "work", "extra": 1}),  # an unknown key
        ("claim_run", {"id": "7"}),  # a string for an integer
        ("finish_run", {"run_id": 1, "status": "done"}),  # not one of the values
    ],
)
def test_a_result_of_another_shape_is_refused(command: str, result: dict[str, Any]) -> None:
    """The check is not vacuous: a drifted shape fails both the model and the JSON Schema."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(result, results.results_schema()[command])
    with pytest.raises(ValueError):
        results.result_of(Reply(command=command, ok=True, result=result))


def test_result_of_gives_the_typed_result() -> None:
    reply = Reply(command="move_task", ok=True, result={"moved": True, "step_id": "work"})
    assert results.result_of(reply) == results.MoveResult(moved=True, step_id="work")
    refused = Reply(command="move_task", ok=False, error={"code": "not_found", "message": "no task"})
    with pytest.raises(ValueError, match="not_found"):
        results.result_of(refused)


def test_schema_prints_each_commands_result(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["results"]) == set(results.RESULTS)
    assert printed["results"]["get_task"]["title"] == "TaskInfo"
    record = printed["results"]["record_decision"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in record["anyOf"]} == {"DecisionResult", "AlreadyApplied"}
    guard = record["$defs"]["DecisionResult"]["properties"]["guard_outcome"]
    assert guard["description"].startswith("moved, quorum_not_met, move_abandoned, no_guard, or not_at_step")
