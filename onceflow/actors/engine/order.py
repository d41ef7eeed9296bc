"""The dispatch order of an entry's on_enter declaration: which action runs when, on each entry path, and
how the order splits into what the host does and what the store does. Pure.

On E1-E3 and E5 the session-scoped actions go to the host at fixed positions (reset_agent_context first,
configure_session second, auto_start_agent last) and the rest run in declared order between them; on E4
(switch_workflow) every action runs in declared order; a recovery re-dispatch runs engine-owned actions
only (on-enter-action-dispatch.md, "The ownership partition", AC-A13, AC-B8, AC-H8).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Literal

from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import ENGINE_ACTION_TYPES, SESSION_ACTION_TYPES, ActionDecl, Step

_LEADING = ("reset_agent_context", "configure_session")


_ORDERS: dict[tuple[int, str], tuple[Sequence[ActionDecl], tuple[tuple[int, ActionDecl], ...]]] = {}
"""Memo of `dispatch_order` by (id of the declaration, path), holding the declaration so its id stays its
own; cleared when it holds 4,096 (re-registered templates bring new declarations)."""


def dispatch_order(declaration: Sequence[ActionDecl], path: EntryPath) -> list[tuple[int, ActionDecl]]:
    """The (position, action) sequence one entry executes; positions index the whole declared list.

    E4 keeps declared order. Elsewhere: reset_agent_context then configure_session (each at most once,
    AC-H8), the rest in declared order, auto_start_agent last. `recovery` keeps engine-owned actions only.
    A declaration that is a tuple (a loaded template's, immutable) is planned once per path (~10 us per
    call otherwise, twice per entry).
    """
    if not isinstance(declaration, tuple):
        return _order(declaration, path)
    memo = _ORDERS.get((id(declaration), path))
    if memo is None or memo[0] is not declaration:
        if len(_ORDERS) >= 4096:
            _ORDERS.clear()
        memo = _ORDERS[(id(declaration), path)] = (declaration, tuple(_order(declaration, path)))
    return list(memo[1])


def _order(declaration: Sequence[ActionDecl], path: EntryPath) -> list[tuple[int, ActionDecl]]:
    indexed = list(enumerate(declaration))
    if path == "recovery":
        return [(p, a) for p, a in indexed if a.type in ENGINE_ACTION_TYPES]
    if path == "E4":  # declared order, no hoisting (AC-A13); reset/configure still at most once (AC-H8)
        firsts = {kind: next((p for p, a in indexed if a.type == kind), None) for kind in _LEADING}
        return [(p, a) for p, a in indexed if a.type not in _LEADING or firsts[a.type] == p]
    leading = [next(((p, a) for p, a in indexed if a.type == kind), None) for kind in _LEADING]
    middle = [(p, a) for p, a in indexed if a.type not in (*_LEADING, "auto_start_agent")]
    trailing = next(((p, a) for p, a in indexed if a.type == "auto_start_agent"), None)
    return [pa for pa in (*leading, *middle, trailing) if pa is not None]


ChunkKind = Literal["session", "segment", "external"]
Chunk = tuple[ChunkKind, list[tuple[int, ActionDecl]]]
"""A run of the dispatch order: one session action (the host's), a segment (consecutive engine actions with
executors: one store request), or one external engine action (no executor, or run_code_review: it waits on
the host between its claim and its completion)."""


def plan_chunks(
    order: Sequence[tuple[int, ActionDecl]], executors: Container[str], *, has_entry: bool
) -> tuple[list[Chunk], int]:
    """`order` split into chunks (`Chunk`), and the index of the last engine chunk (-1: none). Engine
    actions are dropped when the entry has no record (`has_entry` False: its step declares none, AC-E5)."""
    chunks: list[Chunk] = []
    for position, action in order:
        kind: ChunkKind
        if action.type in SESSION_ACTION_TYPES:
            kind = "session"
        elif not has_entry:
            continue
        else:
            kind = "segment" if action.type in executors else "external"
        if kind == "segment" and chunks and chunks[-1][0] == "segment":
            chunks[-1][1].append((position, action))
        else:
            chunks.append((kind, [(position, action)]))
    engine = [i for i, (kind, _) in enumerate(chunks) if kind != "session"]
    return chunks, engine[-1] if engine else -1


def leading_segment(
    step: Step, path: EntryPath, executors: Container[str]
) -> tuple[tuple[tuple[int, ActionDecl], ...], bool] | None:
    """The dispatch's first chunk when it is a segment, and whether it is also its last engine chunk; None
    when the dispatch starts with a host action, which must come first.

    An admitting transaction may run it (no digest check: the declaration is the one the entry was
    allocated from) so the step change and its first effects share one commit. Planned before the entry
    exists: a step whose on_enter declares an engine action always gets one.
    """
    chunks, last_engine = plan_chunks(dispatch_order(step.events.on_enter, path), executors, has_entry=True)
    if not chunks or chunks[0][0] != "segment":
        return None
    return tuple(chunks[0][1]), last_engine == 0
