"""Coordinator outcome delivery by three runtime processes on one PostgreSQL database, one of them SIGKILLed
mid-delivery and restarted, again and again.

Each runtime is a process (tests/postgres/outcome_runtime.py) whose coordinator logs every attempt on stdout
as it begins and as it returns, with the system-wide monotonic time; each process talks to its own
coordinator session (fence `coord-<n>`, n new at every start), so an outcome redelivered by another runtime
after a kill gets a new fence and an ack for the old one is stale. The test plays the coordinator's side: for
each delivery it sees returned, it sends the outcome a bogus-fence ack (`coord-stale`, first time only) and
then an ack under the delivery's fence, each to a random live runtime (mostly not the delivering one: the ack
waits in the database's inbox). Outcomes are readied one at a time at random runtimes while the kills happen.

Afterwards, per outcome: acknowledged by `mayor` (none lost); the host's `acknowledge` called under one ack
cycle id and with the outcome's final, current fence only (a stale fence never completes it, AC-CO-9), and
called again only after the process that called it before was killed before its commit could land (once,
but for a crash: the cycle id lets the canonical store deduplicate, AC-CO-10); no two processes ever had a
coordinator call of the outcome under way at once (the claim fences delivery and acknowledgement); no
delivery began after the acknowledgement; the bogus ack counted stale. And the kills did what they are for:
at least one landed mid-delivery, and that cycle was retried by another process under its own id (AC-CO-14,
AC-CO-17).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "outcome"))
from outcome_support import ack, envelope

CHILD = Path(__file__).with_name("outcome_runtime.py")
RUNTIMES = 3
OUTCOMES = 24
KILLS = 5
STALE = "coord-stale"
ACK_DELAY = 1.2  # seconds, at most: often past the redelivery interval (a redelivery first), and outcomes
# stay unfinished long enough that every restart and sweep finds some another runtime is delivering
READY_EVERY = 0.25  # seconds between two outcomes readied: they keep coming while the kills happen


class Process:
    """One incarnation of a runtime process: `request` sends it a command, `events` is what it logged."""

    def __init__(self, url: str, incarnation: int, log: list[dict[str, Any]], lock: threading.Lock) -> None:
        self.fence = f"coord-{incarnation}"
        self.popen = subprocess.Popen(
            [sys.executable, str(CHILD), url, self.fence],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.pid = self.popen.pid
        self.killed_at: float | None = None
        self._log, self._lock = log, lock
        self._ready = threading.Event()
        self._replies: dict[int, dict[str, Any] | None] = {}
        self._answered: dict[int, threading.Event] = {}
        self._ids = itertools.count()
        self._closed = False
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(60):
            raise AssertionError(f"runtime {self.fence} did not start")

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            event = json.loads(raw)
            if event["event"] == "ready":
                self._ready.set()
            elif event["event"] == "reply":
                with self._lock:
                    self._replies[event["id"]] = event["reply"]
                    self._answered[event["id"]].set()
            else:
                with self._lock:
                    self._log.append(event)
        with self._lock:
            self._closed = True
            for answered in self._answered.values():
                answered.set()  # a reply that never came: None

    def request(self, command: dict[str, Any]) -> dict[str, Any] | None:
        """The command's reply, or None when the process died first."""
        with self._lock:
            if self._closed:
                return None
            number = next(self._ids)
            answered = self._answered[number] = threading.Event()
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write((json.dumps({"id": number, "command": command}) + "\n").encode())
            self.popen.stdin.flush()
        except (BrokenPipeError, ValueError):
            return None
        if not answered.wait(60):
            raise AssertionError(f"no reply from {self.fence} to {command}")
        with self._lock:
            return self._replies.get(number)

    def kill(self) -> None:
        self.killed_at = time.monotonic()  # before the signal: the process is surely alive until then
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Cluster:
    """RUNTIMES slots, each running one incarnation at a time; `every` holds them all, killed ones too."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.log: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.incarnations = itertools.count()
        self.every: list[Process] = []
        self.slots = [self._start() for _ in range(RUNTIMES)]

    def _start(self) -> Process:
        process = Process(self.url, next(self.incarnations), self.log, self.lock)
        self.every.append(process)
        return process

    def send(self, command: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """`command`'s reply from a random live runtime, sent again to another until one answers."""
        while True:
            reply = rng.choice(self.slots).request(command)
            if reply is not None:
                return reply
            time.sleep(0.05)

    def delivering(self) -> list[int]:
        """The slots whose process has a delivery begun and not returned."""
        with self.lock:
            events = list(self.log)
        open_: set[tuple[int, str]] = set()
        for event in events:
            key = (event["pid"], event["cycle"])
            if event["event"] == "deliver":
                open_.add(key)
            elif event["event"] == "delivered":
                open_.discard(key)
        pids = {pid for pid, _ in open_}
        return [index for index, process in enumerate(self.slots) if process.pid in pids]

    def kill_and_restart(self, index: int) -> None:
        self.slots[index].kill()
        self.slots[index] = self._start()

    def stop(self) -> None:
        for process in self.slots:
            process.stop()


