"""The runs queue on PostgreSQL under a claim storm while a runtime is SIGKILLed: two `onceflow serve`
processes on one database, 20 claimer threads on each (one connection each), 200 queued runs of one agent.

Each claimer claims with a LEASE-second lease, holds the run a moment and finishes it with the claim's token;
a few holders (of a first attempt) dawdle past their lease, so their run is taken over by another claim, and
finish while that claim holds it: their late finish must be refused. Mid-storm each runtime in turn is
SIGKILLed and restarted: claims it committed whose reply never left it are held by nobody until their lease
runs out, when another claim takes them over; finishes whose reply was lost are sent again to a live runtime
(a replay). Claimers go on until every run is finished.

Afterwards, per run: finished in the database, under the token of its latest claim; its claims (those whose
reply arrived) never overlap, each taken after the one before's lease ran out (no run held by two live
claims at once, within SLACK); exactly one token's finish accepted, at most once other than as a replay;
every other finish refused as a stale `claim_token`. And the storm did what it is for: the kills happened
mid-storm, some claims were taken over after their lease ran out, and some late finish was refused.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "facade"))
from test_pg_kill import Cluster
from test_pg_runs import _queue
from wire_client import WireClient

from onceflow.actors.runtime.startup import open_runtime

RUNS, RUNTIMES, CLAIMERS = 200, 2, 20
LEASE = 2.0  # seconds
SLACK = 0.5
"""Seconds a claim's time may precede its transaction: the runtime reads its clock when it queues the claim
for the writer, so a claim taking over a lease the other runtime's sweep just expired may carry a time a
little before that lease's end (its lease ends as much earlier: harmless). Two live claims of one run would
overlap by about a whole LEASE."""
SLOW = 0.05  # the share of first attempts whose holder dawdles past the lease before finishing
LATE = 0.3  # seconds past the lease such a holder finishes: while the claim that took the run over holds it
TAKEN_OVER_HOLD = 0.8  # seconds the holder of a later attempt holds the run
KILL_AFTER = (50, 110)  # SIGKILL runtime n % RUNTIMES once this many runs are finished
RETRYABLE = ("storage_io", "storage_busy", "shutting_down")


def seconds(stamp: str) -> float:
    """Unix seconds of an RFC 3339 UTC time in a result."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Storm:
    """What the claimers saw: `claims[run]` (token, attempt, lease end in Unix seconds), `finishes[run]`
    (token, reply) of every finish that got a reply, `finished` the runs with an accepted finish."""

    def __init__(self, servers: Cluster) -> None:
        self.servers = servers
        self.lock = threading.Lock()
        self.claims: dict[int, list[tuple[str, int, float]]] = collections.defaultdict(list)
        self.finishes: dict[int, list[tuple[str, dict[str, Any]]]] = collections.defaultdict(list)
        self.finished: set[int] = set()
        self.errors: list[BaseException] = []

    def done(self) -> bool:
        with self.lock:
            return len(self.finished) == RUNS

    def ask(
        self, client: WireClient | None, index: int, command: dict[str, Any]
    ) -> tuple[WireClient | None, dict[str, Any] | None]:
        """`command`'s reply from runtime `index` over `client` (connecting once it is up), and the
        connection to use next; (None, None) when the runtime died first."""
        try:
            if client is None:
                self.servers.up[index].wait(60)
                client = WireClient(self.servers.socket(index), timeout=30)
            reply: dict[str, Any] = client.request({"id": 1, **command})["reply"]
        except (OSError, AssertionError, json.JSONDecodeError):
            if client is not None:
                client.close()
            return None, None
        return client, reply

    def claimer(self, index: int, rng: random.Random) -> None:
        client: WireClient | None = None
        try:
            while not self.done():
                command = {"type": "claim_run", "agent_profile_id": "w", "lease_seconds": LEASE}
                client, reply = self.ask(client, index, command)
                if reply is None or (not reply["ok"] and reply["error"]["code"] in RETRYABLE):
                    continue
                assert reply["ok"], reply["error"]
                run = reply["result"]
                if run is None:
                    time.sleep(0.05)
                    continue
                token = run["claim_token"]
                with self.lock:
                    self.claims[run["id"]].append((token, run["attempt"], seconds(run["lease_expires_at"])))
                if run["attempt"] > 1:  # a run taken over: held while a late holder's finish may come
                    time.sleep(TAKEN_OVER_HOLD)
                else:
                    time.sleep(LEASE + LATE if rng.random() < SLOW else rng.uniform(0, 0.01))
                client = self.finish(client, index, run["id"], token, rng)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            if client is not None:
                client.close()

    def finish(
        self, client: WireClient | None, index: int, run_id: int, token: str, rng: random.Random
    ) -> WireClient | None:
        """Finish the run under `token` until some runtime answers (after a lost reply, at a random one)."""
        command = {"type": "finish_run", "run_id": run_id, "claim_token": token}
        while True:
            client, reply = self.ask(client, index, command)
            if reply is not None and not (not reply["ok"] and reply["error"]["code"] in RETRYABLE):
                break
            index = rng.randrange(RUNTIMES)
        with self.lock:
            self.finishes[run_id].append((token, reply))
            if reply["ok"]:
                self.finished.add(run_id)
        return client


