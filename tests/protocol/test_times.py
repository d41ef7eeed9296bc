"""The protocol's one time format (protocol/times.py): RFC 3339 UTC in every result and event."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest
from helpers import REPO, decide, list_runs, ok, to_review
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.codec import EVENT_ADAPTER, command_schema, decode_command
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.operation_ids import operation_id
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


@settings(max_examples=2000, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=-62135596800.0, max_value=253402300799.0),
        st.integers(min_value=1_600_000_000_000_000, max_value=1_900_000_000_000_000).map(
            lambda us: us / 1e6
        ),
        st.integers(min_value=-(6 * 10**10), max_value=2 * 10**11).map(lambda s: s + 0.9999995),
        st.integers(min_value=-(6 * 10**10), max_value=2 * 10**11).map(lambda s: s + 0.0000005),
    )
)
def test_rfc3339_is_the_text_datetime_gives(seconds: float) -> None:
    # its per-second cache and its own rounding give datetime's text, microseconds rounded half to even
    # (twice: the second call hits the cache)
    expected = datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds")[:-6] + "Z"
    assert rfc3339(seconds) == expected
    assert rfc3339(seconds) == expected


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -math.inf, 253402300800.0, -62135596801.0, 1e20])
def test_rfc3339_refuses_what_is_no_time_in_years_1_to_9999(seconds: float) -> None:
    with pytest.raises(ValueError):
        rfc3339(seconds)


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


def _properties(schema: Any, path: str = "") -> list[tuple[str, str, Any]]:
    """Every property anywhere in a JSON Schema: (path, name, its schema)."""
    found = []
    if isinstance(schema, dict):
        for name, sub in schema.get("properties", {}).items():
            found.append((path, name, sub))
        for key, sub in schema.items():
            found.extend(_properties(sub, f"{path}.{key}"))
    elif isinstance(schema, list):
        for n, sub in enumerate(schema):
            found.extend(_properties(sub, f"{path}[{n}]"))
    return found


def test_every_time_a_command_takes_accepts_rfc3339_and_says_so() -> None:
    """A command field described in Unix seconds also accepts RFC 3339 UTC text (the schema's string
    option, with the format's pattern), and its description names both."""
    unix = [
        (path, name, sub)
        for path, name, sub in _properties(command_schema()["command"])
        if "unix" in sub.get("description", "").lower().replace("unix>", "")
    ]
    assert {name for _, name, _ in unix} >= {"retry_at", "unix", "period_start"}
    for path, name, sub in unix:
        strings = [o for o in sub.get("anyOf", [sub]) if o.get("type") == "string"]
        assert strings and strings[0].get("pattern") == RFC3339_UTC.pattern, (path, name)
        assert "RFC 3339" in sub["description"], (path, name)


def test_the_docs_never_call_a_time_unix_seconds_without_rfc3339() -> None:
    """Wherever README or docs/ speak of Unix seconds on the wire, the same paragraph says RFC 3339: the
    protocol's one format, a number of Unix seconds being only also accepted on input."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for paragraph in page.read_text(encoding="utf-8").split("\n\n"):
            for line in paragraph.splitlines():
                if "unix seconds" in line.lower():
                    assert "RFC 3339" in paragraph, (page.name, line)


@pytest.mark.parametrize(
    ("sent", "read"),
    [
        ("2026-03-01T12:00:00Z", 1_772_366_400.0),
        ("2026-03-01T12:00:00.250Z", 1_772_366_400.25),
        (1_772_366_400.5, 1_772_366_400.5),
        ("1772366400", 1_772_366_400.0),  # a numeric string, as pydantic always read it
    ],
)
def test_retry_at_reads_rfc3339_or_unix_seconds(sent: Any, read: float) -> None:
    command = decode_command(
        {"type": "finish_run", "run_id": 1, "status": "failed", "unfenced": True, "retry_at": sent}
    )
    assert command.retry_at == read  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("field", "sent", "said"),
    [
        ("retry_at", "tomorrow", "RFC 3339"),
        ("retry_at", "2026-03-01T12:00:00+01:00", "RFC 3339"),
        ("unix", "2026-03-01T12:00:00.5Z", "whole seconds"),
    ],
)
def test_a_time_in_another_format_is_refused_naming_the_field(field: str, sent: str, said: str) -> None:
    base: dict[str, Any] = (
        {"type": "finish_run", "run_id": 1, "status": "failed", "unfenced": True}
        if field == "retry_at"
        else {"type": "heartbeat", "task_id": "T", "step_id": "s"}
    )
    with pytest.raises(ProtocolError) as refused:
        decode_command({**base, field: sent})
    assert refused.value.field == field and said in refused.value.message


def test_a_heartbeat_time_in_rfc3339_names_the_same_operation_as_its_unix_seconds() -> None:
    as_text = decode_command(
        {"type": "heartbeat", "task_id": "T", "step_id": "s", "unix": "2026-03-01T12:00:00Z"}
    )
    as_number = decode_command({"type": "heartbeat", "task_id": "T", "step_id": "s", "unix": 1_772_366_400})
    assert operation_id(as_text) == operation_id(as_number)  # type: ignore[arg-type] == "heartbeat:T:s:1772366400"
