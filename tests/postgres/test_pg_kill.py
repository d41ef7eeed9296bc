"""Three runtime processes on one PostgreSQL database, SIGKILLed at random and restarted.

Each runtime is `onceflow serve --db postgresql://… --socket …` in its own process. Driver threads push
the Office Default rejection-then-approval script for a stream of tasks, every command to a random live
runtime. Every decision is sent at once to two different runtimes (the same decision id twice), and both
round-2 approvals together, so two runtimes serve one task's commands concurrently: only the per-task lock
makes the second copy a replay (without it both copies insert the decision and one fails on the receipt's
key, or the quorum is judged on a snapshot missing the other approval). Each task's own seats are sent at
once to every runtime too: a seat is a check-then-insert with no unique key behind it, so without the lock
two runtimes both find none and both insert it, a lost update no reply shows (the seat count catches it:
about one task in four doubled a seat when the lock was disabled). A command whose reply never came
(its runtime was killed) is sent again to another runtime unless the task shows it took effect (decisions
carry ids, so they are simply sent again). Meanwhile one runtime at a time is SIGKILLed and restarted, at
least `KILLS` times. Afterwards, compared with the same script run once on SQLite without any kill, per
task: the same final step; exactly the same runs (no enqueue ran twice or was lost, no second clear dropped
a decision); the same decisions, each with one receipt (none applied twice); the same step entries, their
sequence numbers per step 1..n without a gap or duplicate; the same admissions counter (one per step
entered, whether or not the step allocates an entry record), equal to the history's transitions that
entered a step; the same history items, numbered 1..n; and the same seats. No idempotency key is both a
run's and a coalesced one, no entry is left open with a claim of a dead epoch (a live runtime finished every
one), and every reply a driver got was as expected (a failure in a sending thread fails the test).
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import select
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "facade"))
from wire_client import WireClient

from onceflow.actors.runtime.startup import open_runtime
from onceflow.store.tasks.history import transition_item

TESTS = Path(__file__).resolve().parents[1]
OFFICE = TESTS / "fixtures" / "kandev" / "office-default.yml"
KILLS = 30
RUNTIMES = 3
DRIVERS = 3
SEATS_PER_TASK = 2  # each sent at once to every runtime: a check-then-insert two runtimes race on

SEATS = [
    {"type": "add_participant", "workflow_id": "office-default", "step_id": "review", "role": "reviewer",
     "agent_profile_id": "reviewer-1", "position": 0},
    {"type": "add_participant", "workflow_id": "office-default", "step_id": "review", "role": "reviewer",
     "agent_profile_id": "reviewer-2", "position": 1},
    {"type": "add_participant", "workflow_id": "office-default", "step_id": "approval", "role": "approver",
     "agent_profile_id": "approver-1"},
]  # fmt: skip


def _decision(task: str, step: str, who: str, role: str, verdict: str, round_: int) -> dict[str, Any]:
    return {
        "type": "record_decision", "task_id": task, "step_id": step, "decider_type": "agent",
        "decider_id": who, "role": role, "decision": verdict, "decision_id": f"{task}-r{round_}-{who}",
    }  # fmt: skip


def _own_seat(task: str, position: int) -> dict[str, Any]:
    """A per-task seat no guard counts and no run is queued for (an agentless watcher at backlog)."""
    return {"type": "add_participant", "task_id": task, "step_id": "backlog", "role": "watcher",
            "decision_required": False, "position": position}  # fmt: skip


def script(task: str) -> list[list[dict[str, Any]]]:
    """The task's commands in order; the commands of one inner list are sent at once to several runtimes."""
    return [
        [{"type": "create_task", "task_id": task, "workflow_id": "office-default", "step_id": "backlog",
          "session_id": f"s-{task}", "primary_agent_id": "worker"}],
        [_own_seat(task, position) for position in range(SEATS_PER_TASK)] * RUNTIMES,
        [{"type": "move_task", "task_id": task, "step_id": "work"}],
        [{"type": "turn_complete", "task_id": task}],
        [_decision(task, "review", "reviewer-1", "reviewer", "rejected", 1)] * 2,
        [{"type": "turn_complete", "task_id": task}],
        [_decision(task, "review", "reviewer-1", "reviewer", "approved", 2)] * 2
        + [_decision(task, "review", "reviewer-2", "reviewer", "approved", 2)] * 2,
        [_decision(task, "approval", "approver-1", "approver", "approved", 1)] * 2,
    ]  # fmt: skip


