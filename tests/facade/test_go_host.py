"""The Go host example (examples/go/) against a real `onceflow serve` on the office-default template in
Kandev's format (tests/fixtures/kandev/): built with `go build`, run as its own process, killed with
SIGKILL, stopped with SIGSTOP until the server drops it, stopped with SIGTERM and SIGINT. Python drives
the tasks over the socket (creation, moves, turn_complete, decisions) and plays the agents' verdicts; the
Go host performs the session actions and works the runs.

Checked each time: every call the runtime made was performed exactly once under its call id (the host's
journal against `list_host_calls`), every run the template queued was finished exactly once (the
journal against `list_runs`), and the host's event log holds, from its first event, exactly the events the
runtime's window replays to a fresh `subscribe` with `after` — nothing missed across a reconnect or a
restart, nothing twice. The event checks need a build with resumable subscriptions (`event_seq`); without
one they are skipped, saying so.

Skipped when `go` is not installed, unless ONCEFLOW_REQUIRE_GO=1 (as `.ci/run` sets it), which makes a
missing `go` a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_serve import Served, serving
from wire_client import WireClient

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "go"
TEMPLATE = ROOT / "tests" / "fixtures" / "kandev" / "office-default.yml"
WORKFLOW = "office-default"
SEATS = [("review", "reviewer", "rev-a"), ("review", "reviewer", "rev-b"), ("approval", "approver", "app-a")]
AGENTS = ("worker", "rev-a", "rev-b", "app-a")  # `worker` is every task's primary agent (comment runs)
REQUIRE = "ONCEFLOW_REQUIRE_GO"
RESUMABLE = importlib.util.find_spec("onceflow.protocol.event_stream") is not None
"""Whether this build numbers its events (`event_seq`) and resumes a subscription `after` one."""
NO_SEQ = "this build has no resumable subscriptions (no event_seq on event lines)"


def _go_env(root: Path) -> dict[str, str]:
    """Go's environment under `root`: nothing read from or written to the user's home, nothing downloaded."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(root / "home"),
        "GOCACHE": str(root / "cache"),
        "GOPATH": str(root / "gopath"),
        "GOFLAGS": "-mod=mod",
        "GOPROXY": "off",
        "CGO_ENABLED": "0",
    }


