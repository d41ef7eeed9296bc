"""A database written before onceflow spoke Gas City's wire format migrates (store/backends/schema.py
migration 8).

The old rows are written here with plain SQL exactly as a schema-7 onceflow stored them (`producer_fence`,
`run_id`, Unix-seconds `occurred_at`, the old outcome id over sorted-key JSON, acks without
`acknowledged_by`); the ids are hashed here with hashlib over hand-built JSON.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

from helpers import FakeClock, ok, send
from outcome_support import SHA, ack, acknowledged, state, until
from trio.testing import MockClock

from onceflow.actors.runtime.startup import open_runtime
from onceflow.store.backends import schema
from onceflow.testing import RecordingCoordinator


def _id(canonical: str) -> str:
    return "outcome-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


OLD_PENDING_ID = _id(
    '{"fence":{"generation":3,"producer_id":"worker-7","token":"tok-9"},"producer":"direct-worker",'
    '"state":"terminal","store_ref":"city:gascity","version":1,"work_id":"gc-1234"}'
)
NEW_PENDING_ID = _id(
    '{"contract_version":1,"producer":"direct-worker","store_ref":"city:gascity","work_id":"gc-1234",'
    '"state":"terminal","fence":{"producer_id":"worker-7","generation":3,"token":"tok-9"}}'
)
OLD_DONE_ID = _id(
    '{"fence":{"generation":1,"producer_id":"polecat-3","token":"lease-1"},"producer":"temporal",'
    '"state":"verified","store_ref":"rig:hq","version":1,"work_id":"hq-42"}'
)
NEW_DONE_ID = _id(
    '{"contract_version":1,"producer":"temporal","store_ref":"rig:hq","work_id":"hq-42",'
    '"state":"verified","fence":{"producer_id":"polecat-3","generation":1,"token":"lease-1"}}'
)
EVIDENCE = [{"kind": "commit", "uri": "git:repo@abc123", "sha256": SHA}]


def _old_envelope(outcome_id: str, **fields: Any) -> dict[str, Any]:
    """As schema-7 onceflow stored it: pydantic's dump of its own envelope model, nulls included."""
    return {
        "contract_version": 1,
        "source_root_id": "gc-1000",
        "step_key": "implement",
        "workflow_id": None,
        "run_id": None,
        "summary": "Implemented the parser.",
        "impact": "Commands are parsed strictly.",
        "evidence": EVIDENCE,
        **fields,
        "outcome_id": outcome_id,
    }


def _schema_7_database(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    for script in schema.MIGRATIONS[:7]:
        assert isinstance(script, str)
        for statement in schema._statements(script):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 7")
    pending = _old_envelope(
        OLD_PENDING_ID,
        producer="direct-worker",
        store_ref="city:gascity",
        work_id="gc-1234",
        state="terminal",
        producer_fence={"producer_id": "worker-7", "generation": 3, "token": "tok-9"},
        occurred_at=1_700_000_000.5,
    )
    done = _old_envelope(
        OLD_DONE_ID,
        producer="temporal",
        store_ref="rig:hq",
        work_id="hq-42",
        state="verified",
        producer_fence={"producer_id": "polecat-3", "generation": 1, "token": "lease-1"},
        occurred_at=1_700_000_000.0,
        workflow_id="coordinator-outcome/formula:42",
        run_id="run-9",
    )
    conn.execute(
        "INSERT INTO outcomes (outcome_id, envelope, behavior_version, phase, delivery_attempts,"
        " coordinator_fence, delivery_ref, delivered_at) VALUES (?, ?, 1, 'needs-coordinator-ack', 2,"
        " 'coord-1', 'mail-2', 1700000100.0)",
        (OLD_PENDING_ID, json.dumps(pending)),
    )
    conn.execute(
        "INSERT INTO outcomes (outcome_id, envelope, behavior_version, phase, delivery_attempts,"
        " acknowledged_at) VALUES (?, ?, 1, 'acknowledged', 1, 1700000200.0)",
        (OLD_DONE_ID, json.dumps(done)),
    )
    conn.executemany(
        "INSERT INTO outcome_acks (outcome_id, store_ref, work_id, coordinator_fence, copies)"
        " VALUES (?, 'city:gascity', 'gc-1234', ?, ?)",
        [(OLD_PENDING_ID, "coord-1", 2), (OLD_PENDING_ID, "coord-0", 1)],
    )
    conn.close()


async def test_migration_8_rewrites_stored_outcomes_in_gas_citys_format(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    _schema_7_database(db_path)
    coordinator = RecordingCoordinator(fence="coord-1")
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
        await until(coordinator, lambda: len(coordinator.deliveries) == 1)  # the actor accepted the envelope
        for old in (OLD_PENDING_ID, OLD_DONE_ID):
            gone = await send(rt, {"type": "get_outcome", "outcome_id": old})
            assert gone.error is not None and gone.error.code == "not_found"
        pending = await state(rt, NEW_PENDING_ID)
        done = await state(rt, NEW_DONE_ID)
        assert pending["envelope"] == {
            "contract_version": 1,
            "outcome_id": NEW_PENDING_ID,
            "producer": "direct-worker",
            "store_ref": "city:gascity",
            "work_id": "gc-1234",
            "source_root_id": "gc-1000",
            "step_key": "implement",
            "summary": "Implemented the parser.",
            "impact": "Commands are parsed strictly.",
            "state": "terminal",
            "evidence": EVIDENCE,
            "fence": {"producer_id": "worker-7", "generation": 3, "token": "tok-9"},
            "occurred_at": "2023-11-14T22:13:20.5Z",
        }
        assert list(pending["envelope"]) == [  # Go's field order
            "contract_version",
            "outcome_id",
            "producer",
            "store_ref",
            "work_id",
            "source_root_id",
            "step_key",
            "summary",
            "impact",
            "state",
            "evidence",
            "fence",
            "occurred_at",
        ]
        # the three waiting acks had no acknowledged_by: they could never match, so they count stale
        assert (pending["stale_acknowledgements"], pending["acknowledged_by"]) == (3, None)
        # the migrated count (2) carried over: the first cycle after it is the third. Later cycles may have
        # begun meanwhile (the autojump clock reaches the redelivery timer while the writer thread works).
        assert coordinator.deliveries[0][1].cycle_id == f"deliver/{NEW_PENDING_ID}/cycle-000003"
        assert pending["delivery_attempts"] >= 3
        assert (done["envelope"]["workflow_id"], done["envelope"]["workflow_run_id"]) == (
            "coordinator-outcome/formula:42",
            "run-9",
        )
        assert (done["envelope"]["occurred_at"], done["phase"], done["acknowledged_by"]) == (
            "2023-11-14T22:13:20Z",
            "acknowledged",
            None,
        )
        assert "producer_fence" not in done["envelope"] and "run_id" not in done["envelope"]
        # acknowledged before acknowledged_by existed: a repeat by anyone is a no-op
        repeat = await ok(rt, ack(done["envelope"], "coord-1", acknowledged_by="deacon"))
        assert (repeat.result["queued"], repeat.result["phase"]) == (False, "acknowledged")
        await ok(rt, ack(pending["envelope"], "coord-1"))
        finished = await acknowledged(rt, NEW_PENDING_ID)
        version = await rt.services.store.transact(
            lambda conn: conn.execute("PRAGMA user_version").fetchone()[0]
        )
    assert coordinator.deliveries[0][1].envelope.outcome_id == NEW_PENDING_ID
    assert (finished["acknowledged_by"], version) == ("mayor", schema.SCHEMA_VERSION)
