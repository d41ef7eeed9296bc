"""The protocol's one time format (protocol/times.py): RFC 3339 UTC in every result and event."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import decide, list_runs, ok, to_review

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.codec import EVENT_ADAPTER
from onceflow.protocol.results import results_schema
from onceflow.protocol.times import RFC3339_UTC, rfc3339, rfc3339_or_none, unix_seconds


def test_rfc3339_is_utc_with_z_and_microseconds_and_reads_back() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00.000000Z"
    assert rfc3339(1_700_000_000.25) == "2023-11-14T22:13:20.250000Z"
    assert rfc3339_or_none(None) is None
    for seconds in (0.0, 1_700_000_000.123456, 4_102_444_800.5):
        assert unix_seconds(rfc3339(seconds)) == pytest.approx(seconds, abs=1e-6)
    assert unix_seconds("2026-03-01T12:00:00Z") == unix_seconds("2026-03-01T12:00:00.000000000Z")
    for bad in ("2026-03-01T12:00:00+01:00", "2026-03-01 12:00:00Z", "1700000000", "2026-02-30T00:00:00Z"):
        with pytest.raises(ValueError):
            unix_seconds(bad)


def _time_fields(schema: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every property named like a time (`*_at`) anywhere in a JSON Schema, with its schema."""
    found = []
    if isinstance(schema, dict):
        for name, sub in schema.get("properties", {}).items():
            if name.endswith("_at"):
                found.append((f"{path}.{name}", sub))
        for key, sub in schema.items():
            found.extend(_time_fields(sub, f"{path}.{key}"))
    elif isinstance(schema, list):
        for n, sub in enumerate(schema):
            found.extend(_time_fields(sub, f"{path}[{n}]"))
    return found


def test_every_time_in_every_result_and_event_is_a_string() -> None:
    """No result or event carries Unix seconds: each `*_at` field is text (or null)."""
    fields = _time_fields(results_schema()) + _time_fields(EVENT_ADAPTER.json_schema())
    assert len(fields) >= 8  # requested_at, lease_expires_at, retry_at, created_at, delivered_at, ...
    for path, schema in fields:
        kinds = {option.get("type") for option in schema.get("anyOf", [schema])}
        assert kinds <= {"string", "null"} and "string" in kinds, (path, schema)


async def test_results_and_events_carry_rfc3339_times(office: Runtime) -> None:
    await to_review(office, "T1")
    for run in await list_runs(office, task_id="T1"):
        assert RFC3339_UTC.match(run["requested_at"]), run
    claimed = await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})
    [event] = [e for e in claimed.events if e.type == "run_claimed"]
    assert event.lease_expires_at == claimed.result["lease_expires_at"]
    assert RFC3339_UTC.match(event.lease_expires_at)
    await decide(office, "T1", "review", "rev-b", "approved")
    listed = await ok(office, {"type": "list_decisions", "task_id": "T1"})
    assert all(RFC3339_UTC.match(d["created_at"]) for d in listed.result["decisions"])