# What a task's rows say, one query each (`?` is its id); compared with the kill-free SQLite run.
FACTS = {
    "decisions": "SELECT step_id, decider_id, decision FROM decisions WHERE task_id = ?",
    "receipts": "SELECT r.step_id, replace(r.external_id, r.task_id, '') FROM decision_receipts AS r"
    " JOIN decisions AS d ON d.id = r.decision_id WHERE r.task_id = ?",
    "entries": "SELECT step_id, entry_seq, entry_path, terminal FROM step_entries WHERE task_id = ?",
    "admissions": "SELECT admissions FROM tasks WHERE id = ?",
    "seats": "SELECT step_id, role, agent_profile_id, position FROM participants WHERE task_id = ?",
    "history": "SELECT seq, kind, detail FROM task_history WHERE task_id = ?",
}


def facts(conn: Any, task: str) -> dict[str, list[tuple[Any, ...]]]:
    """The task's FACTS, each sorted (a psycopg or sqlite3 connection; `?` becomes `%s` for psycopg)."""
    mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
    found = {
        name: sorted(tuple(row) for row in conn.execute(sql.replace("?", mark), (task,)).fetchall())
        for name, sql in FACTS.items()
    }
    found["history"], found["numbered"] = history(found["history"])
    return found


def history(rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The task's history items as comparable facts (seq, times, row and operation ids left out: they
    differ between runs), and [(whether its seqs are 1..n, the transitions that entered a step)]."""
    items: list[tuple[Any, ...]] = []
    entered = 0
    for _, kind, detail in rows:
        fields = json.loads(detail)
        if kind == "transition":
            fields = transition_item(fields)  # as task_history tells it: the stored defaults put back
            items.append(
                (kind, fields["from_step"], fields["to_step"], fields["entry_seq"], fields["queued"])
            )
            entered += not fields["queued"]
        elif kind == "decision":
            items.append((kind, fields["step_id"], fields["decider_id"], fields["decision"]))
        else:
            items.append((kind,))
    seqs = [int(seq) for seq, _, _ in rows]  # rows are sorted
    return sorted(items), [(seqs == list(range(1, len(seqs) + 1)), entered)]


def counted(found: dict[str, list[tuple[Any, ...]]]) -> bool:
    """The task's history is numbered 1..n without a gap or duplicate, and its admissions counter equals
    the transitions that entered a step (each admission is a read-modify-write of the task row, written
    with its history item: a lost one leaves the counter and the history apart)."""
    ((numbered, entered),) = found["numbered"]
    return numbered and found["admissions"] == [(entered,)]


def gapless(entries: list[tuple[Any, ...]]) -> bool:
    """Each step's entry sequence numbers are 1..n: none skipped, none twice."""
    seqs: dict[str, list[int]] = collections.defaultdict(list)
    for step, seq, *_ in entries:
        seqs[step].append(int(seq))
    return all(sorted(numbers) == list(range(1, len(numbers) + 1)) for numbers in seqs.values())


async def baseline(
    tmp: Path,
) -> tuple[list[str], list[tuple[str, str, str]], dict[str, list[tuple[Any, ...]]]]:
    """Per command group, the task's step after it; the task's runs; and its FACTS, on SQLite in one
    process."""
    steps: list[str] = []
    async with open_runtime(tmp / "baseline.db") as rt:
        await rt.send({"type": "register_workflow", "yaml": OFFICE.read_text(), "source": OFFICE.name})
        for seat in SEATS:
            assert (await rt.send(seat)).ok
        for group in script("T0"):
            for command in group:
                assert (await rt.send(command)).ok, command
            steps.append((await rt.send({"type": "get_task", "task_id": "T0"})).result["step_id"])
        runs = (await rt.send({"type": "list_runs", "task_id": "T0"})).result["runs"]
    with contextlib.closing(sqlite3.connect(tmp / "baseline.db")) as conn:
        expected = facts(conn, "T0")
    assert gapless(expected["entries"])
    assert counted(expected)
    assert len(expected["seats"]) == SEATS_PER_TASK
    assert len(expected["decisions"]) == len(expected["receipts"]) > 0
    return steps, sorted((r["step_id"], r["agent_profile_id"], r["reason"]) for r in runs), expected


