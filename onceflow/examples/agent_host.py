"""An agent host built on the runs queue's worker: `python -m onceflow.examples.agent_host [--db PATH]`.
Main thread, one asyncio loop (`onceflow.aio` runs the Trio runtime on a thread beside it).

The agents are plain Python functions (a real host calls its model or agent framework there): `developer`
writes a revision, `reviewer` judges it. The bundled template `agent-host.yml` hands them their work as
runs: entering Work queues the developer's run, entering Review a run per reviewer. Each agent is one
worker loop (`rt.runs(agent)`): it claims the agent's runs, keeps each lease renewed while the agent works,
and finishes the run from how the body ended — a raise fails it (retried later), a return finishes it.

The story it prints: the developer's first attempt is rate-limited (`RunError` with `retry_at`: retried a
second later, same run, attempt 2); the reviewer rejects the first revision (back to Work: a new run);
the second revision is approved and the task reaches Done.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import onceflow.aio
from onceflow import RunError
from onceflow.protocol.events import Reply, Transition

TASK = "FEAT-1"
WORKFLOW = "agent-host-example"
DEVELOPER = "developer"
REVIEWER = "reviewer"

Verdict = Literal["approved", "rejected"]


# The agents: plain functions. -----------------------------------------------------------------------


def developer(task_id: str, revision: int, feedback: str | None) -> str:
    """Write revision `revision` of the task's change, taking the reviewer's `feedback` into account."""
    if feedback is None:
        return f"{task_id} r{revision}: add the export button"
    return f"{task_id} r{revision}: add the export button, with tests ({feedback!r} addressed)"


def reviewer(change: str) -> tuple[Verdict, str]:
    """Judge a change: approve one that comes with tests."""
    if "tests" in change:
        return "approved", "looks good"
    return "rejected", "please add tests"


# The host: one worker loop per agent. ---------------------------------------------------------------


class Host:
    """What the host remembers between runs (a real one keeps it with the task), and its output."""

    def __init__(self, rt: onceflow.aio.AsyncioRuntime) -> None:
        self.rt = rt
        self.developer_runs = rt.runs(DEVELOPER)  # long-polls claim_run (60 s at a time) until stopped
        self.reviewer_runs = rt.runs(REVIEWER)
        self.revision = 0
        self.change: str | None = None
        self.feedback: str | None = None
        self.rate_limited_once = False

    async def send(self, message: dict[str, Any]) -> Reply:
        reply = await self.rt.send(message)
        if not reply.ok:
            raise RuntimeError(f"{message['type']} refused: {reply.error}")
        return reply

    async def work_as_developer(self) -> None:
        async with self.developer_runs as runs:
            async for run in runs:
                async with run:  # renewed while the agent works; finished when the block ends
                    say(f"{DEVELOPER}: run {run.id} attempt {run.attempt} ({run.reason})")
                    if not self.rate_limited_once:
                        self.rate_limited_once = True
                        raise RunError("the model is rate-limited", retry_at=time.time() + 1)
                    self.revision += 1
                    self.change = developer(TASK, self.revision, self.feedback)
                    say(f"{DEVELOPER}: wrote {self.change!r}")
                    await self.send({"type": "turn_complete", "task_id": TASK})  # Work -> Review
                report(DEVELOPER, run)

    async def work_as_reviewer(self) -> None:
        async with self.reviewer_runs as runs:
            async for run in runs:
                async with run:
                    assert self.change is not None
                    verdict, comment = reviewer(self.change)
                    say(f"{REVIEWER}: run {run.id} on {self.change!r}: {verdict} ({comment})")
                    self.feedback = comment
                    await self.send(
                        {
                            "type": "record_decision",
                            "task_id": TASK,
                            "step_id": "review",
                            "decider_type": "agent",
                            "decider_id": REVIEWER,
                            "decision": verdict,
                            "comment": comment,
                            "decision_id": f"run-{run.id}",  # a retried run does not vote twice
                            "entry_seq": run.entry_seq,  # nor in a later round
                        }
                    )
                report(REVIEWER, run)


def say(line: str) -> None:
    print(line, flush=True)


def report(agent: str, run: onceflow.Run) -> None:
    outcome = run.outcome
    if outcome is None:
        say(f"{agent}: run {run.id} ended without a finish (lost: {run.lost}, released: {run.released})")
    elif outcome["status"] == "queued":
        retry_at = outcome["retry_at"]
        retry_in = datetime.fromisoformat(retry_at).timestamp() - time.time() if retry_at else 0.0
        say(f"{agent}: run {run.id} failed, retry scheduled in {retry_in:.0f} s")
    else:
        say(f"{agent}: run {run.id} {outcome['status']}")


async def main(db: Path) -> str:
    """Drive the task from Backlog to Done with the two agents; returns the step it ends at."""
    template = resources.files("onceflow").joinpath("examples/agent-host.yml")
    say(f"database: {db}")
    async with onceflow.aio.open_runtime(db) as rt:
        host = Host(rt)
        await host.send({"type": "register_workflow", "yaml": template.read_text(), "source": template.name})
        await host.send(
            {
                "type": "add_participant",
                "workflow_id": WORKFLOW,
                "step_id": "review",
                "role": "reviewer",
                "agent_profile_id": REVIEWER,
            }
        )
        await host.send(
            {
                "type": "create_task",
                "task_id": TASK,
                "workflow_id": WORKFLOW,
                "step_id": "backlog",
                "primary_agent_id": DEVELOPER,
            }
        )
        async with rt.subscribe() as events, asyncio.TaskGroup() as agents:
            agents.create_task(host.work_as_developer())
            agents.create_task(host.work_as_reviewer())
            await host.send({"type": "move_task", "task_id": TASK, "step_id": "work"})
            async for event in events:
                if isinstance(event, Transition) and event.task_id == TASK:
                    say(f"{TASK}: {event.from_step} -> {event.to_step} ({event.trigger})")
                    if event.to_step == "done":
                        break
            host.developer_runs.stop()  # the loops end: no run of theirs is left unfinished
            host.reviewer_runs.stop()
        task = (await host.send({"type": "get_task", "task_id": TASK})).result
        step = str(task["step_id"])
        say(f"{TASK} is at {step}")
        return step


def run(argv: list[str] | None = None) -> int:
    """The command line: exit status 0 once the task reached Done."""
    parser = argparse.ArgumentParser(prog="python -m onceflow.examples.agent_host", description=__doc__)
    parser.add_argument("--db", type=Path, help="the SQLite file (default: a new one in a temporary folder)")
    args = parser.parse_args(argv)
    db = (
        args.db if args.db is not None else Path(tempfile.mkdtemp(prefix="onceflow-agent-host-")) / "board.db"
    )
    return 0 if asyncio.run(main(db)) == "done" else 1


if __name__ == "__main__":
    raise SystemExit(run())