class Acker:
    """The coordinator's side: each returned delivery is acknowledged under its fence, after a bogus-fence
    ack the first time an outcome is seen; both go to random live runtimes. `bogus_first` holds the outcomes
    whose bogus ack was queued before any real one was sent."""

    def __init__(self, cluster: Cluster, envelopes: dict[str, dict[str, Any]], seed: int) -> None:
        self.cluster, self.envelopes = cluster, envelopes
        self.rng = random.Random(seed)
        self.seen = 0
        self.bogus_sent: dict[str, threading.Event] = {}  # set once the outcome's bogus ack was answered
        self.bogus_first: set[str] = set()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            with self.cluster.lock:
                fresh = [e for e in self.cluster.log[self.seen :] if e["event"] == "delivered"]
                self.seen = len(self.cluster.log)
            for event in fresh:
                first = event["outcome"] not in self.bogus_sent
                self.bogus_sent.setdefault(event["outcome"], threading.Event())
                thread = threading.Thread(
                    target=self._ack, args=(event, first, random.Random(self.rng.random())), daemon=True
                )
                self.threads.append(thread)
                thread.start()
            time.sleep(0.02)

    def _ack(self, event: dict[str, Any], first: bool, rng: random.Random) -> None:
        try:
            env = self.envelopes[event["outcome"]]
            time.sleep(rng.uniform(0, ACK_DELAY))
            answered = self.bogus_sent[event["outcome"]]
            if first:
                try:
                    reply = self.cluster.send(ack(env, STALE), rng)
                    assert reply["ok"], reply["error"]
                    if reply["result"]["queued"]:
                        self.bogus_first.add(event["outcome"])
                finally:
                    answered.set()
            assert answered.wait(60)  # no real ack before the bogus one
            reply = self.cluster.send(ack(env, event["fence"]), rng)
            assert reply["ok"], reply["error"]
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        for thread in self.threads:
            thread.join(timeout=60)


