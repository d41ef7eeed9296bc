"""`onceflow --help` and `onceflow validate` start without the machinery they do not use: each subcommand
imports its own modules when it runs (bench/startup.py times them)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from onceflow.cli import main as cli

KANDEV_TEMPLATE = REPO / "tests" / "fixtures" / "kandev" / "office-default.yml"

# Prints the modules the command imported (as JSON on stderr) once it has run.
_PROBE = """
import json, sys
from onceflow.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""

NEVER = ("pytest", "_pytest", "psycopg", "opentelemetry", "trio.testing")
"""What no command imports unless it runs a scenario, a runtime or a PostgreSQL database."""


def _imported(*args: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    return set(json.loads(done.stderr.splitlines()[-1]))


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def test_help_imports_no_runtime_protocol_models_or_optional_package() -> None:
    modules = _imported("--help")
    unwanted = (*NEVER, "trio", "pydantic", "structlog", "yaml", "sqlite3", "onceflow.actors")
    assert _loaded(modules, unwanted) == []
    assert _loaded(modules, ("onceflow.protocol",)) == []  # not even the package's index


def test_validate_imports_the_template_loader_and_no_runtime() -> None:
    modules = _imported("validate", str(KANDEV_TEMPLATE))
    assert "onceflow.protocol.workflow" in modules
    unwanted = (*NEVER, "trio", "structlog", "sqlite3", "onceflow.actors", "onceflow.protocol.commands")
    assert _loaded(modules, unwanted) == []
    # a plain command line is read without argparse; signal and difflib are imported only where needed
    assert _loaded(modules, ("argparse", "signal", "difflib")) == []


def test_validate_as_its_own_process_freezes_what_it_imported_and_collects_again_after() -> None:
    probe = (
        "import gc, sys\n"
        "from onceflow.cli.main import main\n"
        f"sys.argv = ['onceflow', 'validate', {str(KANDEV_TEMPLATE)!r}]\n"
        "status = main()\n"
        "print(status, gc.isenabled(), gc.get_freeze_count() > 10000, file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    assert done.stderr.split() == ["0", "True", "True"]
    frozen = (
        gc.get_freeze_count()
    )  # called with its arguments (as tests and hosts do): the collector as it was
    assert cli.main(["validate", str(KANDEV_TEMPLATE)]) == 0
    assert gc.get_freeze_count() == frozen and gc.isenabled()


_PLAIN = (
    ["validate", "a.yml"],
    ["validate", "a", "b"],
    ["validate", "--strict", "a"],
    ["validate", "a", "--strict"],
)
_OTHER = (
    ["validate"],
    ["validate", "--strict"],
    ["validate", "a", "--strict", "b"],
    ["validate", "--strict", "a", "--strict"],
    ["validate", "-", "a"],
    ["validate", "--str", "a"],
    ["validate", "a", "--help"],
    ["--verbose", "validate", "a"],
    ["schema", "a"],
)


@pytest.mark.parametrize("argv", [*_PLAIN, *_OTHER])
def test_a_plain_validate_is_read_as_argparse_reads_it_and_anything_else_by_argparse(argv: list[str]) -> None:
    plain = cli._validate_args(argv)
    assert (plain is not None) == (argv in _PLAIN)
    if plain is not None:
        args = cli._parser("validate").parse_args(argv)
        assert plain == (args.files, args.strict)


def test_the_scenario_runner_imports_trio_testing_only_when_a_scenario_runs() -> None:
    assert _loaded(_imported("test", "--help"), ("pytest", "_pytest", "trio.testing")) == []


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_top_level_help_lists_each_subcommand_with_its_own_modules_help_line() -> None:
    every = cli._parser(every=True)
    assert cli._parser().format_help() == every.format_help()
    assert list(_subcommands(every)) == list(cli.COMMANDS)


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_a_subcommand_made_alone_parses_and_helps_as_in_the_whole_parser(name: str) -> None:
    alone, every = cli._parser(name), cli._parser(every=True)
    assert _subcommands(alone)[name].format_help() == _subcommands(every)[name].format_help()
    assert alone.format_usage() == every.format_usage()
