"""Crash torture for durable step entries: SIGKILL a busy runtime over and over, then check the invariants.

Run: python bench/torture.py [--kills N] [--seed S] [--workers W] [--db PATH] [--common]

The parent starts `python bench/torture.py --child DB`, waits until the child says it is serving (or, for
one kill in five, only until it says it is starting, so some kills land inside startup and the recovery
scan), sleeps a random 20-300 ms (0-15 ms for the early kills), SIGKILLs it and starts the next one. The
child runs a runtime whose `review` step declares

    [clear_decisions,
     ensure_participant_seat{role: reviewer},     (no executor here: an action awaited outside the store)
     queue_run_for_each_participant{role: reviewer, reason: r1},
     queue_run_for_each_participant{role: reviewer, reason: r2}]

with three reviewers seated, and its clear_decisions executor also writes a `clear_audit` row naming the
entry in the same transaction. W concurrent workers create tasks as fast as they can, record a stale review
decision, move them work → review, and sometimes back and forth again (re-entries), forever.

After the last kill the parent counts the entries left open, opens a final runtime (its recovery scan
finishes them) and checks (on-enter-action-dispatch.md, AC-B2, AC-B5, AC-B6, AC-B9):
  - every step entry is terminal;
  - one clear_audit row per entry whose clear_decisions marker is done, none for any other;
  - every run has an on_enter key, no key twice, and for each (entry, fan-out position) marked done exactly
    one run per reviewer; no run for a position not marked done; runs == done fan-out positions x 3;
  - no task sitting in review still has a review decision (every entry's clear ran before it finished).
It prints the figures (last line: JSON) and exits 1 on any violation.

`--common` declares [clear_decisions, queue_run_for_each_participant r1, ... r2] with the built-in
executors instead, so every admission takes the one-savepoint common path and every restart the recovery
scan's set path. Without an executor of its own there is no clear_audit row: the clear is checked through
its marker (one done clear marker per entry, committed with its delete) and the stale decisions, the
fan-outs as above.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import structlog
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries import participants, step_entries
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect, Executor
from onceflow.store.runs import keys
from onceflow.store.writer import open_store

WORKFLOW = """\
id: torture
name: Torture
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: clear_decisions
        - type: ensure_participant_seat
          config: {role: reviewer}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: r1}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: r2}
"""
COMMON_REVIEW = """
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: r1}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: r2}
"""
# `prep` exits with a host action, so an entry from there is admitted in one commit and dispatched in the
# next (the per-action path): kills between them leave open entries with no marker for the set path.
PREP = """  - id: prep
    name: Prep
    position: 2
    events:
      on_exit:
        - type: disable_plan_mode
