"""The dispatch order of an on_enter declaration, pinned as the pure rule it is (actors/engine/order.py): a
table per entry path, and the memo that plans a loaded template's declaration once per path returns what
planning afresh returns, a fresh list each time, and never another declaration's plan."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.actors.engine import order
from onceflow.actors.engine.order import dispatch_order, leading_segment, plan_chunks
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries.executors import DEFAULT_EXECUTORS

KINDS = (
    "reset_agent_context",
    "configure_session",
    "clear_decisions",
    "queue_run_for_each_participant",
    "auto_start_agent",
    "queue_run",
)


def declared(*kinds: str) -> tuple[ActionDecl, ...]:
    """A declaration of `kinds` (only `type` is read when planning, so configs are left out)."""
    return tuple(ActionDecl.model_construct(type=kind) for kind in kinds)


def order_of(kinds: tuple[str, ...], path: str) -> list[str]:
    """The action types of `kinds` in the order one entry on `path` runs them, position-tagged."""
    return [f"{position}:{action.type}" for position, action in dispatch_order(declared(*kinds), path)]  # type: ignore[arg-type]


MIXED = ("clear_decisions", "reset_agent_context", "auto_start_agent", "queue_run", "configure_session")


@pytest.mark.parametrize("path", ["E1", "E2", "E3", "E5"])
def test_ac_a9_reset_and_configure_lead_and_auto_start_trails_on_e1_to_e3_and_e5(path: str) -> None:
    """AC-A9: reset_agent_context first, configure_session second, auto_start_agent last; the rest keep
    their declared order between them (AC-A1, AC-A12). Positions stay the declared ones."""
    assert order_of(MIXED, path) == [
        "1:reset_agent_context",
        "4:configure_session",
        "0:clear_decisions",
        "3:queue_run",
        "2:auto_start_agent",
    ]


def test_ac_a13_ac_a2_e4_runs_the_declared_order_with_no_hoisting() -> None:
    """AC-A13, AC-A2(ii): switch_workflow runs the declaration as declared: the same coverage as E1, in
    another order."""
    assert order_of(MIXED, "E4") == [
        "0:clear_decisions",
        "1:reset_agent_context",
        "2:auto_start_agent",
        "3:queue_run",
        "4:configure_session",
    ]
    assert sorted(order_of(MIXED, "E4")) == sorted(order_of(MIXED, "E1"))


@pytest.mark.parametrize("path", ["E1", "E4"])
def test_ac_h8_reset_and_configure_run_at_most_once_however_often_declared(path: str) -> None:
    """AC-H8: a repeated reset_agent_context or configure_session runs once, at its first declaration;
    every other type runs once per declaration (AC-H4)."""
    kinds = (
        "reset_agent_context",
        "queue_run",
        "reset_agent_context",
        "configure_session",
        "configure_session",
    )
    got = order_of(kinds, path)
    assert [entry for entry in got if "reset" in entry or "configure" in entry] == [
        "0:reset_agent_context",
        "3:configure_session",
    ]
    assert "1:queue_run" in got


def test_ac_b8_recovery_runs_engine_owned_actions_only_in_declared_order() -> None:
    """AC-B8: a recovery re-dispatch never asks the host for a session action; the engine-owned ones keep
    their declared order and positions."""
    assert order_of(MIXED, "recovery") == ["0:clear_decisions", "3:queue_run"]


def test_ac_a12_a_contiguous_run_of_engine_actions_is_one_segment_and_a_host_action_splits_it() -> None:
    """AC-A12: consecutive engine-owned actions with executors are delegated together (one store request);
    a host action between them splits them, and an engine action without an executor (run_code_review)
    stands alone (it waits on the host). The leading segment is the admitting transaction's."""
    kinds = ("clear_decisions", "queue_run", "set_session_mode", "queue_run", "run_code_review")
    chunks, last = plan_chunks(dispatch_order(declared(*kinds), "E2"), DEFAULT_EXECUTORS, has_entry=True)
    assert [(kind, [p for p, _ in actions]) for kind, actions in chunks] == [
        ("segment", [0, 1]),
        ("session", [2]),
        ("segment", [3]),
        ("external", [4]),
    ]
    assert last == 3
    without_entry, last = plan_chunks(
        dispatch_order(declared(*kinds), "E2"), DEFAULT_EXECUTORS, has_entry=False
    )
    assert [kind for kind, _ in without_entry] == ["session"] and last == -1
    lead = leading_segment(
        attrs_step(kinds),
        "E2",
        DEFAULT_EXECUTORS,  # type: ignore[arg-type]
    )
    assert lead is not None and [p for p, _ in lead[0]] == [0, 1] and lead[1] is False


def attrs_step(kinds: tuple[str, ...]) -> object:
    """A stand-in step: `leading_segment` reads only `events.on_enter`."""

    class Events:
        on_enter = declared(*kinds)

    class Step:
        events = Events()

    return Step()


@given(
    kinds=st.lists(st.sampled_from(KINDS), max_size=6), path=st.sampled_from(["E1", "E2", "E4", "recovery"])
)
def test_the_memoized_dispatch_order_equals_planning_afresh(kinds: list[str], path: str) -> None:
    # only `type` is read when planning, so configs are left out
    declaration = tuple(ActionDecl.model_construct(type=kind) for kind in kinds)
    fresh = dispatch_order(list(declaration), path)  # a list is never memoized
    first = dispatch_order(declaration, path)  # type: ignore[arg-type]
    second = dispatch_order(declaration, path)  # type: ignore[arg-type]
    assert first == second == fresh
    assert first is not second  # callers may keep or change their list
    other = tuple(ActionDecl.model_construct(type=kind) for kind in reversed(kinds))
    assert dispatch_order(other, path) == dispatch_order(list(other), path)  # type: ignore[arg-type]


def test_the_dispatch_order_memo_stays_bounded() -> None:
    order._ORDERS.clear()
    kept = [(ActionDecl.model_construct(type="clear_decisions"),) for _ in range(4100)]
    for declaration in kept:
        dispatch_order(declaration, "E2")
    assert 0 < len(order._ORDERS) <= 4096
