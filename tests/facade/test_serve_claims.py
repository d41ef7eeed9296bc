"""`claim_run` over `onceflow serve` when its client goes away: a waiting claim claims nothing, so no run is
left claimed by a client that is gone until its lease ends. A real `onceflow serve` process, real sockets."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from helpers import COMMENT_QUEUES_RUN
from test_serve import serving


def _workflow() -> Path:
    path = Path(tempfile.mkdtemp(prefix="of-claims-", dir="/tmp")) / "m.yml"
    path.write_text(COMMENT_QUEUES_RUN)
    return path


def test_a_claim_whose_client_went_away_claims_nothing_queued_after() -> None:
    with serving(workflow=_workflow()) as served:
        waiting = served.client()
        waiting.write({"id": "c", "type": "claim_run", "agent_profile_id": "worker", "wait_seconds": 10})
        time.sleep(0.3)  # the claim is waiting
        waiting.close()
        time.sleep(0.3)  # the server has seen the end of stream
        client = served.client()
        create = {"type": "create_task", "task_id": "T1", "workflow_id": "m", "primary_agent_id": "worker"}
        assert client.request(create)["reply"]["ok"]
        queued = client.request({"type": "task_comment", "task_id": "T1", "comment_id": "c1"})["reply"]
        assert queued["ok"] and [e["type"] for e in queued["events"]].count("run_queued") == 1
        time.sleep(0.3)
        runs = client.request({"type": "list_runs", "task_id": "T1"})["reply"]["result"]["runs"]
        assert [(run["status"], run["attempt"]) for run in runs] == [("queued", 0)]
        claimed = client.request({"type": "claim_run", "agent_profile_id": "worker"})["reply"]["result"]
        assert claimed is not None and claimed["attempt"] == 1  # handed to the next live claimer


def test_a_client_that_closes_its_side_gets_no_run_at_once_and_claims_nothing() -> None:
    """A half-closed client still reads: its waiting claim is answered at once as finding no run, and a run
    queued afterwards stays queued."""
    with serving(workflow=_workflow()) as served:
        gone = served.client()
        began = time.monotonic()
        gone.write({"id": "c", "type": "claim_run", "agent_profile_id": "worker", "wait_seconds": 10})
        gone.sock.shutdown(1)  # SHUT_WR: its side is closed
        frame = gone.line()
        assert frame is not None and frame["reply"]["ok"] and frame["reply"]["result"] is None
        assert time.monotonic() - began < 5  # not after its 10 s wait
        client = served.client()
        create = {"type": "create_task", "task_id": "T1", "workflow_id": "m", "primary_agent_id": "worker"}
        assert client.request(create)["reply"]["ok"]
        assert client.request({"type": "task_comment", "task_id": "T1", "comment_id": "c1"})["reply"]["ok"]
        runs = client.request({"type": "list_runs", "task_id": "T1"})["reply"]["result"]["runs"]
        assert [run["status"] for run in runs] == ["queued"]
