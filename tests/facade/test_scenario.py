"""`onceflow test SCENARIO.yml...`, the scenario harness for workflow authors."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import TESTS

from onceflow.cli.main import main
from onceflow.scenario import ScenarioError, load_scenarios, matches, run_files

HERE = TESTS
OFFICE_CYCLE = HERE / "fixtures" / "scenarios" / "office-default-cycle.yml"
OFFICE_DEFAULT = HERE / "fixtures" / "kandev" / "office-default.yml"

BEATING = """
id: beating
name: Beating
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_heartbeat:
        - {type: queue_run, config: {target: primary, reason: heartbeat}}
"""


def write(tmp_path: Path, scenario: dict[str, Any], name: str = "s.yml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


def office(*steps: dict[str, Any]) -> dict[str, Any]:
    """A scenario on the fixture office-default template with a task T1 created in Backlog first."""
    create = {"type": "create_task", "task_id": "T1", "workflow_id": "office-default", "step_id": "backlog"}
    return {
        "name": "inline",
        "template": str(OFFICE_DEFAULT),
        "participants": [
            {"step_id": "review", "role": "reviewer", "agent_profile_id": a} for a in ("r1", "r2")
        ],
        "steps": [{"send": create}, *steps],
    }


def to_review(**expect: Any) -> dict[str, Any]:
    return {"send": {"type": "turn_complete", "task_id": "T1"}, **expect}


MOVE = {"send": {"type": "move_task", "task_id": "T1", "step_id": "work"}}


def test_office_cycle_scenario_two_reviewers_rejection_round_restart_mid_review(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["test", str(OFFICE_CYCLE)]) == 0
    assert capsys.readouterr().out == "ok: office-default cycle (13 steps)\n"


def test_shipped_example_scenarios_pass(capsys: pytest.CaptureFixture[str]) -> None:
    folder = resources.files("onceflow") / "examples" / "scenarios"
    files = sorted(Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(".yml"))
    assert len(files) == 2
    assert main(["test", *map(str, files)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("ok: ") for line in lines)


def test_an_event_mismatch_prints_a_unified_diff_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = {"type": "run_queued", "agent_profile_id": "r3"}
    path = write(
        tmp_path, office(MOVE, to_review(events=[{"type": "run_queued", "agent_profile_id": "r1"}, wrong]))
    )
    assert main(["test", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        "FAIL: inline: steps[2] (send turn_complete): events differ (in_order; compared types:"
    )
    assert '-{"type": "run_queued", "agent_profile_id": "r3"}' in out
    assert '+{"type": "run_queued", "agent_profile_id": "r2"}' in out
    assert '\n     {"type": "run_queued", "agent_profile_id": "r1"}' in out  # unchanged context line
    assert "--- expected" in out and "+++ actual" in out


def test_a_scenario_stops_at_its_first_failing_step(tmp_path: Path) -> None:
    wrong = {"send": {"type": "get_task", "task_id": "T1"}, "result": {"step_id": "nowhere"}}
    lines: list[str] = []
    assert run_files([write(tmp_path, office(wrong, wrong))], lines.append) == 1
    assert len(lines) == 1
    assert lines[0].startswith("FAIL: inline: steps[1] (send get_task): result differs")


def test_a_result_mismatch_shows_only_the_fields_asked_about(tmp_path: Path) -> None:
    path = write(
        tmp_path, office({"send": {"type": "get_task", "task_id": "T1"}, "result": {"step_id": "work"}})
    )
    lines: list[str] = []
    assert run_files([path], lines.append) == 1
    report = "\n".join(lines)
    assert "steps[1] (send get_task): result differs" in report
    assert '-  "step_id": "work"' in report and '+  "step_id": "backlog"' in report
    assert "workflow_id" not in report


def test_expected_error_codes_and_fields(tmp_path: Path) -> None:
    finish = {"type": "finish_run", "run_id": 99}
    good = office(
        {"send": finish, "error": {"code": "not_found", "field": "run_id"}},
        {"send": finish, "error": "not_found"},
    )
    assert run_files([write(tmp_path, good)], lambda _: None) == 0
    for expected in ("conflict", {"code": "not_found", "field": "task_id"}):
        lines: list[str] = []
        assert run_files([write(tmp_path, office({"send": finish, "error": expected}))], lines.append) == 1
        assert "got not_found (field run_id)" in lines[0]
    lines = []
    assert (
        run_files(
            [write(tmp_path, office({"send": {"type": "get_task", "task_id": "T1"}, "error": "not_found"}))],
            lines.append,
        )
        == 1
    )
    assert "expected error not_found, but the command succeeded" in lines[0]
    lines = []
    assert run_files([write(tmp_path, office({"send": finish}))], lines.append) == 1
    assert "refused: not_found (field run_id)" in lines[0]


def test_any_order_finds_a_matching_even_where_a_greedy_pick_would_not(tmp_path: Path) -> None:
    loose, tight = {"type": "run_queued"}, {"type": "run_queued", "agent_profile_id": "r1"}
    path = write(tmp_path, office(MOVE, to_review(events=[loose, tight], events_order="any_order")))
    assert run_files([path], lambda _: None) == 0
    in_order = write(tmp_path, office(MOVE, to_review(events=[loose, tight])), "in_order.yml")
    assert run_files([in_order], lambda _: None) == 1  # r1 is queued first, so in order the tight one misses


def test_advance_reaches_the_5_second_coalescing_window(tmp_path: Path) -> None:
    (tmp_path / "beating.yml").write_text(BEATING)

    def beat(unix: int, event: dict[str, Any]) -> dict[str, Any]:
        return {
            "send": {"type": "heartbeat", "task_id": "T1", "step_id": "work", "unix": unix},
            "event_types": ["run_queued", "run_coalesced"],
            "events": [event],
        }

    queued, coalesced = {"type": "run_queued", "run_id": 1}, {"type": "run_coalesced", "run_id": 1}
    steps = [
        {"send": {"type": "create_task", "task_id": "T1", "workflow_id": "beating", "primary_agent_id": "w"}},
        beat(1, queued),
        {"advance": 4},
        beat(2, coalesced),
        {"advance": 6},
        beat(3, {"type": "run_queued", "run_id": 2}),
    ]
    assert run_files([write(tmp_path, {"template": "beating.yml", "steps": steps})], lambda _: None) == 0
    steps[4] = {"advance": 0.5}  # still inside the window: the third beat coalesces, the scenario fails
    lines: list[str] = []
    assert run_files([write(tmp_path, {"template": "beating.yml", "steps": steps})], lines.append) == 1
    assert '+{"type": "run_coalesced", "run_id": 1}' in lines[0]


@pytest.mark.parametrize(
    ("steps", "field", "message"),
    [
        ([{"send": {"type": "move_task", "task_id": "T1"}}], "steps[0].send.step_id", "Field required"),
        ([{"send": {"type": "nope"}}], "steps[0].send.type", "unknown command type"),
        ([{"advance": 1, "restart": True}], "steps[0]", "exactly one of"),
        ([{"advance": -1}], "steps[0].advance", "greater than 0"),
        ([{"advance": 1, "result": {}}], "steps[0].result", "only a send step"),
        ([{"restart": True, "events": []}], "steps[0].events", "only send and advance"),
        ([{"advance": 1, "events": [{"type": "transit"}]}], "steps[0].events[0].type", "unknown event type"),
        (
            [{"advance": 1, "events": [{"type": "transition", "to": "x"}]}],
            "steps[0].events[0].to",
            "not a field",
        ),
        ([{"advance": 1, "event_types": ["x"]}], "steps[0].event_types[0]", "unknown event type"),
        ([{"advance": 1, "colour": "red"}], "steps[0].colour", "unknown key"),
        ([{"advance": 1, "evnts": []}], "steps[0].evnts", "unknown key (did you mean 'events'?)"),
        ([{"send": {"type": "move_tsk"}}], "steps[0].send.type", "(did you mean 'move_task'?)"),
        (
            [{"advance": 1, "events": [{"type": "transition", "to_stp": "x"}]}],
            "steps[0].events[0].to_stp",
            "not a field of event transition (did you mean 'to_step'?)",
        ),
        ([], "steps", "at least 1"),
    ],
)
def test_a_malformed_scenario_is_a_typed_error_naming_step_and_field(
    tmp_path: Path, steps: list[dict[str, Any]], field: str, message: str
) -> None:
    path = write(tmp_path, {"template": str(OFFICE_DEFAULT), "steps": steps})
    with pytest.raises(ScenarioError) as caught:
        load_scenarios(path)
    assert caught.value.field == field
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_a_command_expected_to_be_invalid_is_not_prevalidated(tmp_path: Path) -> None:
    step = {
        "send": {"type": "move_task", "task_id": "T1"},
        "error": {"code": "invalid_message", "field": "step_id"},
    }
    assert run_files([write(tmp_path, office(step))], lambda _: None) == 0


def test_an_invalid_file_is_reported_and_the_others_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(tmp_path, {"template": "missing.yml", "steps": [{"advance": 1}]}, "bad.yml")
    assert main(["test", str(bad), str(OFFICE_CYCLE)]) == 1
    captured = capsys.readouterr()
    assert "invalid: " in captured.err and "bad.yml: template: cannot read" in captured.err
    assert captured.out == "ok: office-default cycle (13 steps)\n"


def test_several_scenarios_in_one_file_each_get_a_line(tmp_path: Path) -> None:
    one = {"template": str(OFFICE_DEFAULT), "steps": [{"advance": 1}]}
    path = tmp_path / "two.yml"
    path.write_text(yaml.safe_dump_all([one, {**one, "name": "second"}]))
    lines: list[str] = []
    assert run_files([path], lines.append) == 0
    assert lines == ["ok: two#1 (1 steps)", "ok: second (1 steps)"]


@pytest.mark.parametrize(
    ("expected", "actual", "same"),
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),
        ({"a": 1, "c": 3}, {"a": 1}, False),
        ([{"a": 1}], [{"a": 1, "b": 2}], True),
        ([{"a": 1}], [{"a": 1}, {"a": 2}], False),
        (1, 1.0, True),
        (1, True, False),
        (None, None, True),
        ({"a": {"b": [1]}}, {"a": {"b": [1], "c": 0}}, True),
    ],
)
def test_results_match_as_subsets(expected: Any, actual: Any, same: bool) -> None:
    assert matches(expected, actual) is same


def test_readme_scenario_command_and_example_hold(tmp_path: Path) -> None:
    section = (HERE.parent / "docs" / "testing.md").read_text(encoding="utf-8")
    [command] = [line for line in section.splitlines() if line.startswith("onceflow test ")]
    files = sorted((HERE.parent / "onceflow" / "examples" / "scenarios").glob("*.yml"))
    assert command == "onceflow test onceflow/examples/scenarios/*.yml" and files
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    example["template"] = str(HERE.parent / "onceflow" / "examples" / "office-example.yml")
    lines: list[str] = []
    assert run_files([write(tmp_path, example)], lines.append) == 0, "\n".join(lines)


def test_a_difference_deep_inside_a_result_names_its_path_and_both_values(tmp_path: Path) -> None:
    listed = {"send": {"type": "list_tasks"}, "result": {"tasks": [{"step_id": "work", "colour": "red"}]}}
    lines: list[str] = []
    assert run_files([write(tmp_path, office(listed))], lines.append) == 1
    report = "\n".join(lines)
    assert 'result.tasks[0].step_id: expected "work", got "backlog"' in report
    assert 'result.tasks[0].colour: expected "red", got (missing)' in report


def test_an_event_difference_names_the_event_field_and_both_values(tmp_path: Path) -> None:
    wrong = [
        {"type": "run_queued", "agent_profile_id": "r1"},
        {"type": "run_queued", "agent_profile_id": "r3"},
    ]
    lines: list[str] = []
    assert run_files([write(tmp_path, office(MOVE, to_review(events=wrong)))], lines.append) == 1
    report = "\n".join(lines)
    assert 'events[1].agent_profile_id: expected "r3", got "r2"' in report
    assert "events[0]" not in report
    lines.clear()
    assert run_files([write(tmp_path, office(MOVE, to_review(events=wrong[:1])))], lines.append) == 1
    assert "expected 1 events, got 2" in "\n".join(lines)
