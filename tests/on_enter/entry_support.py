"""Workflows, store access and small spies shared by the step-entry tests (on-enter-action-dispatch.md).

Two workflows: `entries` (work → review → done; a reviewer veto at review sends the task back to work) and
`other` (intake, done) for switch_workflow. Every test supplies the on_enter list of the steps it enters.
Both are registered through the import path so run_code_review may be declared.

State a crash would leave behind (a committed admission with no or some markers) is written through a plain
`open_store` on the closed database file, with the store's own functions: that store is the "freshly
constructed store" of the spec's Verification lines, and a later `open_runtime` is the restart.
"""

from __future__ import annotations

import re
import sqlite3
import textwrap
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import trio
from helpers import START, add_participant, of_type, ok, register

from onceflow.actors.engine.on_enter import OnEnterDispatch
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import EntryPath, Event
from onceflow.protocol.workflow import IMPORT_ALLOWED_ACTIONS, ActionDecl, load_workflow_text
from onceflow.store.entries import participants, step_entries
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect, Executor
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.runs import keys
from onceflow.store.tasks import tasks, workflows
from onceflow.store.tasks.workflows import StoredWorkflow
from onceflow.store.writer import open_store
from onceflow.testing import RecordingHost

T = TypeVar("T")

WF = "entries"
OTHER = "other"
REVIEWERS = ("rev-a", "rev-b")

CLEAR_AND_FAN_OUT = """
- type: clear_decisions
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
"""

_ENTRIES = """\
id: entries
name: Entries
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_enter:
{work}
      on_turn_complete:
        - type: move_to_step
          config: {{step_id: review}}
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
{review}
      on_turn_complete:
        - type: move_to_step
          config:
            step_id: work
            wait_for_quorum: {{role: reviewer, threshold: any_reject}}
  - id: done
    name: Done
    position: 2
"""

_OTHER = """\
id: other
name: Other
steps:
  - id: intake
    name: Intake
    position: 0
    is_start_step: true
    events:
      on_enter:
{intake}
  - id: done
    name: Done
    position: 1
"""


def _block(actions: str) -> str:
    text = textwrap.dedent(actions).strip() or "[]"
    return textwrap.indent(text, " " * 8)


def entries_yaml(review: str, work: str = "[]") -> str:
    """The `entries` workflow with these on_enter lists (YAML list text) at review and at work."""
    return _ENTRIES.format(review=_block(review), work=_block(work))


def other_yaml(intake: str) -> str:
    return _OTHER.format(intake=_block(intake))


def kinds_of(yaml_text: str, step_id: str) -> list[str]:
    """The declared on_enter kinds of one step, in order (what the allocator digests)."""
    workflow = load_workflow_text(yaml_text, "test.yml", allowed_actions=IMPORT_ALLOWED_ACTIONS)
    return [action.type for action in workflow.step(step_id).events.on_enter]


async def setup_entries(
    rt: Runtime,
    review: str,
    *,
    work: str = "[]",
    reviewers: Iterable[str] = REVIEWERS,
    seat_at: Iterable[str] = ("review",),
) -> None:
    """Register `entries` and seat `reviewers` (template-level, role reviewer) at each step of `seat_at`."""
    await register(rt, entries_yaml(review, work), import_path=True)
    for step_id in seat_at:
        for reviewer in reviewers:
            await add_participant(rt, WF, step_id, "reviewer", reviewer)


async def new_task(rt: Runtime, task_id: str, step_id: str = "work", workflow_id: str = WF) -> None:
    """Create a task (creation is not a step entry) with a live session."""
    await ok(
        rt,
        {
            "type": "create_task",
            "task_id": task_id,
            "workflow_id": workflow_id,
            "step_id": step_id,
            "session_id": f"s-{task_id}",
            "primary_agent_id": "worker",
        },
    )


# --- the database file, between runtimes ----------------------------------------------------------


async def on_disk(db_path: Path, fn: Callable[[sqlite3.Connection], T]) -> T:
    """Run `fn` as one transaction through a fresh store on the (closed) database file."""
    async with open_store(db_path) as store:
        return await store.transact(fn)


def admit(
    conn: sqlite3.Connection, task_id: str, step_id: str, kinds: list[str], path: str = "E2"
) -> EntryKey:
    """What a step transition commits — step change and record in one transaction — and nothing after it.

    This is the state a crash between the transition and its on_enter dispatch leaves behind.
    """
    task = tasks.get_task(conn, task_id)
    assert tasks.move_task_step(
        conn,
        task_id=task_id,
        expected_step_id=task.step_id,
        workflow_id=task.workflow_id,
        step_id=step_id,
        now=START,
    )
    return step_entries.allocate_entry(
        conn,
        task_id=task_id,
        step_id=step_id,
        workflow_id=task.workflow_id,
        digest=step_entries.declaration_digest(kinds),
        entry_path=path,
        now=START,
    )


