"""A scenario's `advance` moves Trio time too, so coordinator retries and the outcome
redelivery timer (AC-CO-4, AC-CO-7, AC-CO-8) can be reached from a scenario file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from outcome_support import envelope

from onceflow.scenario import run_files

MINIMAL = Path(__file__).resolve().parents[1] / "fixtures" / "workflows" / "minimal.yml"


def get(outcome_id: str, **result: Any) -> dict[str, Any]:
    return {"send": {"type": "get_outcome", "outcome_id": outcome_id}, "result": result}


def test_scenario_advance_drives_coordinator_retries_and_the_redelivery_timer(tmp_path: Path) -> None:
    env = envelope()
    oid = env["outcome_id"]
    ack = {key: env[key] for key in ("store_ref", "outcome_id", "work_id")}
    delivered = {"type": "diagnostic", "code": "outcome_delivered"}
    steps = [
        {"send": {"type": "outcome_ready", "envelope": env}, "result": {"received": "started"}},
        get(oid, phase="pending", delivery_attempts=1, last_delivery_error=None),
        {"advance": 15, "note": "retries after 1, 2, 4 and 8 s all fail"},
        get(oid, phase="pending", delivery_attempts=1, last_delivery_error="local-delivery-failed"),
        {"coordinator": {"down": False}},
        {"advance": 59, "event_types": ["diagnostic"], "events": []},
        {"advance": 1, "note": "the redelivery interval is up", "events": [delivered]},
        get(oid, phase="needs-coordinator-ack", delivery_attempts=2, coordinator_fence="coord-1"),
        {
            "send": {
                "type": "coordinator_ack",
                **ack,
                "coordinator_fence": "coord-1",
                "acknowledged_by": "coord",
            }
        },
        get(oid, phase="acknowledged"),
    ]
    scenario = {
        "name": "outcome redelivery",
        "template": str(MINIMAL),
        "coordinator": {"down": True},
        "redelivery_interval": 60,
        "steps": steps,
    }
    path = tmp_path / "outcome.yml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    lines: list[str] = []
    assert run_files([path], lines.append) == 0, "\n".join(lines)
    assert lines == ["ok: outcome redelivery (10 steps)"]
