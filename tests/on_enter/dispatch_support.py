"""Helpers for the on_enter dispatch acceptance tests (on-enter-action-dispatch.md, groups A, C, D, E, G, H).

Every entry is driven through the protocol, never through the dispatcher: `enter(rt, path, task_id)` moves a
task into `disp/review` by the real command of entry path E1 (turn_complete), E2 (move_task), E3 (a WIP
promotion: the task waits queued at review until a blocker leaves), E4 (switch_workflow from `side`) or E5
(update_task / start_task with a step_id). `Spy` is the host and the executor wrapper that records, in one
timeline, every session action, every engine-owned executor call and every code-review start.
"""

from __future__ import annotations

import sqlite3
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import trio
from helpers import list_entries, list_runs, ok, register

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Event
from onceflow.protocol.host import SessionActionRequest
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect, Executor
from onceflow.testing import RecordingHost

WF = "disp"
SIDE = "side"
STEP = "review"

PATHS = ("E1", "E2", "E3", "E4", "E5_update", "E5_start")
"""Every entry path, E5 through both of its sites (the generic task update and task start)."""
HOISTING_PATHS = tuple(p for p in PATHS if p != "E4")
"""The paths where processOnEnter's fixed positions apply (AC-A9): E1-E3 and E5."""

SESSION_KINDS = (
    "reset_agent_context",
    "configure_session",
    "enable_plan_mode",
    "set_session_mode",
    "auto_start_agent",
)

_DISP = """\
id: disp
name: Dispatch
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_turn_complete:
        - type: move_to_step
          config: {{step_id: review}}
{work_extra}
  - id: review
    name: Review
    position: 1
    wip_limit: {wip_limit}
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

_SIDE = """\
id: side
name: Side
steps:
  - {id: intake, name: Intake, position: 0, is_start_step: true}