def mark(
    conn: sqlite3.Connection, key: EntryKey, position: int, kind: str, state: str, *, epoch: str = "old-epoch"
) -> None:
    """Write one marker: in_progress by a claim under `epoch`, or a terminal state."""
    if state == "in_progress":
        assert step_entries.claim_marker(conn, key, position, kind, epoch, START) == "claimed"
    else:
        step_entries.finish_marker(conn, key, position, kind, state, "written by the test", START)  # type: ignore[arg-type]


def commit_clear(conn: sqlite3.Connection, key: EntryKey, position: int = 0) -> None:
    """What a committed clear_decisions leaves: the delete and its done marker, in one transaction."""
    participants.clear_decisions(conn, task_id=key.task_id, step_id=key.step_id)
    step_entries.finish_marker(conn, key, position, "clear_decisions", "done", "", START)


def add_decision(conn: sqlite3.Connection, task_id: str, step_id: str, decider: str = "rev-a") -> int:
    return participants.record_decision(
        conn,
        task_id=task_id,
        step_id=step_id,
        participant_id=None,
        role="reviewer",
        decider_type="agent",
        decider_id=decider,
        decision="approved",
        comment="",
        now=START,
    )


def save_yaml(conn: sqlite3.Connection, workflow_id: str, yaml_text: str) -> None:
    """A template change that lands while no runtime is up, under the tasks' feet: the stored text of
    every version of the workflow is replaced in place (an edit outside register_workflow, which would
    add a version the tasks are not pinned to), so the entries' declarations drift (AC-B9(d), (e))."""
    stored = StoredWorkflow(workflow_id, "synced.yml", yaml_text, True)
    workflows.save_workflow(conn, workflow_id=workflow_id, name=workflow_id, stored=stored, now=START)
    conn.execute(
        "UPDATE workflow_versions SET definition = ? WHERE workflow_id = ?", (yaml_text, workflow_id)
    )


# --- reading state --------------------------------------------------------------------------------


def entry_table(conn: sqlite3.Connection, task_id: str) -> list[tuple[str, int, bool, list[tuple[Any, ...]]]]:
    """(step_id, entry_seq, terminal, [(position, kind, state, detail)]) for each of the task's entries."""
    out = []
    for entry in step_entries.entries_for_task(conn, task_id):
        key = EntryKey(entry.task_id, entry.step_id, entry.entry_seq)
        marks = step_entries.markers(conn, key)
        rows = [(m.position, m.kind, m.state, m.detail) for _, m in sorted(marks.items())]
        out.append((entry.step_id, entry.entry_seq, entry.terminal, rows))
    return out


def states(conn: sqlite3.Connection, key: EntryKey) -> list[tuple[int, str, str]]:
    """(position, kind, state) of one entry's markers, by position."""
    marks = step_entries.markers(conn, key)
    return [(m.position, m.kind, m.state) for _, m in sorted(marks.items())]


def is_terminal(conn: sqlite3.Connection, key: EntryKey) -> bool:
    entry = step_entries.get_entry(conn, key)
    assert entry is not None, key
    return entry.terminal


def run_rows(conn: sqlite3.Connection, task_id: str | None = None) -> list[tuple[str, str, str, str]]:
    """(task_id, agent_profile_id, reason, idempotency_key) of every run, oldest first."""
    sql = f"SELECT task_id, agent_profile_id, reason, {keys.STORED_KEY_SQL} FROM runs"
    args: tuple[Any, ...] = ()
    if task_id is not None:
        sql, args = sql + " WHERE task_id = ?", (task_id,)
    return [tuple(row) for row in conn.execute(sql + " ORDER BY id", args).fetchall()]  # type: ignore[misc]


def decision_ids(conn: sqlite3.Connection, task_id: str, step_id: str) -> list[int]:
    return [d.id for d in participants.decisions_for(conn, task_id=task_id, step_id=step_id)]


def key_entry_seq(idempotency_key: str) -> int:
    """The entry_seq of an on_enter run key: `on_enter:<task>:<step>:<seq>:<position>:<agent>:<digest>`."""
    return int(idempotency_key.split(":")[3])


def key_position(idempotency_key: str) -> int:
    return int(idempotency_key.split(":")[4])


# --- executors, hosts and dispatchers -------------------------------------------------------------


def executors_with(**overrides: Executor) -> Mapping[str, Executor]:
    return {**DEFAULT_EXECUTORS, **overrides}


