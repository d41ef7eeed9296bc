"""The `onceflow` command as a newcomer uses it: demo, run, validate, schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onceflow.cli import main

REPO = Path(__file__).resolve().parents[1]
KANDEV = REPO / "tests" / "fixtures" / "kandev"
SCRIPT = REPO / "tests" / "scripts" / "office-default-rejection.jsonl"


def _replies(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _runs(reply: dict[str, object]) -> list[dict[str, object]]:
    events = reply["events"]
    assert isinstance(events, list)
    return [e for e in events if e["type"] == "run_queued"]


def test_run_drives_kandev_office_default_through_a_rejection_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        [
            "run",
            "--workflow",
            str(KANDEV / "office-default.yml"),
            "--script",
            str(SCRIPT),
            "--db",
            str(tmp_path / "run.db"),
            "--json",
        ]
    )
    assert status == 0
    replies = _replies(capsys)
    turns = [r for r in replies if r["command"] == "turn_complete"]
    first_round, second_round = _runs(turns[0]), _runs(turns[1])
    assert [(r["agent_profile_id"], r["reason"]) for r in first_round] == [
        ("reviewer-1", "review_started"),
        ("reviewer-2", "review_started"),
    ]
    tasks = [r["result"] for r in replies if r["command"] == "get_task"]
    assert tasks[0]["step_id"] == "work"  # type: ignore[index]
    assert [r["agent_profile_id"] for r in second_round] == ["reviewer-1", "reviewer-2"]
    first_keys = {r["idempotency_key"] for r in first_round}
    assert first_keys.isdisjoint(r["idempotency_key"] for r in second_round)
    assert tasks[-1]["step_id"] == "done"  # type: ignore[index]


def test_demo_ends_with_the_task_in_done(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--db", str(tmp_path / "demo.db")]) == 0
    out = capsys.readouterr().out
    assert "finished in step 'done'" in out
    assert "simulated restart" in out
    assert "idempotent" in out


def test_validate_accepts_every_kandev_fixture_template(capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(KANDEV.glob("*.yml"))
    assert main(["validate", *map(str, files)]) == 0
    assert capsys.readouterr().out.count("ok: ") == len(files)


@pytest.mark.parametrize(
    ("edit", "step", "field"),
    [
        (
            ("    allow_manual_move: true\n", "    allow_manual_move: true\n    colour: red\n"),
            "backlog",
            "colour",
        ),
        (
            ("        - type: auto_start_agent\n", "        - type: move_to_next\n"),
            "work",
            "on_enter[0].type",
        ),
        (("{step_id: review}", "{step_id: nowhere}"), "work", "step_id"),
    ],
    ids=["unknown-key", "action-not-allowed-for-trigger", "dangling-move-target"],
)
def test_validate_rejects_a_bad_template_naming_file_step_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: tuple[str, str], step: str, field: str
) -> None:
    text = (KANDEV / "office-default.yml").read_text()
    assert edit[0] in text
    bad = tmp_path / "bad.yml"
    bad.write_text(text.replace(edit[0], edit[1], 1))
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.yml" in err and f"step '{step}'" in err and field in err


def test_schema_lists_every_command_type(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    tags = set(schema["command"]["discriminator"]["mapping"])
    assert {"turn_complete", "record_decision", "claim_run", "children_completed"} <= tags