"""

CONFIGURE = "{rules: [{agent_name: coder, operation: set, model: big}]}"
"""A valid configure_session config."""


def block(actions: str, indent: int = 8) -> str:
    text = textwrap.dedent(actions).strip() or "[]"
    return textwrap.indent(text, " " * indent)


def disp_yaml(review: str, *, wip_limit: int = 0, work_extra: str = "") -> str:
    return _DISP.format(review=block(review), wip_limit=wip_limit, work_extra=work_extra)


async def setup(
    rt: Runtime,
    review: str,
    *,
    path: str = "E2",
    reviewers: tuple[str, ...] = ("rev-a", "rev-b"),
    work_extra: str = "",
) -> None:
    """Register `disp` with `review` as Review's on_enter list (and `side`); seat `reviewers` at review.

    For E3 review gets a WIP limit of one, so the entering task can be made to wait for a slot.
    """
    await register(
        rt, disp_yaml(review, wip_limit=1 if path == "E3" else 0, work_extra=work_extra), import_path=True
    )
    await register(rt, _SIDE, import_path=True)
    for agent in reviewers:
        await seat(rt, "reviewer", agent)


async def seat(
    rt: Runtime,
    role: str,
    agent: str,
    *,
    task_id: str | None = None,
    position: int = 0,
    decision_required: bool = True,
    step_id: str = STEP,
) -> int:
    """A participant row at `step_id` (per-task when `task_id` is given); returns its id."""
    message: dict[str, Any] = {
        "type": "add_participant",
        "workflow_id": WF,
        "step_id": step_id,
        "role": role,
        "agent_profile_id": agent,
        "position": position,
        "decision_required": decision_required,
    }
    if task_id is not None:
        message["task_id"] = task_id
    return int((await ok(rt, message)).result["participant_id"])


async def create(
    rt: Runtime,
    task_id: str,
    *,
    workflow_id: str = WF,
    step_id: str = "work",
    session: bool = True,
    primary: str | None = "worker",
) -> None:
    message: dict[str, Any] = {
        "type": "create_task",
        "task_id": task_id,
        "workflow_id": workflow_id,
        "step_id": step_id,
        "ceo_agent_id": "ceo",
    }
    if session:
        message["session_id"] = f"s-{task_id}"
    if primary is not None:
        message["primary_agent_id"] = primary
    await ok(rt, message)


_COMMANDS: dict[str, Callable[[str], dict[str, Any]]] = {
    "E1": lambda t: {"type": "turn_complete", "task_id": t},
    "E2": lambda t: {"type": "move_task", "task_id": t, "step_id": STEP},
    "E4": lambda t: {"type": "switch_workflow", "task_id": t, "workflow_id": WF, "step_id": STEP},
    "E5_update": lambda t: {"type": "update_task", "task_id": t, "step_id": STEP},
    "E5_start": lambda t: {"type": "start_task", "task_id": t, "step_id": STEP},
}


async def enter(
    rt: Runtime, path: str, task_id: str = "T1", *, session: bool = True, created: bool = False
) -> list[Event]:
    """Drive `task_id` into disp/review through entry path `path`; return the events of that entry.

    The task is created first (in disp/work, or side/intake for E4) unless `created`. For E3 `setup` must
    have been called with path="E3": a blocker occupies review's only slot, the task is queued behind it,
    the blocker leaves and the promotion admits the task; the events are those of the promoted dispatch.
    """
    if not created:
        await create(
            rt, task_id, workflow_id=SIDE if path == "E4" else WF, step_id=_source(path), session=session
        )
    if path == "E3":
        events = await _promote(rt, task_id)
    else:
        events = list((await ok(rt, _COMMANDS[path](task_id))).events)
    task = (await ok(rt, {"type": "get_task", "task_id": task_id})).result
    assert (task["workflow_id"], task["step_id"], task["wip_admitted"]) == (WF, STEP, True)
    return events


def _source(path: str) -> str:
    return "intake" if path == "E4" else "work"


async def _promote(rt: Runtime, task_id: str) -> list[Event]:
    blocker = f"{task_id}-blocker"
    await create(rt, blocker, step_id=STEP)  # creation is not an entry: it just holds the slot
    queued = await ok(rt, {"type": "move_task", "task_id": task_id, "step_id": STEP})
    assert [e.type for e in queued.events] == ["transition", "task_queued"]
    stream = rt.subscribe()
    await ok(rt, {"type": "move_task", "task_id": blocker, "step_id": "done"})
    events: list[Event] = []
    with trio.fail_after(5):
        async for event in stream:
            if events or (event.type == "step_entered" and event.task_id == task_id):
                events.append(event)
                if event.type == "step_entered":
                    assert event.entry_path == "E3"
                    break
    await ok(rt, {"type": "get_task", "task_id": task_id})  # queued behind the promoted dispatch
    while True:
        try:
            events.append(stream.receive_nowait())
        except trio.WouldBlock:
            return events


# --- the spy ----------------------------------------------------------------------------------------


def label(kind: str, config: Mapping[str, Any]) -> str:
    """What tells two declarations of one kind apart in a timeline: a mode, a reason or a target."""
    for name in ("mode", "reason", "target", "agent_profile_id"):
        if config.get(name):
            return str(config[name])
    return ""


class Spy(RecordingHost):
    """A RecordingHost that also keeps one ordered timeline of (task_id, kind, label) for everything done.

    `wrap(executors)` returns the executors recording their calls into the same timeline; every session
    kind gets a registry executor too, which records ("registry", kind) if anything ever calls it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.timeline: list[tuple[str, str, str]] = []
        self.registry_calls: list[str] = []

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        self.timeline.append((request.task_id, request.action, label(request.action, request.config)))
        await super().perform_session_action(request)

    async def start_code_review(self, **launch: Any) -> None:
        self.timeline.append((launch["task_id"], "run_code_review", launch["agent_profile_id"] or ""))
        await super().start_code_review(**launch)

    def wrap(self, executors: Mapping[str, Executor] = DEFAULT_EXECUTORS) -> dict[str, Executor]:
        def recording(real: Executor) -> Executor:
            def executor(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
                config = action.config.model_dump(mode="json", exclude_none=True)
                self.timeline.append((ctx.task.id, action.type, label(action.type, config)))
                return real(conn, ctx, action)

            return executor

        def registry(kind: str) -> Executor:
            def executor(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
                self.registry_calls.append(kind)
                return Effect("done")

            return executor

        return {**{k: registry(k) for k in SESSION_KINDS}, **{k: recording(v) for k, v in executors.items()}}

    def kinds(self, task_id: str = "T1") -> list[str]:
        return [kind for task, kind, _ in self.timeline if task == task_id]

    def calls(self, task_id: str = "T1") -> list[tuple[str, str]]:
        return [(kind, text) for task, kind, text in self.timeline if task == task_id]


def spy_on(rt: Runtime, spy: Spy | None = None, executors: Mapping[str, Executor] = DEFAULT_EXECUTORS) -> Spy:
    """Make `spy` (a fresh Spy by default) the runtime's host and wrap `executors` with it."""
    spy = spy if spy is not None else Spy()
    rt.reconfigure(host=spy, executors=spy.wrap(executors))
    return spy


class ReviewDown(Spy):
    """A host whose code-review backend refuses every start (AC-A8's forced failure)."""

    async def start_code_review(self, **launch: Any) -> None:
        self.timeline.append((launch["task_id"], "run_code_review", launch["agent_profile_id"] or ""))
        raise RuntimeError("review backend down")


# --- failing executors ------------------------------------------------------------------------------


class _RunInsertFails:
    """A connection on which inserting a run for `agent` fails (the enqueue of that one participant)."""

    def __init__(self, conn: sqlite3.Connection, agent: str) -> None:
        self._conn, self._agent = conn, agent

    def execute(self, sql: str, params: Any = ()) -> Any:
        if sql.startswith("INSERT INTO runs") and params and params[0] == self._agent:
            raise sqlite3.IntegrityError(f"runs rejected {self._agent}")
        return self._conn.execute(sql, params)

    @property
    def in_transaction(self) -> bool:  # the fan-out asks whether its transaction survived the error
        return self._conn.in_transaction


def fan_out_failing_for(agent: str) -> Executor:
    """The real fan-out, except that enqueuing a run for `agent` raises a database error."""
    real = DEFAULT_EXECUTORS["queue_run_for_each_participant"]

    def executor(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        return real(_RunInsertFails(conn, agent), ctx, action)  # type: ignore[arg-type]

    return executor


def clear_failing(how: str) -> Executor:
    """A clear_decisions that fails: by raising a database error, or by reporting failure."""

    def executor(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        if how == "raises":
            raise sqlite3.OperationalError("disk I/O error")
        return Effect("failed", "decisions table unavailable")

    return executor


def without(*kinds: str) -> dict[str, Executor]:
    """The default executors minus `kinds` (an adapter left unwired)."""
    return {k: v for k, v in DEFAULT_EXECUTORS.items() if k not in kinds}


# --- reading state ----------------------------------------------------------------------------------


async def entries(rt: Runtime, task_id: str = "T1") -> list[dict[str, Any]]:
    return await list_entries(rt, task_id)


async def markers(rt: Runtime, task_id: str = "T1", entry_seq: int = 1) -> list[tuple[int, str, str, str]]:
    """(position, kind, state, detail) of the task's review entry `entry_seq`."""
    [entry] = [e for e in await entries(rt, task_id) if e["step_id"] == STEP and e["entry_seq"] == entry_seq]
    return [(m["position"], m["kind"], m["state"], m["detail"]) for m in entry["markers"]]


async def runs(rt: Runtime, **filters: Any) -> list[dict[str, Any]]:
    rows = await list_runs(rt, **filters)
    return sorted(rows, key=lambda r: r["id"])


async def decisions(rt: Runtime, task_id: str, step_id: str) -> list[int]:
    reply = await ok(rt, {"type": "list_decisions", "task_id": task_id, "step_id": step_id})
    return [d["id"] for d in reply.result["decisions"]]


async def decide(rt: Runtime, task_id: str, step_id: str, decider: str = "rev-a") -> None:
    """An approval (no transition follows: only a reject moves the task back from review)."""
    await ok(
        rt,
        {
            "type": "record_decision",
            "task_id": task_id,
            "step_id": step_id,
            "decider_type": "agent",
            "decider_id": decider,
            "role": "reviewer",
            "decision": "approved",
        },
    )


def diags(events: list[Event], code: str | None = None, level: str | None = None) -> list[Any]:
    """Diagnostic events, optionally of one code and/or level."""
    return [
        e
        for e in events
        if e.type == "diagnostic" and (code is None or e.code == code) and (level is None or e.level == level)
    ]


def loud(events: list[Event]) -> list[tuple[str, str]]:
    """(level, code) of every warning or error diagnostic."""
    return [(e.level, e.code) for e in diags(events) if e.level in ("warning", "error")]


def records(logs: list[dict[str, Any]], event: str, level: str | None = None) -> list[dict[str, Any]]:
    """Captured structlog records named `event` (at `level`, when given)."""
    return [r for r in logs if r["event"] == event and (level is None or r["log_level"] == level)]


def key_digest(idempotency_key: str) -> str:
    """The config digest of an on_enter run key `on_enter:<task>:<step>:<seq>:<position>:<agent>:<digest>`."""
    return idempotency_key.rsplit(":", 1)[1]


def key_position(idempotency_key: str) -> int:
    return int(idempotency_key.split(":")[4])


def key_seq(idempotency_key: str) -> int:
    return int(idempotency_key.split(":")[3])