@pytest.fixture(scope="module")
def go_tool(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """The `go` command and its environment; skips without one (fails under ONCEFLOW_REQUIRE_GO=1)."""
    go = shutil.which("go")
    if go is None:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but `go` is not installed (Debian: apt-get install golang-go)")
        pytest.skip(
            f"`go` is not installed, so the Go host example cannot be built ({REQUIRE}=1 fails instead)"
        )
    return go, _go_env(tmp_path_factory.mktemp("go"))


@pytest.fixture(scope="module")
def go_host_binary(go_tool: tuple[str, dict[str, str]]) -> Path:
    """examples/go/ built with `go build`."""
    go, env = go_tool
    binary = Path(env["HOME"]).parent / "onceflow-host"
    built = subprocess.run(
        [go, "build", "-o", str(binary), "."],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    return binary


@dataclass
class GoHost:
    """One Go host process; its stderr (JSON log lines) goes to `log`."""

    process: subprocess.Popen[bytes]
    log: Path

    def logs(self, msg: str) -> list[dict[str, Any]]:
        """Its log entries named `msg`."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [entry for entry in map(json.loads, lines) if entry["msg"] == msg]

    def wait_log(self, msg: str, count: int = 1, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Its first `count` log entries named `msg`, waiting for them."""

        def logged() -> list[dict[str, Any]] | None:
            found = self.logs(msg)
            return found[:count] if len(found) >= count else None

        entries: list[dict[str, Any]] = _until(logged, timeout, f"{self.log.name}: {count} x {msg}")
        return entries

    def stop(self) -> int:
        """SIGTERM; its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)


@contextmanager
def go_host(binary: Path, served: Served, folder: Path, name: str, *extra: str) -> Iterator[GoHost]:
    """A Go host on `served`'s socket, registered, with its journal and event log in `folder` (shared by
    the hosts of one test, as a restarted host finds them); `extra` flags override the defaults."""
    command = [str(binary), "-socket", str(served.socket), "-agents", ",".join(AGENTS)]
    command += ["-out", str(folder / "journal.jsonl"), "-events", str(folder / "events.jsonl")]
    command += ["-lease", "1s", "-wait", "1s", "-work", "300ms", *extra]
    log = folder / f"{name}.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    host = GoHost(process, log)
    try:
        host.wait_log("host_registered")
        yield host
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _until(found: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Board:
    """The driver: Kandev's side of the socket, playing the agents' verdicts."""

    def __init__(self, served: Served) -> None:
        self.client = served.client()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = self.client.request(request)["reply"]
        assert reply["ok"], reply
        return reply

    def create(self, task: str) -> None:
        """A task in Backlog with its session, its primary agent and its reviewer and approver seats."""
        self.ask(
            {
                "type": "create_task",
                "task_id": task,
                "workflow_id": WORKFLOW,
                "step_id": "backlog",
                "session_id": f"session-{task}",
                "primary_agent_id": "worker",
                "ceo_agent_id": "ceo",
            }
        )
        for step, role, agent in SEATS:
            self.ask(
                {
                    "type": "add_participant",
                    "task_id": task,
                    "step_id": step,
                    "role": role,
                    "agent_profile_id": agent,
                }
            )

    def step(self, task: str) -> str:
        step: str = self.ask({"type": "get_task", "task_id": task})["result"]["step_id"]
        return step

    def runs(self, task: str | None = None) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = self.ask({"type": "list_runs", "task_id": task, "limit": 1000})[
            "result"
        ]["runs"]
        return runs

    def runs_finished(self, task: str, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The task's runs once there are `count`, all finished (the Go host works them)."""

        def finished() -> list[dict[str, Any]] | None:
            runs = self.runs(task)
            return runs if len(runs) == count and all(r["status"] == "finished" for r in runs) else None

        found: list[dict[str, Any]] = _until(finished, timeout, f"{count} runs of {task} finished")
        return found

    def decide(self, task: str, step: str, agent: str, decision: str) -> None:
        self.ask(
            {
                "type": "record_decision",
                "task_id": task,
                "step_id": step,
                "decider_type": "agent",
                "decider_id": agent,
                "decision": decision,
            }
        )

    def host_calls(self) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = self.ask({"type": "list_host_calls", "limit": 1000})["result"]["calls"]
        return calls


def to_done(board: Board, task: str, *, runs: int = 0, comment: bool = False, rejected: bool = False) -> None:
    """Take `task` (in Backlog, Work or Review, with `runs` runs so far) on through Review and Approval to
    Done: each reviewer's and the approver's run finished before they decide; `comment` adds a run for the
    primary agent in Work; `rejected` sends it back from Review to Work once (its session action again)."""
    if board.step(task) == "backlog":
        board.ask({"type": "move_task", "task_id": task, "step_id": "work"})  # after the host answered
    if comment:
        board.ask({"type": "task_comment", "task_id": task, "comment_id": f"{task}-comment"})
        runs += 1
        board.runs_finished(task, runs)
    for verdict in ["rejected", "approved"] if rejected else ["approved"]:
        if board.step(task) == "work":
            board.ask({"type": "turn_complete", "task_id": task})  # Work -> Review: a run per reviewer
            runs += 2
        board.runs_finished(task, runs)
        board.decide(task, "review", "rev-a", "approved")
        board.decide(task, "review", "rev-b", verdict)
    assert board.step(task) == "approval"
    runs += 1
    board.runs_finished(task, runs)
    board.decide(task, "approval", "app-a", "approved")
    assert board.step(task) == "done"


def journal_with(folder: Path, finished: set[int]) -> list[dict[str, Any]]:
    """The host's journal once it records each run of `finished`: a worker writes its line after the
    server took the finish (an action's line is written before its call is answered)."""

    def settled() -> list[dict[str, Any]] | None:
        journal = _lines(folder / "journal.jsonl")
        return journal if finished <= {e["run_id"] for e in journal if e["what"] == "run_finished"} else None

    journal: list[dict[str, Any]] = _until(settled, 10.0, f"runs {sorted(finished)} in the journal")
    return journal


def assert_each_call_performed_once_and_each_run_finished_once(board: Board, folder: Path) -> dict[str, int]:
    """The journal against the runtime: one entry per call the runtime made (all answered) and one per run
    it queued (all finished). Returns the calls' attempts by call id."""
    calls = board.host_calls()
    assert calls and all(call["status"] == "answered" for call in calls), calls
    runs = board.runs()
    assert runs and [r["status"] for r in runs] == ["finished"] * len(runs)
    journal = journal_with(folder, {run["id"] for run in runs})
    performed = Counter(e["call_id"] for e in journal if e["what"] in ("session_action", "code_review"))
    assert performed == Counter(call["call_id"] for call in calls)
    assert set(performed.values()) == {1}
    finished = Counter(e["run_id"] for e in journal if e["what"] == "run_finished")
    assert finished == Counter(run["id"] for run in runs)
    assert set(finished.values()) == {1}
    return {call["call_id"]: call["attempts"] for call in calls}


def assert_events_complete(served: Served, board: Board, folder: Path) -> list[int]:
    """The host's event log, from its first event on, is exactly what the runtime's window replays after
    that event: in order, nothing missing, nothing twice, no gap. A last task creation marks the end.
    Returns the event_seqs logged."""
    board.ask({"type": "create_task", "task_id": "END", "workflow_id": WORKFLOW, "step_id": "backlog"})
    path = folder / "events.jsonl"

    def ended() -> list[dict[str, Any]] | None:
        lines = _lines(path)
        return lines if any(line.get("event", {}).get("task_id") == "END" for line in lines) else None

    lines = _until(ended, 30.0, "the host logged the last event")
    assert not [line for line in lines if "gap" in line]
    if not RESUMABLE:
        pytest.skip(NO_SEQ)
    seqs = [line["event_seq"] for line in lines]
    reference = WireClient(str(served.socket))
    try:
        assert reference.request({"type": "subscribe", "after": seqs[0]})["reply"]["ok"]
        replayed = []
        while True:
            frame = reference.line()
            assert frame is not None and "event" in frame, frame  # a gap line: the window lost some
            replayed.append(frame["event_seq"])
            if frame["event"].get("task_id") == "END":
                break
    finally:
        reference.close()
    assert seqs[1:] == replayed
    return seqs


def test_the_go_example_is_gofmt_and_vet_clean(go_tool: tuple[str, dict[str, str]]) -> None:
    go, env = go_tool
    gofmt = Path(go).resolve().parent / "gofmt"
    unformatted = subprocess.run(
        [str(gofmt), "-l", "."], cwd=EXAMPLE, capture_output=True, text=True, timeout=60
    )
    assert (unformatted.returncode, unformatted.stdout) == (0, "")
    vet = subprocess.run(
        [go, "vet", "./..."], cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=600
    )
    assert vet.returncode == 0, vet.stderr


def test_a_go_host_takes_office_default_tasks_to_done_performing_each_action_once_and_each_run_once(
    go_host_binary: Path, tmp_path: Path
) -> None:
    with serving(workflow=TEMPLATE) as served:
        board = Board(served)
        with go_host(go_host_binary, served, tmp_path, "host", "-work", "700ms") as host:  # renews twice
            for task in ("T-plain", "T-comment", "T-rejected"):
                board.create(task)
            to_done(board, "T-plain")
            to_done(board, "T-comment", comment=True)
            to_done(board, "T-rejected", rejected=True)
            attempts = assert_each_call_performed_once_and_each_run_finished_once(board, tmp_path)
            assert sorted(attempts) == [
                "session_action/T-comment/1/on_enter/0",
                "session_action/T-plain/1/on_enter/0",
                "session_action/T-rejected/1/on_enter/0",  # Work, then Work again after the rejection
                "session_action/T-rejected/3/on_enter/0",
            ]
            assert set(attempts.values()) == {1}
            journal = _lines(tmp_path / "journal.jsonl")
            assert {e["action"] for e in journal if e["what"] == "session_action"} == {"auto_start_agent"}
            # Each task: two reviewers and an approver; T-comment one more, T-rejected a second review.
            assert len(board.runs()) == 3 + 4 + 5
            assert any(e["renewals"] > 0 for e in journal if e["what"] == "run_finished")
            assert_events_complete(served, board, tmp_path)
            began = time.monotonic()
            assert host.stop() == 0
            assert time.monotonic() - began < 10  # its claim polls end within -wait
            assert host.logs("stopped")


def test_a_go_host_killed_mid_call_and_mid_run_is_restarted_without_acting_twice_or_losing_a_run(
    go_host_binary: Path, tmp_path: Path
) -> None:
    with serving("--host-wait", "30", workflow=TEMPLATE) as served:
        board = Board(served)
        for task in ("T-call", "T-runs"):
            board.create(task)
        # Before any host registers, serve answers as before: T-runs' session action is reported done
        # without a call, and its reviewers' runs wait in the queue.
        board.ask({"type": "move_task", "task_id": "T-runs", "step_id": "work"})
        board.ask({"type": "turn_complete", "task_id": "T-runs"})
        assert board.host_calls() == []
        slow = ("-reply-delay", "60s", "-work", "60s")  # performs, then answers late; works long
        with go_host(go_host_binary, served, tmp_path, "first", *slow) as first:
            _until(
                lambda: len([r for r in board.runs("T-runs") if r["status"] == "claimed"]) == 2, 30, "claims"
            )
            mover = served.client()
            mover.write({"id": "move", "type": "move_task", "task_id": "T-call", "step_id": "work"})
            [performed] = first.wait_log("call_performed")
            first.process.send_signal(signal.SIGKILL)  # holding an answered-to-nobody call and two claims
            first.process.wait()
        held = performed["call_id"]
        assert held == "session_action/T-call/1/on_enter/0"
        resume_point = _lines(tmp_path / "events.jsonl")[-1].get("event_seq")
        board.ask({"type": "create_task", "task_id": "T-down", "workflow_id": WORKFLOW, "step_id": "backlog"})
        with go_host(go_host_binary, served, tmp_path, "second") as second:
            assert mover.reply()["reply"]["ok"]  # the call, offered again under its id, answered
            assert [e["call_id"] for e in second.logs("call_already_done")] == [held]
            assert second.logs("call_performed") == []
            [registered] = second.logs("host_registered")
            assert registered["resumed_after"] == (resume_point or 0)
            reclaimed = board.runs_finished("T-runs", 2)
            assert [run["attempt"] for run in reclaimed] == [2, 2]  # the dead host's leases expired
            to_done(board, "T-call")
            to_done(board, "T-runs", runs=2)
            attempts = assert_each_call_performed_once_and_each_run_finished_once(board, tmp_path)
            assert attempts[held] == 2
            listed = {c["call_id"]: c["host_id"] for c in board.host_calls()}
            assert listed[held] == "host-2"
            by_first = [e for e in _lines(tmp_path / "journal.jsonl") if e["pid"] == first.process.pid]
            assert [e["call_id"] for e in by_first] == [held]  # it performed, and finished no run
            seqs = assert_events_complete(served, board, tmp_path)
            assert resume_point in seqs  # the second host went on from where the first one stopped,
            down = [
                line for line in _lines(tmp_path / "events.jsonl") if line["event"].get("task_id") == "T-down"
            ]
            assert len(down) == 1  # with what happened while no host ran
            assert second.stop() == 0


def test_a_go_host_dropped_as_a_slow_consumer_reconnects_and_resumes_its_events(
    go_host_binary: Path, tmp_path: Path
) -> None:
    with serving("--queue-size", "64", "--queue-bytes", "65536", workflow=TEMPLATE) as served:
        board = Board(served)
        with go_host(go_host_binary, served, tmp_path, "host") as host:
            host.process.send_signal(signal.SIGSTOP)  # reads nothing: its events pile up, then it is dropped
            try:
                created = 0
                while not any("slow_consumer" in line for line in served.log):
                    assert created < 20_000, "the server never dropped the stopped host"
                    batch = [
                        {
                            "type": "create_task",
                            "task_id": f"B-{created + n}",
                            "workflow_id": WORKFLOW,
                            "step_id": "backlog",
                        }
                        for n in range(100)
                    ]
                    board.client.write(*batch)
                    assert all(board.client.reply()["reply"]["ok"] for _ in batch)
                    created += len(batch)
            finally:
                host.process.send_signal(signal.SIGCONT)
            [_, again] = host.wait_log("host_registered", 2)
            assert host.logs("host_disconnected")
            resumed = again["resumed_after"]
            board.create("T-after")
            to_done(board, "T-after")  # its session action goes to the host as registered again
            attempts = assert_each_call_performed_once_and_each_run_finished_once(board, tmp_path)
            assert attempts == {"session_action/T-after/1/on_enter/0": 1}
            seqs = assert_events_complete(served, board, tmp_path)
            assert resumed in seqs
            # Every creation was published while the host was stopped: those after its resume point it got
            # from the replay on its new connection.
            creations = [
                line["event_seq"]
                for line in _lines(tmp_path / "events.jsonl")
                if line["event"]["type"] == "task_created" and line["event"]["task_id"].startswith("B-")
            ]
            assert len(creations) == created and any(seq > resumed for seq in creations)
            assert host.stop() == 0


def test_a_go_host_interrupted_mid_run_exits_0_and_hands_its_runs_back_at_once(
    go_host_binary: Path, tmp_path: Path
) -> None:
    with serving(workflow=TEMPLATE) as served:
        board = Board(served)
        board.create("T-1")
        board.ask({"type": "move_task", "task_id": "T-1", "step_id": "work"})
        board.ask({"type": "turn_complete", "task_id": "T-1"})  # a run for each reviewer
        long = ("-lease", "30s", "-work", "60s")
        with go_host(go_host_binary, served, tmp_path, "first", *long) as first:
            _until(lambda: [r["status"] for r in board.runs("T-1")] == ["claimed"] * 2, 30, "both claimed")
            began = time.monotonic()
            first.process.send_signal(signal.SIGINT)
            assert first.process.wait(timeout=30) == 0
            assert time.monotonic() - began < 10  # its claim polls end within -wait
            assert len(first.logs("run_handed_back")) == 2 and first.logs("stopped")
            handed = [(r["status"], r["outcome_reason"]) for r in board.runs("T-1")]
            assert handed == [("queued", "requeued")] * 2  # back in the queue at once (requeue_run)
        with go_host(go_host_binary, served, tmp_path, "second"):
            began = time.monotonic()
            runs = board.runs_finished("T-1", 2)
            assert time.monotonic() - began < 10  # not the 30 s lease the first host held them for
            journal = journal_with(tmp_path, {run["id"] for run in runs})
        assert [(run["attempt"], run["retries"]) for run in runs] == [(2, 0), (2, 0)]
        finished = [e["pid"] for e in journal if e["what"] == "run_finished"]
        assert len(finished) == 2 and first.process.pid not in finished
