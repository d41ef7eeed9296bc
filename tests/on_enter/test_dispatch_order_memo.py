"""`dispatch_order` plans a loaded template's declaration once per path (issue 14): the memo returns what
planning afresh returns, a fresh list each time, and a different declaration never gets another's plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from onceflow.actors.engine import order
from onceflow.actors.engine.order import dispatch_order
from onceflow.protocol.workflow import ActionDecl

KINDS = (
    "reset_agent_context",
    "configure_session",
    "clear_decisions",
    "queue_run_for_each_participant",
    "auto_start_agent",
    "queue_run",
)


@given(
    kinds=st.lists(st.sampled_from(KINDS), max_size=6), path=st.sampled_from(["E1", "E2", "E4", "recovery"])
)
def test_issue14_the_memoized_dispatch_order_equals_planning_afresh(kinds: list[str], path: str) -> None:
    # only `type` is read when planning, so configs are left out
    declaration = tuple(ActionDecl.model_construct(type=kind) for kind in kinds)
    fresh = dispatch_order(list(declaration), path)  # a list is never memoized
    first = dispatch_order(declaration, path)  # type: ignore[arg-type]
    second = dispatch_order(declaration, path)  # type: ignore[arg-type]
    assert first == second == fresh
    assert first is not second  # callers may keep or change their list
    other = tuple(ActionDecl.model_construct(type=kind) for kind in reversed(kinds))
    assert dispatch_order(other, path) == dispatch_order(list(other), path)  # type: ignore[arg-type]


def test_issue14_the_dispatch_order_memo_stays_bounded() -> None:
    order._ORDERS.clear()
    kept = [(ActionDecl.model_construct(type="clear_decisions"),) for _ in range(4100)]
    for declaration in kept:
        dispatch_order(declaration, "E2")
    assert 0 < len(order._ORDERS) <= 4096