class Cluster:
    """`runtimes` `onceflow serve` processes on one database, started with `args` (the Office workflow by
    default), each on its socket in `folder`; `kill_one` SIGKILLs one at random and restarts it
    (`kill_and_restart`); `up[i]` is set while runtime i serves."""

    def __init__(
        self,
        url: str,
        folder: Path,
        runtimes: int = RUNTIMES,
        args: tuple[str, ...] = ("--workflow", str(OFFICE)),
    ) -> None:
        self.url, self.folder, self.args = url, folder, args
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * runtimes
        self.up = [threading.Event() for _ in range(runtimes)]
        self.kills = 0
        for index in range(runtimes):
            self.start(index)

    def socket(self, index: int) -> str:
        return str(self.folder / f"r{index}.sock")

    def start(self, index: int) -> None:
        command = [sys.executable, "-m", "onceflow.cli", "serve", "--db", self.url, *self.args,
                   "--socket", self.socket(index)]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert process.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([process.stderr], [], [], 0.1)
            if ready:
                line = process.stderr.readline().decode()
                assert line, f"runtime {index} exited before serving (status {process.wait()})"
                if line.startswith("serving on "):
                    break
        else:
            raise AssertionError(f"runtime {index} did not start")
        threading.Thread(target=_drain, args=(process,), daemon=True).start()
        self.processes[index] = process
        self.up[index].set()

    def kill_one(self, rng: random.Random) -> None:
        self.kill_and_restart(rng.randrange(len(self.processes)))

    def kill_and_restart(self, index: int) -> None:
        """SIGKILL runtime `index` and start it again on the same socket."""
        process = self.processes[index]
        assert process is not None
        self.up[index].clear()
        process.send_signal(signal.SIGKILL)
        process.wait()
        self.kills += 1
        self.start(index)

    def stop(self) -> None:
        for process in self.processes:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


def _drain(process: subprocess.Popen[bytes]) -> None:
    assert process.stderr is not None
    for _ in process.stderr:
        pass


def send(
    cluster: Cluster, command: dict[str, Any], rng: random.Random, index: int | None = None
) -> dict[str, Any] | None:
    """Send `command` to runtime `index` (default: a random one) once it is live; its reply, or None when
    the runtime died first."""
    index = rng.randrange(RUNTIMES) if index is None else index
    cluster.up[index].wait(60)
    try:
        client = WireClient(cluster.socket(index), timeout=30)
    except OSError:
        return None
    try:
        frame = client.request({"id": 1, **command})
        return frame["reply"]  # type: ignore[no-any-return]
    except (OSError, AssertionError, json.JSONDecodeError):
        return None
    finally:
        client.close()


def step_of(cluster: Cluster, task: str, rng: random.Random) -> str | None:
    while True:
        reply = send(cluster, {"type": "get_task", "task_id": task}, rng)
        if reply is not None:
            return reply["result"]["step_id"] if reply["ok"] else None


def deliver(
    cluster: Cluster, command: dict[str, Any], expected_step: str, rng: random.Random, first: int
) -> None:
    """Deliver one command at least once, and at most once where a resend would not be a no-op: first to
    runtime `first`, resends to random ones."""
    index: int | None = first
    while True:
        reply, index = send(cluster, command, rng, index), None
        if reply is not None:
            if not reply["ok"] and reply["error"]["code"] in ("storage_io", "storage_busy", "shutting_down"):
                continue  # nothing committed (retryable)
            if command["type"] == "create_task" and not reply["ok"]:
                assert reply["error"]["code"] == "conflict", reply
            else:
                assert reply["ok"], (command, reply["error"])
            return
        if command["type"] in ("record_decision", "add_participant"):
            continue  # a resend is a no-op: its decision id, or the identical seat
        if command["type"] == "create_task" or step_of(cluster, command["task_id"], rng) != expected_step:
            continue  # did not take effect (a create resent after it did is refused as a conflict)
        return


def reporting(errors: list[BaseException], *args: Any) -> None:
    """`deliver(*args)`, its failure added to `errors` (a thread's exception would only be a warning)."""
    try:
        deliver(*args)
    except BaseException as exc:
        errors.append(exc)


