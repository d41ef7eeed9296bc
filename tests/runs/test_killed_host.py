"""A host SIGKILLed while it holds claims loses nothing: after their lease its runs are handed out again,
each exactly once, and a finish with the dead claimant's token is refused. Real processes: `onceflow serve`
in one, the dying host in another (tests/runs/claiming_host.py), the surviving host here over the socket."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import ONE_STEP_COMMENT_QUEUES_RUN

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "facade"))
from wire_client import WireClient

HERE = Path(__file__).resolve().parent
WORKFLOW = ONE_STEP_COMMENT_QUEUES_RUN
RUNS, HELD, LEASE = 20, 8, 2.0


def test_a_sigkilled_hosts_claims_are_handed_out_again_once_each_and_its_tokens_are_refused() -> None:
    folder = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    (folder / "m.yml").write_text(WORKFLOW)
    sock = folder / "s.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "serve", "--db", str(folder / "db"), "--workflow",
         str(folder / "m.yml"), "--socket", str(sock)],
        stderr=subprocess.PIPE,
    )  # fmt: skip
    host = None
    try:
        assert server.stderr is not None
        assert server.stderr.readline().decode().startswith("serving on ")
        client = WireClient(str(sock))
        for n in range(RUNS):
            task = {
                "type": "create_task",
                "task_id": f"T{n}",
                "workflow_id": "m",
                "primary_agent_id": "worker",
            }
            assert client.request(task)["reply"]["ok"]
            comment = {"type": "task_comment", "task_id": f"T{n}", "comment_id": f"c-{n}"}
            assert client.request(comment)["reply"]["ok"]
        host = subprocess.Popen(
            [
                sys.executable,
                "-I",
                str(HERE / "claiming_host.py"),
                str(sock),
                "worker",
                str(HELD),
                str(LEASE),
            ],
            stdout=subprocess.PIPE,
        )
        assert host.stdout is not None
        dead = [json.loads(host.stdout.readline()) for _ in range(HELD)]
        host.send_signal(signal.SIGKILL)
        host.wait(timeout=10)
        killed_at = time.monotonic()

        claims = []
        while True:
            request = {"type": "claim_run", "agent_profile_id": "worker", "wait_seconds": 2 * LEASE + 2}
            run = client.request(request)["reply"]["result"]
            if run is None:
                break
            claims.append(run)
        assert sorted(run["id"] for run in claims) == sorted(range(1, RUNS + 1))  # every run, once each
        again = {run["id"]: run for run in claims if run["attempt"] == 2}
        assert sorted(again) == sorted(claim["id"] for claim in dead)  # the dead host's, after their lease
        assert time.monotonic() - killed_at >= LEASE - 0.5
        for claim in dead:
            finish = {"type": "finish_run", "run_id": claim["id"], "claim_token": claim["claim_token"]}
            refused = client.request(finish)["reply"]
            assert (refused["ok"], refused["error"]["code"], refused["error"]["field"]) == (
                False,
                "conflict",
                "claim_token",
            )
        for run in claims:
            finish = {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]}
            assert client.request(finish)["reply"]["result"]["status"] == "finished"
        listed = client.request({"type": "list_runs", "agent_profile_id": "worker"})["reply"]["result"][
            "runs"
        ]
        assert [row["status"] for row in listed] == ["finished"] * RUNS
    finally:
        for process in (host, server):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(folder, ignore_errors=True)
