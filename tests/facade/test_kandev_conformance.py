"""Extra conformance check against Kandev's real templates, when a folder of them is named.

`ONCEFLOW_KANDEV_WORKFLOWS` names a folder of Kandev's template files (`.ci/run` sets it to
`../shared/kandev-workflows` when that folder exists). Unset, these tests are skipped: the suite's own
fixtures (tests/fixtures/kandev/) cover the same shapes. Set, nothing is skipped: a missing folder, an
empty one, a template that fails to load or an office flow that does not complete all fail the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import TESTS

from onceflow.cli.main import main
from onceflow.protocol.workflow import load_workflow_file

ENV = "ONCEFLOW_KANDEV_WORKFLOWS"
NAMED = os.environ.get(ENV)
SCRIPT = TESTS / "scripts" / "office-default-rejection.jsonl"

pytestmark = pytest.mark.skipif(not NAMED, reason=f"{ENV} names no folder of Kandev templates")


def _folder() -> Path:
    assert NAMED is not None
    folder = Path(NAMED)
    assert folder.is_dir(), f"{ENV}={NAMED} is not a folder"
    return folder


def _templates() -> list[Path]:
    if not NAMED:
        return []
    return sorted(Path(NAMED).glob("*.yml"))


def test_kandev_folder_named_holds_templates() -> None:
    assert _templates(), f"{ENV}={NAMED} holds no *.yml template"
    assert (_folder() / "office-default.yml").is_file()


@pytest.mark.parametrize("path", _templates(), ids=lambda path: path.name)
def test_kandev_real_template_loads_with_ordered_steps(path: Path) -> None:
    workflow = load_workflow_file(path)
    assert workflow.start_step.is_start_step
    assert [step.position for step in workflow.ordered_steps] == sorted(s.position for s in workflow.steps)


def test_kandev_real_templates_validate_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    files = _templates()
    assert main(["validate", *map(str, files)]) == 0
    assert capsys.readouterr().out.count("ok: ") == len(files)


def test_kandev_real_office_default_runs_a_rejection_round_to_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        [
            "run",
            "--workflow",
            str(_folder() / "office-default.yml"),
            "--script",
            str(SCRIPT),
            "--db",
            str(tmp_path / "run.db"),
            "--json",
        ]
    )
    assert status == 0
    replies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tasks = [reply["result"] for reply in replies if reply["command"] == "get_task"]
    assert [tasks[0]["step_id"], tasks[-1]["step_id"]] == ["work", "done"]