def drive(
    cluster: Cluster, tasks: list[str], steps: list[str], seed: int, errors: list[BaseException]
) -> None:
    rng = random.Random(seed)
    try:
        for task in tasks:
            for group, expected in zip(script(task), steps, strict=True):
                # the copies of one command go to different runtimes at once
                copies = collections.Counter(json.dumps(command, sort_keys=True) for command in group)
                targets = {text: rng.sample(range(RUNTIMES), count) for text, count in copies.items()}
                threads = []
                for command in group:
                    first = targets[json.dumps(command, sort_keys=True)].pop()
                    own = random.Random(rng.random())
                    threads.append(
                        threading.Thread(
                            target=reporting, args=(errors, cluster, command, expected, own, first)
                        )
                    )
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
    except BaseException as exc:
        errors.append(exc)


async def test_three_runtimes_sigkilled_30_times_lose_nothing_and_apply_nothing_twice(
    pg_url: str, tmp_path: Path
) -> None:
    steps, expected_runs, expected_facts = await baseline(tmp_path)
    async with open_runtime(pg_url) as rt:  # seats first, from one runtime
        await rt.send({"type": "register_workflow", "yaml": OFFICE.read_text(), "source": OFFICE.name})
        for seat in SEATS:
            assert (await rt.send(seat)).ok
    folder = Path(tempfile.mkdtemp(prefix="of-kill-", dir="/tmp"))
    cluster = Cluster(pg_url, folder)
    rng = random.Random(15)
    errors: list[BaseException] = []
    tasks: list[str] = []
    try:
        drivers: list[threading.Thread] = []
        batch = 0
        while cluster.kills < KILLS:
            if not any(d.is_alive() for d in drivers):  # keep the stream going until every kill is done
                drivers = []
                for n in range(DRIVERS):
                    mine = [f"K{batch}-{n}-{i}" for i in range(4)]
                    tasks.extend(mine)
                    drivers.append(
                        threading.Thread(target=drive, args=(cluster, mine, steps, rng.random(), errors))
                    )
                    drivers[-1].start()
                batch += 1
            time.sleep(rng.uniform(0.1, 0.5))
            cluster.kill_one(rng)
        for driver in drivers:
            driver.join(timeout=300)
        deadline = time.monotonic() + 30  # a claim the last kill left: the survivors' sweeps finish it
        while _open_claims(pg_url) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        cluster.stop()
    assert cluster.kills >= KILLS

    with psycopg.connect(pg_url) as conn:
        finals = dict(conn.execute("SELECT id, workflow_step_id FROM tasks").fetchall())
        runs: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
        for task_id, step, agent, reason in conn.execute(
            "SELECT task_id, workflow_step_id, agent_profile_id, reason FROM runs"
        ):
            runs[task_id].append((step, agent, reason))
        both = conn.execute(
            "SELECT count(*) FROM coalesced_keys AS c JOIN runs AS r ON r.idempotency_key = c.idempotency_key"
        ).fetchone()
        found = {task: facts(conn, task) for task in tasks}
    assert {task: finals.get(task) for task in tasks} == {task: steps[-1] for task in tasks}
    assert {task: sorted(runs[task]) for task in tasks} == {task: expected_runs for task in tasks}
    seats = {task: len(found[task]["seats"]) for task in tasks}
    doubled = {task: count for task, count in seats.items() if count > SEATS_PER_TASK}
    assert not doubled, f"per-task seats added twice, by two runtimes at once (task: its seats): {doubled}"
    assert not errors, errors
    assert {task: found[task] for task in tasks} == {task: expected_facts for task in tasks}
    assert all(gapless(found[task]["entries"]) for task in tasks)  # implied; says what a difference means
    assert all(counted(found[task]) for task in tasks)  # implied too
    assert both == (0,)
    assert _open_claims(pg_url) == 0  # every claim a killed runtime left was finished by a live one


def _open_claims(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM step_entry_markers AS m"
            " JOIN step_entries AS e USING (task_id, step_id, entry_seq)"
            " WHERE m.state = 'in_progress' AND e.terminal = 0"
        ).fetchone()
    assert row is not None
    return int(row[0])
