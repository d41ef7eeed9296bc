"""The main job's walkthrough: the bundled office example, end to end, with a rejection and a restart. Main
thread, one Trio run.

Everything goes through protocol messages, exactly as a host would send them. The runtime is closed and
reopened on the same SQLite file half-way (a simulated restart); the task carries on from committed state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.cli.trace import describe
from onceflow.protocol.events import DecisionRecorded, Reply, RunQueued, StepEntered

TASK = "DEMO-1"
WORKFLOW = "office-example"
REVIEWERS = ("reviewer-ada", "reviewer-grace")
APPROVER = "approver-linus"


def example_workflow() -> str:
    """The bundled office-style template's YAML text."""
    return resources.files("onceflow").joinpath("examples/office-example.yml").read_text()


def _decide(decider: str, step: str, decision: str, role: str, decision_id: str) -> dict[str, Any]:
    return {
        "type": "record_decision",
        "task_id": TASK,
        "step_id": step,
        "decider_type": "agent",
        "decider_id": decider,
        "role": role,
        "decision": decision,
        "decision_id": decision_id,
    }


def _claim_all(agents: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{"type": "claim_run", "agent_profile_id": agent} for agent in agents]


def _finish(agent: str) -> dict[str, Any]:
    """`finish_run` of the run `agent` claimed last, fenced with its token (filled in as it is played)."""
    return {"type": "finish_run", "run_of": agent}


def first_half() -> list[dict[str, Any]]:
    """Set-up, Backlog → Work → Review, a rejection that sends the task back to Work, and its redelivery."""
    return [
        {"type": "register_workflow", "yaml": example_workflow(), "source": "office-example.yml"},
        *[
            {
                "type": "add_participant",
                "workflow_id": WORKFLOW,
                "step_id": "review",
                "role": "reviewer",
                "agent_profile_id": agent,
                "position": i,
            }
            for i, agent in enumerate(REVIEWERS)
        ],
        {
            "type": "add_participant",
            "workflow_id": WORKFLOW,
            "step_id": "approval",
            "role": "approver",
            "agent_profile_id": APPROVER,
        },
        {
            "type": "create_task",
            "task_id": TASK,
            "workflow_id": WORKFLOW,
            "step_id": "backlog",
            "title": "Write the quarterly report",
            "session_id": "session-1",
            "primary_agent_id": "worker-bot",
        },
        {"type": "move_task", "task_id": TASK, "step_id": "work"},
        {"type": "turn_complete", "task_id": TASK},
        *_claim_all(REVIEWERS),
        _decide(REVIEWERS[0], "review", "approved", "reviewer", "r1-ada"),
        _finish(REVIEWERS[0]),
        _decide(REVIEWERS[1], "review", "rejected", "reviewer", "r1-grace"),
        _decide(REVIEWERS[1], "review", "rejected", "reviewer", "r1-grace"),  # redelivered: idempotent
        _finish(REVIEWERS[1]),  # its entry was left meanwhile: the finish says superseded
    ]


def second_half() -> list[dict[str, Any]]:
    """After the restart: Review again (a new entry, a fresh fan-out), Approval, Done."""
    return [
        {"type": "turn_complete", "task_id": TASK},
        *_claim_all(REVIEWERS),
        _decide(REVIEWERS[0], "review", "approved", "reviewer", "r2-ada"),
        _finish(REVIEWERS[0]),
        _decide(REVIEWERS[1], "review", "approved", "reviewer", "r2-grace"),
        _finish(REVIEWERS[1]),
        *_claim_all((APPROVER,)),
        _decide(APPROVER, "approval", "approved", "approver", "a1-linus"),
        _finish(APPROVER),
        {"type": "get_task", "task_id": TASK},
    ]


def _label(command: dict[str, Any]) -> str:
    details = {k: v for k, v in command.items() if k not in ("type", "yaml")}
    return " ".join([str(command["type"]), *(f"{k}={v}" for k, v in details.items())])


