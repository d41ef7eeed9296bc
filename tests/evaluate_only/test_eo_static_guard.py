"""AC-EO-15: a closed-set pin of every non-test `HandleInput(...)` that pairs evaluate_only=True with an
operation id.

Predicate (purely syntactic): a call of `HandleInput` (bare or as an attribute, e.g. `engine.HandleInput`)
whose evaluate_only — keyword or fourth positional argument — is the literal True, and whose operation_id —
keyword or third positional argument — is present and not the empty-string literal. A call without an
operation id is not detected (AC-EO-7 makes it unaffected); a HandleInput built elsewhere and passed in is
a known, accepted blind spot. The guard does not check that the caller honours `operation_mark_deferred`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "onceflow"  # its rooms (actors/, store/, protocol/) and the facade

REGISTERED = frozenset(
    {
        "actors/task/triggers.py:agent_error",
        "actors/task/triggers.py:children_completed",  # the explicit defer_operation_mark path
    }
)

REMEDIATION = (
    "new evaluate_only=True HandleInput call site(s) with an operation id: {sites}. Before adding them to "
    "REGISTERED, make each caller honour HandleResult.operation_mark_deferred — mark iff its commit landed "
    "(AC-EO-10) — and hold the operation's lock from before the load until after the mark (AC-EO-13). "
    "Editing the registered set is the review gate (AC-EO-15)."
)


def _literal(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is type(value) and node.value == value


def _argument(call: ast.Call, keyword: str, position: int) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def is_offending(call: ast.Call) -> bool:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name != "HandleInput":
        return False
    operation = _argument(call, "operation_id", 2)
    return _literal(_argument(call, "evaluate_only", 3), True) and not (
        operation is None or _literal(operation, "")
    )


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[str] = []

    def _nested(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _nested

    def visit_Call(self, node: ast.Call) -> None:
        if is_offending(node):
            self.found.append(".".join(self.scope) or "<module>")
        self.generic_visit(node)


def offending_functions(source: str) -> list[str]:
    finder = _Finder()
    finder.visit(ast.parse(source))
    return finder.found


def package_sources() -> dict[str, str]:
    files = sorted(PACKAGE.rglob("*.py"))
    return {
        path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8")
        for path in files
        if "tests" not in path.parts and not path.name.startswith("test_")
    }


def scan() -> set[str]:
    return {
        f"{rel}:{qualname}"
        for rel, text in package_sources().items()
        for qualname in offending_functions(text)
    }


def test_ac_eo_15_evaluate_only_callers_with_an_operation_id_are_registered() -> None:
    sources = package_sources()
    assert (
        "actors/task/triggers.py" in sources and "actors/engine/engine.py" in sources
    )  # the walk sees the package
    unregistered = sorted(scan() - REGISTERED)
    assert not unregistered, REMEDIATION.format(sites=", ".join(unregistered))


def test_ac_eo_15_registered_set_has_no_stale_entry() -> None:
    stale = sorted(REGISTERED - scan())
    assert not stale, f"registered call sites no longer found (remove them from REGISTERED): {stale}"


@pytest.mark.parametrize(
    ("snippet", "offending"),
    [
        ("HandleInput(t, trig, op, evaluate_only=True)", True),
        ("HandleInput(t, trig, operation_id=op, evaluate_only=True)", True),
        ("engine.HandleInput(task_id=t, trigger=trig, operation_id=make_id(), evaluate_only=True)", True),
        ("HandleInput(t, trig, op, True)", True),
        ("HandleInput(t, trig, 'agent_error:x', evaluate_only=True, defer_operation_mark=True)", True),
        ("HandleInput(t, trig, operation_id='', evaluate_only=True)", False),
        ("HandleInput(t, trig, '', evaluate_only=True)", False),
        ("HandleInput(t, trig, evaluate_only=True)", False),
        ("HandleInput(t, trig, op)", False),
        ("HandleInput(t, trig, op, evaluate_only=False)", False),
        ("HandleInput(t, trig, op, evaluate_only=flag)", False),
        ("HandleInput(t, trig, op, evaluate_only=1)", False),
        ("HandleResult(t, trig, op, evaluate_only=True)", False),
    ],
)
def test_ac_eo_15_guard_predicate(snippet: str, offending: bool) -> None:
    call = ast.parse(snippet, mode="eval").body
    assert isinstance(call, ast.Call)
    assert is_offending(call) is offending


def test_ac_eo_15_guard_keys_a_new_caller_by_its_enclosing_function() -> None:
    source = (
        "class Dispatcher:\n"
        "    async def on_budget(self, op):\n"
        "        return HandleInput(self.task_id, Trigger.on_budget_alert, op, evaluate_only=True)\n"
        "    async def on_turn(self):\n"
        "        return HandleInput(self.task_id, Trigger.on_turn_complete, '', evaluate_only=True)\n"
        "def helper(op):\n"
        "    return HandleInput('t', Trigger.on_comment, operation_id=op, evaluate_only=True)\n"
    )
    assert offending_functions(source) == ["Dispatcher.on_budget", "helper"]
    unregistered = {f"actors/new.py:{name}" for name in offending_functions(source)} - REGISTERED
    message = REMEDIATION.format(sites=", ".join(sorted(unregistered)))
    assert unregistered == {"actors/new.py:Dispatcher.on_budget", "actors/new.py:helper"}
    assert all(ac in message for ac in ("AC-EO-10", "AC-EO-13", "AC-EO-15"))
