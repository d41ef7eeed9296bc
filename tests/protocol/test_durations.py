"""Configured durations are finite and positive everywhere (a NaN redelivery interval
was accepted and redelivered in a hot loop)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.coordinator import RetryPolicy
from onceflow.protocol.durations import seconds

NOT_DURATIONS = [math.nan, math.inf, -math.inf, 0.0, -1.0, -1e-9, 10**400, "60", None, True]


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers())
def test_a_duration_is_accepted_exactly_when_finite_and_positive(value: float) -> None:
    if math.isfinite(value) and value > 0:
        assert seconds("interval", value) == float(value)
    else:
        with pytest.raises(ValueError, match=r"^interval must be"):
            seconds("interval", value)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_an_idle_timeout_may_be_zero_but_must_be_finite_and_not_negative(value: float) -> None:
    if math.isfinite(value) and value >= 0:
        assert seconds("idle", value, allow_zero=True) == value
    else:
        with pytest.raises(ValueError, match=r"^idle must be"):
            seconds("idle", value, allow_zero=True)


@pytest.mark.parametrize("value", NOT_DURATIONS, ids=repr)
async def test_open_runtime_refuses_a_bad_redelivery_interval_before_opening_anything(
    db_path: Path, value: Any
) -> None:
    with pytest.raises(ValueError, match="redelivery_interval"):
        async with open_runtime(db_path, redelivery_interval=value):
            pytest.fail("a runtime opened with a redelivery interval that is not a duration")
    assert not db_path.exists()


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, "0"], ids=repr)
async def test_open_runtime_refuses_a_bad_actor_idle_timeout_before_opening_anything(
    db_path: Path, value: Any
) -> None:
    with pytest.raises(ValueError, match="actor_idle_timeout"):
        async with open_runtime(db_path, actor_idle_timeout=value):
            pytest.fail("a runtime opened with an idle timeout that is not a duration")
    assert not db_path.exists()


@pytest.mark.parametrize(
    "field", ["initial_interval", "maximum_interval", "attempt_timeout", "cycle_timeout"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -2.0], ids=repr)
def test_retry_policy_durations_are_finite_and_positive(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        RetryPolicy(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("backoff_coefficient", math.nan), ("backoff_coefficient", 0.5), ("maximum_attempts", 0)],
)
def test_retry_policy_refuses_a_coefficient_below_one_and_no_attempts(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        RetryPolicy(**{field: value})