"""
WORKFLOW_COMMON = (
    WORKFLOW[: WORKFLOW.index("        - type: clear_decisions")] + COMMON_REVIEW.lstrip("\n") + PREP
)
WF, REVIEW = "torture", "review"
REVIEWERS = ("rev-1", "rev-2", "rev-3")
FAN_OUT_POSITIONS = (2, 3)
COMMON_FAN_OUT_POSITIONS = (1, 2)
AUDIT_TABLE = "CREATE TABLE IF NOT EXISTS clear_audit (entry_key TEXT NOT NULL)"


def audited_clear(conn: Any, ctx: ActionContext, action: ActionDecl) -> Effect:
    """The real clear_decisions plus an audit row naming the entry, in the same transaction."""
    effect = DEFAULT_EXECUTORS["clear_decisions"](conn, ctx, action)
    conn.execute("INSERT INTO clear_audit (entry_key) VALUES (?)", (ctx.key_for("audit", "0"),))
    return effect


# ensure_participant_seat gets no executor: it is claimed and finished (skipped, no_executor) in two commits
# of its own, which splits every entry into four commits so kills land between them.
EXECUTORS: dict[str, Executor] = {
    **{kind: executor for kind, executor in DEFAULT_EXECUTORS.items() if kind != "ensure_participant_seat"},
    "clear_decisions": audited_clear,
}


def quiet_logs() -> None:
    """Only warnings and errors, to stderr (stdout is the child's line protocol with the parent)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


# --- child ----------------------------------------------------------------------------------------------


async def _send(rt: Runtime, message: dict[str, Any]) -> Any:
    reply = await rt.send(message)
    if not reply.ok:
        raise RuntimeError(f"{message['type']} failed: {reply.error}")
    return reply.result


def _seat_reviewers_once(conn: sqlite3.Connection) -> None:
    if conn.execute("SELECT COUNT(*) FROM participants").fetchone()[0]:
        return
    for position, agent in enumerate(REVIEWERS):
        participants.add_participant(
            conn,
            workflow_id=WF,
            step_id=REVIEW,
            task_id=None,
            role="reviewer",
            agent_profile_id=agent,
            decision_required=True,
            position=position,
        )


async def _worker(rt: Runtime, prefix: str, rng: random.Random, parent: int, common: bool = False) -> None:
    number = 0
    while os.getppid() == parent:  # never outlive the parent
        task_id = f"{prefix}-{number}"
        number += 1
        start = "prep" if common and rng.random() < 0.5 else "work"  # prep: review entered in two commits
        await _send(rt, {"type": "create_task", "task_id": task_id, "workflow_id": WF, "step_id": start})
        for _ in range(1 + rng.randrange(3)):  # the first entry, then 0-2 re-entries
            await _send(
                rt,
                {
                    "type": "record_decision",
                    "task_id": task_id,
                    "step_id": REVIEW,
                    "decider_type": "agent",
                    "decider_id": "rev-1",
                    "decision": "approved",
                },
            )
            await _send(rt, {"type": "move_task", "task_id": task_id, "step_id": REVIEW})
            await _send(rt, {"type": "move_task", "task_id": task_id, "step_id": start})
        if rng.random() < 0.5:  # leave half of them sitting in review
            await _send(rt, {"type": "move_task", "task_id": task_id, "step_id": REVIEW})


async def child(db: Path, workers: int, seed: int, common: bool = False) -> None:
    quiet_logs()
    parent = os.getppid()
    print("starting", flush=True)
    async with open_store(db) as store:  # the audit table must exist before the recovery scan runs
        await store.transact(lambda conn: conn.execute(AUDIT_TABLE))
    async with open_runtime(db, executors=DEFAULT_EXECUTORS if common else EXECUTORS) as rt:
        workflow = WORKFLOW_COMMON if common else WORKFLOW
        await _send(rt, {"type": "register_workflow", "yaml": workflow, "source": "torture.yml"})
        await rt.services.store.transact(_seat_reviewers_once)
        print("ready", flush=True)
        async with trio.open_nursery() as nursery:
            for n in range(workers):
                worker_rng = random.Random(seed + n)
                nursery.start_soon(_worker, rt, f"{rt.epoch[:12]}-{n}", worker_rng, parent, common)


# --- parent ---------------------------------------------------------------------------------------------


def count_open(db: Path) -> int:
    """Step entries the next start's recovery scan will find open."""
    if not db.exists():
        return 0
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM step_entries WHERE terminal = 0").fetchone()[0])
    except sqlite3.OperationalError:  # not migrated yet
        return 0
    finally:
        conn.close()


def _wait_for(proc: subprocess.Popen[str], line: str, timeout: float) -> bool:
    """Read the child's stdout until `line`; False if it exits first. Kills it after `timeout` seconds."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        while True:
            got = proc.stdout.readline()
            if not got:
                return False
            if got.strip() == line:
                return True
    finally:
        timer.cancel()


def run_kills(
    db: Path, kills: int, workers: int, rng: random.Random, log: Path, common: bool = False
) -> dict[str, Any]:
    open_at_restarts, restarts_with_open, early_kills = 0, 0, 0
    problems: list[str] = []
    with log.open("a") as stderr:
        for _ in range(kills):
            found = count_open(db)
            open_at_restarts += found
            restarts_with_open += found > 0
            early = rng.random() < 0.2
            early_kills += early
            child_seed = str(rng.randrange(2**31))
            proc = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(db),
                    "--workers",
                    str(workers),
                    "--seed",
                    child_seed,
                    *(["--common"] if common else []),
                ],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
            try:
                if not _wait_for(proc, "starting" if early else "ready", timeout=60):
                    problems.append(f"child exited before it was serving (rc={proc.wait()}), see {log}")
                    break
                time.sleep(rng.uniform(0, 0.015) if early else rng.uniform(0.02, 0.3))
                if proc.poll() is not None:
                    problems.append(f"child died on its own (rc={proc.returncode}), see {log}")
                    break
                proc.send_signal(signal.SIGKILL)
            finally:
                proc.kill()
                proc.wait()
                assert proc.stdout is not None
                proc.stdout.close()
    return {
        "open_at_restarts": open_at_restarts,
        "restarts_with_open_entries": restarts_with_open,
        "early_kills": early_kills,
        "violations": problems,
    }


def _parse_key(key: str) -> tuple[tuple[str, str, int], int, str]:
    """`on_enter:<task>:<step>:<seq>:<position>:<agent>:<digest>` → ((task, step, seq), position, agent)."""
    prefix, task_id, step_id, seq, position, agent, _digest = key.split(":")
    if prefix != "on_enter":
        raise ValueError(key)
    return (task_id, step_id, int(seq)), int(position), agent


def check(conn: sqlite3.Connection, common: bool = False) -> dict[str, Any]:
    """Every invariant over the recovered database; returns the figures and the violations found."""
    violations: list[str] = []
    entries = {
        (task, step, seq): bool(terminal)
        for task, step, seq, terminal in conn.execute(
            "SELECT task_id, step_id, entry_seq, terminal FROM step_entries"
        )
    }
    markers = {
        ((task, step, seq), position): (kind, state)
        for task, step, seq, position, kind, state in conn.execute(
            "SELECT task_id, step_id, entry_seq, position, kind, state FROM step_entry_markers"
        )
    }
    for task, step, seq, done in conn.execute(  # done markers kept on their entry's row
        "SELECT task_id, step_id, entry_seq, done_markers FROM step_entries WHERE done_markers IS NOT NULL"
    ):
        for position, marker in step_entries.done_of(done).items():
            markers.setdefault(((task, step, seq), position), (marker.kind, marker.state))
    open_entries = [entry for entry, terminal in entries.items() if not terminal]
    if open_entries:
        violations.append(f"{len(open_entries)} entries still open, e.g. {open_entries[:3]}")

    audits: Counter[tuple[str, str, int]] = Counter()
    for (key,) in conn.execute("SELECT entry_key FROM clear_audit"):
        entry, position, _ = _parse_key(key)
        audits[entry] += 1
        if position != 0:
            violations.append(f"clear audited at position {position}: {key}")
    clears_done = 0
    for entry in entries:
        clear = markers.get((entry, 0))
        expected = 1 if clear == ("clear_decisions", "done") else 0
        clears_done += expected
        if common and not expected:  # a fresh entry's clear cannot fail: its marker is done
            violations.append(f"entry {entry}: clear marker {clear}, expected done")
        elif not common and audits[entry] != expected:
            violations.append(
                f"entry {entry}: {audits[entry]} committed clears, expected {expected} ({clear})"
            )
    for entry in set(audits) - set(entries):
        violations.append(f"clear audited for an entry that does not exist: {entry}")

    runs: Counter[tuple[tuple[str, str, int], int]] = Counter()
    agents: dict[tuple[tuple[str, str, int], int], set[str]] = {}
    total_runs = 0
    by_key = f"SELECT {keys.STORED_KEY_SQL} AS k, COUNT(*) FROM runs GROUP BY k"
    for key, count in conn.execute(by_key):
        total_runs += count
        if key is None:
            violations.append(f"{count} runs without an idempotency key")
            continue
        if count != 1:
            violations.append(f"{count} runs share the key {key}")
        entry, position, agent = _parse_key(key)
        runs[(entry, position)] += count
        agents.setdefault((entry, position), set()).add(agent)
    fan_outs_done = 0
    for entry in entries:
        for position in COMMON_FAN_OUT_POSITIONS if common else FAN_OUT_POSITIONS:
            done = markers.get((entry, position)) == ("queue_run_for_each_participant", "done")
            fan_outs_done += done
            expected = len(REVIEWERS) if done else 0
            if runs[(entry, position)] != expected:
                violations.append(
                    f"entry {entry} position {position}: {runs[(entry, position)]} runs, expected {expected}"
                )
            elif done and agents[(entry, position)] != set(REVIEWERS):
                violations.append(f"entry {entry} position {position}: runs for {agents[(entry, position)]}")
    if total_runs != fan_outs_done * len(REVIEWERS):
        violations.append(f"{total_runs} runs, expected {fan_outs_done} done fan-outs x {len(REVIEWERS)}")

    stale = conn.execute(
        "SELECT COUNT(*) FROM decisions d JOIN tasks t ON t.id = d.task_id"
        " WHERE t.workflow_step_id = ? AND d.step_id = ?",
        (REVIEW, REVIEW),
    ).fetchone()[0]
    if stale:
        violations.append(f"{stale} review decisions left on tasks sitting in review")

    states = Counter(state for _, state in markers.values())
    return {
        "tasks": conn.execute("SELECT COUNT(*) FROM tasks").fetchone()[0],
        "entries": len(entries),
        "clears_committed": sum(audits.values()),
        "clears_done": clears_done,
        "fan_outs_done": fan_outs_done,
        "runs": total_runs,
        "marker_states": dict(states),
        "violations": violations,
    }


async def final_check(db: Path, common: bool = False) -> dict[str, Any]:
    executors = DEFAULT_EXECUTORS if common else EXECUTORS
    async with open_runtime(db, executors=executors) as rt:  # the recovery scan runs inside
        return await rt.services.store.transact(lambda conn: check(conn, common))


def parent(db: Path, kills: int, seed: int, workers: int, common: bool = False) -> int:
    quiet_logs()
    rng = random.Random(seed)
    log = db.with_suffix(".children.log")
    started = time.monotonic()
    figures: dict[str, Any] = {"kills": kills, "seed": seed, "workers": workers, "common": common}
    killed = run_kills(db, kills, workers, rng, log, common)
    figures["open_before_final"] = count_open(db)
    figures["open_at_restarts"] = killed["open_at_restarts"] + figures["open_before_final"]
    figures["restarts_with_open_entries"] = killed["restarts_with_open_entries"] + (
        figures["open_before_final"] > 0
    )
    figures["early_kills"] = killed["early_kills"]
    checked = trio.run(final_check, db, common)
    violations = killed["violations"] + checked.pop("violations")
    figures.update(checked)
    figures["seconds"] = round(time.monotonic() - started, 1)
    figures["violations"] = violations
    for name, value in figures.items():
        if name != "violations":
            print(f"{name:>28}: {value}")
    for violation in violations[:20]:
        print(f"VIOLATION: {violation}")
    print(json.dumps(figures))
    return 1 if violations else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", metavar="DB", help="run the child runtime on DB (used by the parent)")
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--db", type=Path, default=None, help="database file (default: a temporary one)")
    parser.add_argument("--common", action="store_true", help="built-in executors only: the common paths")
    args = parser.parse_args()
    if args.child:
        trio.run(child, Path(args.child), args.workers, args.seed or 0, args.common)
        return 0
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    if args.db is not None:
        return parent(args.db, args.kills, seed, args.workers, args.common)
    with tempfile.TemporaryDirectory(prefix="onceflow-torture-") as tmp:
        return parent(Path(tmp) / "torture.db", args.kills, seed, args.workers, args.common)


if __name__ == "__main__":
    sys.exit(main())