async def test_two_runtimes_one_sigkilled_mid_claim_storm_never_hand_a_run_to_two_live_claims(
    pg_url: str,
) -> None:
    async with open_runtime(pg_url) as rt:
        await _queue(rt, RUNS)
    storm, kills = await trio.to_thread.run_sync(blow, pg_url)
    assert not storm.errors, storm.errors

    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT id, status, claim_token, attempt FROM runs WHERE agent_profile_id = 'w'")
        stored = {run_id: (status, token, attempt) for run_id, status, token, attempt in rows}
    assert len(stored) == RUNS and {status for status, _, _ in stored.values()} == {"finished"}
    taken_over = refused = 0
    for run_id, (_, stored_token, final_attempt) in stored.items():
        claims = sorted(storm.claims[run_id], key=lambda claim: claim[1])
        # Its holder's finish clears the stored token: the run's attempt is the fence from then on.
        assert stored_token == "" and claims and claims[-1][1] == final_attempt, (
            run_id,
            claims,
            final_attempt,
        )
        final_token = claims[-1][0]
        for (_, attempt, ends), (_, later, later_ends) in itertools.pairwise(claims):
            assert attempt < later and later_ends - LEASE >= ends - SLACK, (
                f"run {run_id} claimed again before its claim's lease ran out: {claims}"
            )
            taken_over += 1
        accepted = [(token, reply["result"]) for token, reply in storm.finishes[run_id] if reply["ok"]]
        tokens = {token for token, _ in accepted}
        assert tokens == {final_token}, (
            f"run {run_id}: finishes accepted under {sorted(tokens)}, its last claim {final_token}:"
            f" {storm.finishes[run_id]}"
        )
        assert len([result for _, result in accepted if not result["replay"]]) <= 1, (
            f"run {run_id} finished twice: {storm.finishes[run_id]}"
        )
        for token, reply in storm.finishes[run_id]:
            if not reply["ok"]:
                assert (reply["error"]["code"], reply["error"]["field"]) == ("conflict", "claim_token"), reply
                assert token != final_token
                refused += 1
    assert kills == len(KILL_AFTER) and taken_over and refused


def blow(url: str) -> tuple[Storm, int]:
    """Run the storm on two fresh runtimes, SIGKILLing and restarting one at each KILL_AFTER mark; the storm
    and the kills done."""
    servers = Cluster(url, Path(tempfile.mkdtemp(prefix="of-runkill-", dir="/tmp")), RUNTIMES, ())
    storm = Storm(servers)
    rng = random.Random(26)
    threads = [
        threading.Thread(target=storm.claimer, args=(index, random.Random(rng.random())), daemon=True)
        for index in range(RUNTIMES)
        for _ in range(CLAIMERS)
    ]
    kills = 0
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 120
        while not storm.done() and not storm.errors and time.monotonic() < deadline:
            if kills < len(KILL_AFTER) and len(storm.finished) >= KILL_AFTER[kills]:
                servers.kill_and_restart(kills % RUNTIMES)
                kills += 1
            time.sleep(0.01)
        for thread in threads:
            thread.join(timeout=60)
    finally:
        servers.stop()
    return storm, kills