def test_ac_co_9_10_14_17_outcomes_of_three_runtimes_sigkilled_mid_delivery_are_acknowledged_once_fenced(
    pg_url: str,
) -> None:
    rng = random.Random(26)
    envelopes = {env["outcome_id"]: env for env in (envelope(work_id=f"gc-{n}") for n in range(OUTCOMES))}
    cluster = Cluster(pg_url)
    acker = Acker(cluster, envelopes, rng.random())
    kills: list[Process] = []
    mid_delivery = 0
    try:
        waiting = list(envelopes.values())
        next_kill = time.monotonic() + rng.uniform(0.5, 1.0)
        while waiting or len(kills) < KILLS:
            if waiting:  # one outcome readied at a time, at a random runtime
                reply = cluster.send({"type": "outcome_ready", "envelope": waiting.pop()}, rng)
                assert reply["ok"], reply["error"]
            time.sleep(READY_EVERY)
            if len(kills) < KILLS and time.monotonic() >= next_kill:
                busy = cluster.delivering()  # one delivering if any: SIGKILLed mid-delivery
                settle = time.monotonic() + 3  # a delivery begins soon while outcomes await their acks
                while not busy and time.monotonic() < settle:
                    time.sleep(0.005)
                    busy = cluster.delivering()
                index = rng.choice(busy) if busy else rng.randrange(RUNTIMES)
                mid_delivery += bool(busy)
                kills.append(cluster.slots[index])
                cluster.kill_and_restart(index)
                next_kill = time.monotonic() + rng.uniform(0.5, 1.0)
        deadline = time.monotonic() + 60  # resumed at the restart, or by a live runtime's sweep (5 s)
        while time.monotonic() < deadline and not all_acknowledged(pg_url, len(envelopes)):
            time.sleep(0.2)
    finally:
        acker.stop()
        cluster.stop()
    assert not acker.errors, acker.errors

    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT outcome_id, phase, acknowledged_by, coordinator_fence, stale_acknowledgements"
            " FROM outcomes"
        ).fetchall()
    final = {outcome_id: (phase, by) for outcome_id, phase, by, _, _ in rows}
    fences = {outcome_id: fence for outcome_id, _, _, fence, _ in rows}
    stale = {outcome_id: count for outcome_id, _, _, _, count in rows}
    assert final == dict.fromkeys(envelopes, ("acknowledged", "mayor"))  # none lost

    died = {process.pid: process.killed_at for process in kills}
    by_outcome: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for event in cluster.log:
        by_outcome[event["outcome"]].append(event)
    for outcome_id, events in by_outcome.items():
        events.sort(key=lambda event: event["t"])
        acks = [event for event in events if event["event"] == "ack"]
        assert acks, f"{outcome_id}: acknowledged without a host acknowledge call"
        only = (acks[0]["cycle"], fences[outcome_id])
        assert {(event["cycle"], event["fence"]) for event in acks} == {only}, (
            f"{outcome_id}: acknowledged under another cycle or a fence not current: {acks}"
        )
        for before, after in itertools.pairwise(acks):  # called again only when a kill cut the first short
            killed_at = died.get(before["pid"])
            assert killed_at is not None and before["t"] < killed_at < after["t"], (
                f"{outcome_id}: acknowledged twice: {before} then {after}"
            )
        acked = max(event["t"] for event in events if event["event"] == "acked")
        assert not [e for e in events if e["event"] == "deliver" and e["t"] > acked], (
            f"{outcome_id}: delivered after its acknowledgement"
        )
        calls = attempts(events, died)
        for (pid, _, end), (other, later, _) in itertools.combinations(calls, 2):
            assert pid == other or not later < end, (
                f"{outcome_id}: processes {pid} and {other} both called the coordinator at once: {events}"
            )
    assert set(by_outcome) == set(envelopes)
    assert acker.bogus_first and all(stale[outcome_id] >= 1 for outcome_id in acker.bogus_first)

    assert len(kills) >= KILLS and mid_delivery >= 1
    retried = [  # a cycle one process began and another delivered again under its id (AC-CO-17)
        cycle
        for cycle, pids in cycles_by_pid(cluster.log).items()
        if len(pids) > 1 and any(pid in died for pid in pids)
    ]
    assert retried, "no kill interrupted a delivery that another runtime then retried"


def attempts(events: list[dict[str, Any]], died: dict[int, float | None]) -> list[tuple[int, float, float]]:
    """Each coordinator call of one outcome as (pid, began, ended), in order of beginning; a call that never
    returned ended when its process was killed (or at infinity, if it was not: no other may start)."""
    ends = {"deliver": "delivered", "ack": "acked"}
    calls = []
    for index, event in enumerate(events):
        if event["event"] not in ends:
            continue
        returned = [
            later["t"]
            for later in events[index + 1 :]
            if later["event"] == ends[event["event"]] and later["pid"] == event["pid"]
            and later["cycle"] == event["cycle"]
        ]  # fmt: skip
        end = returned[0] if returned else died.get(event["pid"]) or float("inf")
        calls.append((event["pid"], event["t"], end))
    return calls


def cycles_by_pid(log: list[dict[str, Any]]) -> dict[str, set[int]]:
    """The processes that began each delivery cycle id."""
    found: dict[str, set[int]] = collections.defaultdict(set)
    for event in log:
        if event["event"] == "deliver":
            found[event["cycle"]].add(event["pid"])
    return found


def all_acknowledged(url: str, count: int) -> bool:
    with contextlib.closing(psycopg.connect(url)) as conn:
        row = conn.execute("SELECT count(*) FROM outcomes WHERE phase = 'acknowledged'").fetchone()
    return row is not None and row[0] == count
