"""Where code lives says where it runs, and the rooms stay that way.

`actors/` is the Trio side: no function there takes a database connection and no SQL text lives there.
`store/` owns every statement. `protocol/` is the wire and the host contracts: importing it loads no actor
and no store module. Lower layers never import higher ones: protocol < store < actors < the facade
(`onceflow/observability/logs.py`, `onceflow/observability/metrics.py` and `onceflow/observability/tracing.py`
are leaves every layer may use). Every module's docstring says which thread runs it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

CONNECTION_NAMES = {"conn", "connection", "cursor", "cur"}
SQL = re.compile(r"\b(SELECT\s.+\sFROM|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM)\b", re.S | re.I)
LEAVES = {
    "onceflow.observability",
    "onceflow.observability.logs",
    "onceflow.observability.metrics",
    "onceflow.observability.tracing",
}
LAYERS = {  # folder -> the onceflow packages its modules may import (besides the leaves)
    "protocol": ("onceflow.protocol",),
    "store": ("onceflow.protocol", "onceflow.store"),
    "actors": ("onceflow.protocol", "onceflow.store", "onceflow.actors"),
}


ROOMS = ("actors", "store", "protocol")  # packages under onceflow/, each a layer of its own


def sources(folder: str) -> list[Path]:
    """Every module of a room (`actors`, `store`, `protocol`) or of the facade, its rooms aside."""
    if folder in ROOMS:
        return sorted((REPO / "onceflow" / folder).rglob("*.py"))
    rooms = tuple(str(REPO / "onceflow" / room) for room in ROOMS)
    return sorted(p for p in (REPO / folder).rglob("*.py") if not str(p).startswith(rooms))


def functions_taking_a_connection(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg in CONNECTION_NAMES or "Connection" in annotation or "sqlite3" in annotation:
                    found.append(f"{getattr(node, 'name', 'lambda')}:{node.lineno}")
    return found


def sql_strings(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.search(node.value)
    ]


def imported_modules(tree: ast.AST) -> set[str]:
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "onceflow":  # `from onceflow import logs`
            modules.update(f"onceflow.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_no_function_under_actors_takes_a_database_connection() -> None:
    found = {
        str(path.relative_to(REPO)): hits
        for path in sources("actors")
        if (hits := functions_taking_a_connection(ast.parse(path.read_text())))
    }
    assert found == {}


def test_no_sql_text_lives_under_actors() -> None:
    found = {
        str(path.relative_to(REPO)): lines
        for path in sources("actors")
        if (lines := sql_strings(ast.parse(path.read_text())))
    }
    assert found == {}


def test_the_checks_are_not_vacuous() -> None:
    """A function taking `conn`, one annotated with a Connection, and an SQL string are each found."""
    tree = ast.parse(
        "def f(conn): pass\ndef g(db: Connection): pass\nh = lambda cur: cur\nQ = 'SELECT id FROM tasks'\n"
    )
    assert len(functions_taking_a_connection(tree)) == 3
    assert sql_strings(tree) == [4]
    assert len(sources("actors")) > 20 and len(sources("store")) > 20


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_a_layer_imports_nothing_above_it(folder: str) -> None:
    allowed = LAYERS[folder]
    found = {}
    for path in sources(folder):
        wrong = sorted(
            module
            for module in imported_modules(ast.parse(path.read_text()))
            if module.startswith("onceflow")
            and module not in LEAVES
            and not any(module == a or module.startswith(a + ".") for a in allowed)
        )
        if wrong:
            found[str(path.relative_to(REPO))] = wrong
    assert found == {}


def test_importing_the_protocol_loads_no_actor_and_no_store_module() -> None:
    code = (
        "import sys, onceflow.protocol, onceflow.protocol.errors\n"
        "print(sorted(m for m in sys.modules if m.startswith(('onceflow.actors', 'onceflow.store'))))"
    )
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == "[]"


def test_the_facade_still_gives_every_public_name() -> None:
    code = (
        "import sys, onceflow\n"
        "assert not any(m.startswith('onceflow.actors') for m in sys.modules)\n"
        "missing = [n for n in onceflow.__all__ if getattr(onceflow, n, None) is None]\n"
        "print(missing)"
    )
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == "[]"


@pytest.mark.parametrize("folder", ["actors", "store", "protocol", "onceflow"])
def test_every_module_docstring_names_its_thread(folder: str) -> None:
    unnamed = [
        str(path.relative_to(REPO))
        for path in sources(folder)
        if not re.search(r"\b(thread|[Pp]ure)\b", ast.get_docstring(ast.parse(path.read_text())) or "")
    ]
    assert unnamed == []


TRACKER_NUMBER = re.compile(r"\bissue[ _]?#?\d+|\btest_issue\d+|\bturn-\d+\b", flags=re.IGNORECASE)


def test_no_tracker_number_names_a_test_or_sits_in_the_tree() -> None:
    """Code, docs and tests say the rule or its spec AC id, never the ticket that asked for it."""
    folders = ("onceflow", "tests", "bench", "docs", "examples")
    pages = [REPO / "README.md", REPO / "pyproject.toml"]
    for folder in folders:
        pages += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".go", ".yml", ".toml")]
    cited = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in pages
        if page.is_file()
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        if TRACKER_NUMBER.search(line) and "TRACKER_NUMBER = " not in line and "an issue number" not in line
    ]
    assert cited == []
