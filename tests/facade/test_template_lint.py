"""The template lint (`onceflow validate`, `--strict`, the register reply's warnings), every problem of a
file reported at once, and `onceflow workflows`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FIXTURES, OFFICE, REPO, create_task, ok, register, setup_office

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.cli.main import main
from onceflow.protocol.template.lint import lint
from onceflow.protocol.workflow import WorkflowError, load_workflow_text

OFFICE_FILE = FIXTURES / "kandev" / "office-default.yml"

LINTED = """\
id: linted
name: Linted
steps:
  - id: start
    name: Start
    position: 0
    is_start_step: true
    events:
      on_enter:
        - type: auto_start_agent
      on_turn_complete:
        - type: move_to_step
          config:
            step_id: review
            wait_for_quorum: {role: reviewer, threshold: all_approve}
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: queue_run_for_each_participant
          config: {role: approver}
      on_turn_complete:
        - type: move_to_step
          config: {step_id: done}
  - id: orphan
    name: Orphan
    position: 2
  - id: done
    name: Done
    position: 3
"""


def codes(text: str) -> list[tuple[str, str | None]]:
    return [(w.code, w.step_id) for w in lint(load_workflow_text(text))]


def test_lint_finds_dead_steps_a_start_on_enter_and_unseated_roles() -> None:
    assert codes(LINTED) == [
        ("start_on_enter", "start"),
        ("quorum_role_unseated", "start"),
        ("fan_out_without_participants", "review"),
        ("unreachable_step", "orphan"),
        ("no_way_out", "orphan"),
    ]


def test_a_seat_or_a_quorum_of_the_role_answers_the_role_warnings() -> None:
    seated = LINTED.replace(
        "      on_enter:\n        - type: auto_start_agent\n",
        "      on_enter:\n        - type: ensure_participant_seat\n          config: {role: reviewer}\n",
    ).replace(
        "{role: approver}",
        "{role: reviewer}\n        - type: ensure_participant_seat\n          config: {role: reviewer}",
    )
    found = codes(seated)
    assert ("quorum_role_unseated", "start") not in found
    assert ("fan_out_without_participants", "review") not in found


def test_validate_prints_warnings_and_strict_makes_them_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "linted.yml"
    path.write_text(LINTED)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr()
    assert "ok: " in out.out and "warning: " in out.err and "step 'orphan' is unreachable" in out.err
    assert "E1" in out.err and "E5" in out.err  # the start step's on_enter: which entry paths run it
    assert main(["validate", "--strict", str(path)]) == 1
    out = capsys.readouterr()
    assert "ok: " not in out.out and out.err.count("invalid: ") == 5


def test_a_field_error_no_longer_hides_a_bad_move_target_in_the_same_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = OFFICE_FILE.read_text()
    bad = text.replace("    allow_manual_move: true\n", "    allow_manual_move: true\n    colour: red\n", 1)
    bad = bad.replace("{step_id: review}", "{step_id: nowhere}")
    with pytest.raises(WorkflowError) as info:
        load_workflow_text(bad, "bad.yml")
    fields = [(e.step_id, e.field.rsplit(".", 1)[-1]) for e in (info.value, *info.value.others)]
    assert fields == [("backlog", "colour"), ("work", "step_id")]
    path = tmp_path / "bad.yml"
    path.write_text(bad)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "colour" in err and "'nowhere'" in err


async def test_register_replies_with_the_lint_warnings(runtime: Runtime) -> None:
    reply = await register(runtime, LINTED)
    assert reply.result["version"] == 1 and reply.result["changed"] is True
    assert [w["code"] for w in reply.result["warnings"]][:2] == ["start_on_enter", "quorum_role_unseated"]
    assert all(w["message"] for w in reply.result["warnings"])


async def test_workflows_view_lists_versions_and_where_tasks_are_pinned(
    runtime: Runtime, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not isinstance(db_path, Path):
        pytest.skip("a SQLite file read beside the runtime")
    await setup_office(runtime, OFFICE_FILE)
    await create_task(runtime, "T1")
    text = OFFICE_FILE.read_text().replace("name: Review\n", "name: Peer review\n")
    await ok(runtime, {"type": "register_workflow", "yaml": text, "source": "office-default.yml"})
    await create_task(runtime, "T2")
    assert main(["workflows", "--db", str(db_path), "--json"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row == {
        "workflow_id": OFFICE,
        "versions": [1, 2],
        "newest": 2,
        "live_tasks_by_version": {"1": 1, "2": 1},
    }
    got = await ok(runtime, {"type": "get_workflow", "workflow_id": OFFICE, "version": 2})
    assert got.result["yaml"] == text and len(got.result["sha256"]) == 64


@pytest.mark.parametrize(
    "path",
    [
        *sorted((REPO / "onceflow" / "examples").glob("*.yml")),
        *sorted((REPO / "tests/fixtures/kandev").glob("*.yml")),
    ],
    ids=lambda path: path.name,
)
def test_the_bundled_examples_and_kandevs_templates_lint_clean_but_a_start_step_created_into(
    path: Path,
) -> None:
    """A backlog before the start step, steps open to manual moves and a quorum whose role the step fans out
    to are how boards are meant to be built: none is a finding. Kandev's routine creates its tasks in a start
    step that declares on_enter, which creation does not run: that one is."""
    found = [w.code for w in lint(load_workflow_text(path.read_text()))]
    assert found == (["start_on_enter"] if path.name == "routine.yml" else [])