def raising(
    kind: str, *, when: Callable[[ActionContext], bool] = lambda ctx: True, times: int | None = None
) -> Executor:
    """The real executor of `kind`, raising a transient sqlite3 error instead when `when(ctx)` holds.

    With `times`, only the first `times` matching calls raise.
    """
    real = DEFAULT_EXECUTORS[kind]
    left = [times]

    def executor(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        if when(ctx) and (left[0] is None or left[0] > 0):
            if left[0] is not None:
                left[0] -= 1
            raise sqlite3.OperationalError("database is locked")
        return real(conn, ctx, action)

    return executor


class BlockingHost(RecordingHost):
    """A host whose start_code_review blocks until `release` is set (an external effect in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = trio.Event()
        self.release = trio.Event()

    async def start_code_review(self, **launch: Any) -> None:
        self.entered.set()
        await self.release.wait()
        await super().start_code_review(**launch)


async def dispatcher(
    rt: Runtime, key: EntryKey, path: EntryPath = "recovery"
) -> tuple[OnEnterDispatch, list[Event]]:
    """A dispatcher of the committed entry `key`, built from committed state; returns it and its events."""
    task = await rt.engine.load_task(key.task_id)
    workflow = rt.services.workflows.get(task.workflow_id)
    out = Outbox(EventHub())
    dispatch = OnEnterDispatch(rt.services, task, workflow, workflow.step(key.step_id), key, path, out)
    return dispatch, out.events


def loud(events: Iterable[Event]) -> list[Any]:
    """Warning and error diagnostics among `events`."""
    return [e for e in of_type(events, "diagnostic") if e.level in ("warning", "error")]


def logged(logs: list[dict[str, Any]], level: str, event: str | None = None) -> list[dict[str, Any]]:
    """Captured structlog records at `level` (and with `event`, when given)."""
    return [r for r in logs if r["log_level"] == level and (event is None or r["event"] == event)]


SNAPSHOT_TABLES = (
    "tasks",
    "step_entries",
    "step_entry_markers",
    "runs",
    "decisions",
    "coalesced_keys",
    "task_history",
)
"""The tables an entry's admission, dispatch or recovery writes."""


def snapshot(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of `SNAPSHOT_TABLES` in the SQLite file `db`, ordered: what two paths' databases are
    compared by."""
    conn = sqlite3.connect(db)
    try:
        return unfolded(
            {
                table: conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2, 3").fetchall()
                for table in SNAPSHOT_TABLES
            },
            dict(conn.execute("SELECT id, digest FROM digests").fetchall()),
        )
    finally:
        conn.close()


def markers_as_rows(conn: Any, task_id: str) -> None:
    """Write the `done_markers` of `task_id`'s entries out as the marker rows the per-action path writes
    (done, no epoch, empty detail, the entry's `created_at`), so a test can then set one marker as a crash
    would leave it. On either backend (`conn` a store connection)."""
    codes = {code: kind for kind, code in step_entries.DONE_CODES.items()}
    for step_id, seq, done, at in conn.execute(
        "SELECT step_id, entry_seq, done_markers, created_at FROM step_entries"
        " WHERE task_id = ? AND done_markers IS NOT NULL",
        (task_id,),
    ).fetchall():
        for code, position in re.findall(r"([a-z])(\d+)", done):
            conn.execute(
                "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch,"
                " detail, updated_at) VALUES (?, ?, ?, ?, ?, 'done', NULL, '', ?)",
                (task_id, step_id, seq, int(position), codes[code], at),
            )
    conn.execute("UPDATE step_entries SET done_markers = NULL WHERE task_id = ?", (task_id,))


def unfolded(
    state: dict[str, list[tuple[Any, ...]]], digests: Mapping[Any, str] | None = None
) -> dict[str, list[tuple[Any, ...]]]:
    """`state` with each entry's `done_markers` (its last column) written out as the marker rows they stand
    for (done, no epoch, empty detail, the entry's `created_at`) and the column left None: the common entry
    keeps on its entry row what the per-action path writes as rows, and the two mean the same markers. With
    `digests` (the `digests` table, id → digest), an entry's declaration digest (its fifth column) and a
    run's config digest (its last) are shown as their digest rather than its id, which depends on the order
    the digests were first kept in."""
    codes = {code: kind for kind, code in step_entries.DONE_CODES.items()}
    shown = {str(key): digest for key, digest in (digests or {}).items()}
    entries, markers = [], list(state["step_entry_markers"])
    for row in state["step_entries"]:
        for code, position in re.findall(r"([a-z])(\d+)", row[-1] or ""):
            markers.append((*row[:3], int(position), codes[code], "done", None, "", row[7]))
        digest = shown.get(str(row[4]), row[4]) if digests is not None else row[4]
        entries.append((*row[:4], digest, *row[5:-1], None))
    folded = {"step_entries": entries, "step_entry_markers": sorted(markers, key=lambda m: m[:5])}
    if digests is not None:
        folded["runs"] = [
            (*row[:-1], None if row[-1] is None else shown.get(str(row[-1]), row[-1]))
            for row in state["runs"]
        ]
    return state | folded