async def _play(
    runtime: Runtime,
    commands: list[dict[str, Any]],
    replies: list[Reply],
    echo: Callable[[str], None],
    stop: trio.Event,
) -> bool:
    """Send `commands` in turn, echoing each with its events; False (after saying why) at the first one
    refused, which sends no more: the walkthrough's later steps rest on every earlier one (a database that
    already holds the demo's task refuses its `create_task`)."""
    claims: dict[str, dict[str, Any]] = {}  # the run each agent claimed last: a host keeps its tokens
    for command in commands:
        if stop.is_set():
            return True
        if "run_of" in command:
            claim = claims[command["run_of"]]
            command = {"type": "finish_run", "run_id": claim["id"], "claim_token": claim["claim_token"]}
        reply = await runtime.send(command)
        replies.append(reply)
        status = "ok" if reply.ok else f"REFUSED {reply.error.code if reply.error else ''}"
        if reply.ok and isinstance(reply.result, dict) and reply.result.get("idempotent"):
            status = "ok (idempotent: already applied, nothing ran)"
        if command["type"] == "claim_run" and isinstance(reply.result, dict):
            claims[command["agent_profile_id"]] = reply.result
            status += f" claimed run #{reply.result['id']} ({reply.result['reason']})"
        if command["type"] == "finish_run" and isinstance(reply.result, dict):
            status += f" run #{reply.result['run_id']} {reply.result['status']}"
            status += " (superseded: its entry was left)" if reply.result["superseded"] else ""
        echo(f"> {_label(command)}  [{status}]")
        for event in reply.events:
            echo(f"    {describe(event)}")
        if not reply.ok:
            message = reply.error.message if reply.error else ""
            echo(f"-- demo stopped: {command['type']} was refused ({message}); it needs a new database")
            return False
    return True


def summarize(replies: list[Reply]) -> dict[str, dict[str, int]]:
    """Per step: entries, runs queued and decisions recorded, from the replies' events."""
    table: dict[str, Counter[str]] = {}
    for reply in replies:
        for event in reply.events:
            if isinstance(event, StepEntered):
                table.setdefault(event.step_id, Counter())["entries"] += 1
            elif isinstance(event, RunQueued) and event.step_id:
                table.setdefault(event.step_id, Counter())["runs queued"] += 1
            elif isinstance(event, DecisionRecorded):
                table.setdefault(event.step_id, Counter())["decisions"] += 1
    return {step: dict(counts) for step, counts in table.items()}


async def run_demo(
    db_path: Path | str,
    echo: Callable[[str], None] = print,
    stop: trio.Event | None = None,
    opened: Callable[[Path | str], None] | None = None,
) -> str:
    """Run the walkthrough against `db_path`; returns the task's final step id, "stopped" when `stop`
    was set (no command is sent after that; the one under way finishes and the runtime closes), or
    "refused" when a command was refused (a database that already holds the demo's task). Once the
    runtime is first open, `opened(db_path)` says where the database is (default: a `database: PATH` line
    through `echo`)."""
    stop = trio.Event() if stop is None else stop
    replies: list[Reply] = []
    async with open_runtime(db_path) as runtime:
        (opened or (lambda db: echo(f"database: {db}")))(db_path)
        echo(f"-- runtime started (epoch {runtime.epoch[:8]})")
        if not await _play(runtime, first_half(), replies, echo, stop):
            return "refused"
    if stop.is_set():
        return "stopped"
    echo("-- runtime stopped: simulated restart on the same database file")
    async with open_runtime(db_path) as runtime:
        echo(f"-- runtime started (epoch {runtime.epoch[:8]})")
        if not await _play(runtime, second_half(), replies, echo, stop):
            return "refused"
    if stop.is_set():
        return "stopped"
    final = replies[-1].result["step_id"] if replies[-1].ok else "unknown"
    echo("")
    echo(f"Summary: task {TASK} finished in step '{final}'")
    echo(f"  {'step':<10} {'entries':>8} {'runs queued':>12} {'decisions':>10}")
    for step, counts in summarize(replies).items():
        echo(
            f"  {step:<10} {counts.get('entries', 0):>8} {counts.get('runs queued', 0):>12}"
            f" {counts.get('decisions', 0):>10}"
        )
    return str(final)
