"""The `onceflow` command as a newcomer uses it: demo, run, validate, schema."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import REPO

from onceflow.actors.runtime.startup import open_runtime
from onceflow.cli.main import main
from onceflow.store.backends.lock import acquire_database_lock

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
    decisions = [line for line in out.splitlines() if line.startswith("> record_decision ")]
    assert decisions and all(" decider_type=agent " in line for line in decisions)  # it is required


def test_demo_on_a_database_that_already_ran_it_stops_at_the_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's steps rest on each other: run again on its own database, its create_task is refused and
    it stops there with one line saying so (exit 1), instead of a traceback further on."""
    db = str(tmp_path / "demo.db")
    assert main(["demo", "--db", db]) == 0
    capsys.readouterr()
    assert main(["demo", "--db", db]) == 1
    out = capsys.readouterr().out
    assert "-- demo stopped: create_task was refused" in out and "it needs a new database" in out
    assert "> claim_run" not in out


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


# --- the command line behaves like a Unix tool -----------------------------------
# Real processes of `python -m onceflow.cli`, as a shell would run them.

MINIMAL = REPO / "tests" / "fixtures" / "workflows" / "minimal.yml"


def _env() -> dict[str, str]:
    # Same import path as this process; the child runs in a temp dir so the checkout cannot shadow it.
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "PYTHONUNBUFFERED": "1",
    }


def onceflow(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=120,
    )


def one_error_line(done: subprocess.CompletedProcess[str], *names: str) -> str:
    """The single stderr line of a failed command: `error: ...` naming every one of `names`."""
    assert done.returncode == 2, done
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ") and "Traceback" not in done.stderr
    assert all(name in line for name in names), line
    return line


def test_version_prints_the_package_version(tmp_path: Path) -> None:
    done = onceflow(tmp_path, "--version")
    assert (done.returncode, done.stdout) == (0, f"onceflow {metadata.version('onceflow')}\n")


def _corrupt(path: Path) -> Path:
    path.write_bytes(b"this is not an SQLite database, not even close" * 100)
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize("make", [_corrupt, _directory], ids=["corrupt-database", "a-directory"])
def test_an_unusable_database_is_one_error_line_naming_it(tmp_path: Path, make: Any) -> None:
    db = make(tmp_path / "bad.db")
    for args in (["demo", "--db", str(db)], ["run", "--workflow", str(MINIMAL), "--script", str(SCRIPT)]):
        if args[0] == "run":
            args += ["--db", str(db)]
        one_error_line(onceflow(tmp_path, *args), str(db))


def test_db_in_a_missing_folder_is_refused_and_no_folder_is_created(tmp_path: Path) -> None:
    db = tmp_path / "typo" / "run.db"
    line = one_error_line(onceflow(tmp_path, "demo", "--db", str(db)), str(db))
    assert "does not exist" in line
    assert not (tmp_path / "typo").exists()


def test_a_missing_or_non_utf8_input_file_is_one_error_line_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    one_error_line(
        onceflow(tmp_path, "run", "--workflow", str(MINIMAL), "--script", str(missing)), str(missing)
    )
    latin1 = tmp_path / "latin1.yml"
    latin1.write_bytes(MINIMAL.read_bytes().replace(b"name: Fixture", b"name: Caf\xe9"))
    line = one_error_line(
        onceflow(tmp_path, "run", "--workflow", str(latin1), "--script", str(SCRIPT)), str(latin1)
    )
    assert "not UTF-8" in line


def test_a_database_owned_by_another_runtime_is_one_error_line(tmp_path: Path) -> None:
    db = tmp_path / "owned.db"
    with acquire_database_lock(db):
        line = one_error_line(onceflow(tmp_path, "demo", "--db", str(db)), str(db))
    assert "already owned" in line


def test_validate_checks_every_file_and_reports_every_error_with_close_names(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.yml"
    latin1.write_bytes(MINIMAL.read_bytes().replace(b"name: Fixture", b"name: Caf\xe9"))
    typos = tmp_path / "typos.yml"
    typos.write_text(
        MINIMAL.read_text().replace("steps:", "stpes:").replace("description:", "descripton:"),
        encoding="utf-8",
    )
    done = onceflow(
        tmp_path, "validate", str(latin1), str(tmp_path / "missing.yml"), str(typos), str(MINIMAL)
    )
    assert done.returncode == 2  # the worst of: a file that cannot be read (2), an invalid one (1)
    assert done.stdout == f"ok: {MINIMAL}: fixture (4 steps)\n"  # the files after the bad ones were checked
    lines = [line for line in done.stderr.splitlines() if not line.startswith(f"warning: {MINIMAL}:")]
    assert [line.split(":")[0] for line in lines] == ["error", "error", "invalid", "invalid", "invalid"]
    assert str(latin1) in lines[0] and "not UTF-8" in lines[0]
    assert "missing.yml" in lines[1]
    assert f"invalid: {typos}: field 'steps': required key is missing" in lines[2:]
    assert any("unknown key 'stpes' (did you mean 'steps'?)" in line for line in lines[2:])
    assert any("unknown key 'descripton' (did you mean 'description'?)" in line for line in lines[2:])


def test_run_escapes_control_characters_in_human_output(tmp_path: Path) -> None:
    forged = "T1\n    task FORGED created in fixture at work\x1b[2J\u202e"
    script = tmp_path / "script.jsonl"
    lines = [
        {"type": "create_task", "task_id": forged, "workflow_id": "fixture", "title": "t"},  # refused id
        {"type": "create_task", "task_id": "T2", "workflow_id": "fixture", "title": forged},
        {"type": "get_task", "task_id": "T2"},
        {"type": "nope\n> forged [ok]", "task_id": "T2"},
    ]
    script.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    done = onceflow(tmp_path, "run", "--workflow", str(MINIMAL), "--script", str(script))
    out = done.stdout + done.stderr
    assert not any(ch in out for ch in "\x1b\r\u202e")
    assert not any(line.lstrip().startswith(("task FORGED", "> forged")) for line in out.splitlines())
    assert "'nope\\n> forged [ok]'" in done.stdout  # an echoed unknown type stays on its line
    assert "refused: invalid_message] task_id" in done.stdout  # ids refuse control characters


def _long_script(path: Path, tasks: int) -> Path:
    with path.open("w", encoding="utf-8") as out:
        for i in range(tasks):
            out.write(
                json.dumps({"type": "create_task", "task_id": f"T{i}", "workflow_id": "fixture"}) + "\n"
            )
    return path


def _interrupt(db: Path, script: Path, signum: int, times: int) -> tuple[int, list[str], list[str]]:
    """Run `onceflow run --json` on the long script, signal it once 20 replies are out; returns its exit
    status, stdout lines and stderr lines."""
    args = ["run", "--json", "--workflow", str(MINIMAL), "--script", str(script), "--db", str(db)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=db.parent,
    )
    assert proc.stdout is not None
    seen = b""
    while seen.count(b"\n") < 20:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no reply within 60 s"
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk, "the run ended before it could be interrupted"
        seen += chunk
    for _ in range(times):
        proc.send_signal(signum)
    rest, err = proc.communicate(timeout=60)
    return proc.returncode, (seen + rest).decode().splitlines(), err.decode().splitlines()


@pytest.mark.parametrize(
    ("signum", "times", "status"),
    [(signal.SIGINT, 1, 130), (signal.SIGTERM, 1, 143), (signal.SIGINT, 2, 130)],
    ids=["SIGINT", "SIGTERM", "SIGINT-twice"],
)
async def test_a_signal_drains_releases_the_database_prints_one_line_and_exits_128_plus_n(
    tmp_path: Path, signum: int, times: int, status: int
) -> None:
    db, script = tmp_path / "run.db", _long_script(tmp_path / "long.jsonl", 20_000)
    code, out, err = await trio.to_thread.run_sync(_interrupt, db, script, signum, times)
    assert code == status
    database, line = err  # where the run's state is, then one line, no traceback
    assert database == f"database: {db}"
    assert line.startswith(f"onceflow: interrupted by {signal.Signals(signum).name}") and str(db) in line
    created = [json.loads(reply) for reply in out[1:]]  # after register_workflow's reply
    assert all(reply["ok"] for reply in created) and 20 <= len(created) < 20_000
    if times == 1:  # what was finished, and the command that goes on from the next line
        assert (
            f"{len(created)} command(s) of {script} sent and answered, the last on line {len(created)}"
            in line
        )
        resume = line.split("to resume: ", 1)[1]
        assert resume == (
            f"onceflow run --workflow {MINIMAL} --script {script} --db {db} --from-line {len(created) + 1}"
        )
    async with open_runtime(db) as rt:  # the lock was released
        stored = (await rt.send({"type": "get_task", "task_id": f"T{len(created) - 1}"})).ok
        after = (await rt.send({"type": "get_task", "task_id": f"T{len(created) + 1}"})).ok
    assert stored  # every printed reply was committed
    if times == 1:  # drained: the command under way finished and was printed, none was sent after it
        assert not after


def _script(path: Path, *commands: dict[str, Any] | str) -> Path:
    path.write_text("".join((c if isinstance(c, str) else json.dumps(c)) + "\n" for c in commands), "utf-8")
    return path


def test_run_names_the_script_line_of_each_refusal_and_its_database(tmp_path: Path) -> None:
    create = {"type": "create_task", "task_id": "T1", "workflow_id": "fixture"}
    script = _script(tmp_path / "s.jsonl", create, "# a comment", "", create, {"type": "get_task"})
    done = onceflow(tmp_path, "run", "--workflow", str(MINIMAL), "--script", str(script))
    assert done.returncode == 1
    refusals = [line for line in done.stdout.splitlines() if "refused" in line]
    assert len(refusals) == 2
    assert refusals[0].endswith(f"({script}:4)") and "conflict" in refusals[0]
    assert refusals[1].endswith(f"({script}:5)") and "invalid_message" in refusals[1]
    (database,) = done.stderr.splitlines()
    picked = Path(database.removeprefix("database: "))  # no --db: a fresh file, named
    assert database.startswith("database: ") and picked.is_file() and picked.name == "run.db"

    as_json = onceflow(tmp_path, "run", "--json", "--workflow", str(MINIMAL), "--script", str(script),
                       "--db", str(tmp_path / "j.db"))  # fmt: skip
    assert [json.loads(line)["ok"] for line in as_json.stdout.splitlines()] == [True, True, False, False]
    assert as_json.stderr.splitlines() == [
        f"database: {tmp_path / 'j.db'}",
        f"refused: {script}:4: create_task: conflict: task 'T1' already exists",
        f"refused: {script}:5: get_task: invalid_message: task_id: Field required",
    ]


def test_run_yaml_script_refusals_name_the_line_each_item_starts_on(tmp_path: Path) -> None:
    script = tmp_path / "s.yml"
    script.write_text(
        "# two tasks\n- type: create_task\n  task_id: T1\n  workflow_id: fixture\n"
        "- {type: create_task, task_id: T1, workflow_id: fixture}\n",
        encoding="utf-8",
    )
    done = onceflow(tmp_path, "run", "--workflow", str(MINIMAL), "--script", str(script))
    (refusal,) = [line for line in done.stdout.splitlines() if "refused" in line]
    assert refusal.endswith(f"({script}:5)")


def test_run_stops_at_a_refused_register_workflow_unless_keep_going(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("id: broken\nsteps: nope\n", encoding="utf-8")
    script = _script(tmp_path / "s.jsonl", {"type": "create_task", "task_id": "T1", "workflow_id": "broken"})
    done = onceflow(tmp_path, "run", "--workflow", str(broken), "--script", str(script))
    assert done.returncode == 1
    assert [line.split(" [")[0] for line in done.stdout.splitlines() if line.startswith(">")] == [
        "> register_workflow"
    ]  # the create_task after it was never sent
    assert f"({broken})" in done.stdout
    assert "stopped: register_workflow refused" in done.stderr and "--keep-going" in done.stderr
    going = onceflow(tmp_path, "run", "--keep-going", "--workflow", str(broken), "--script", str(script))
    assert going.returncode == 1
    sent = [line.split(" [")[0] for line in going.stdout.splitlines() if line.startswith(">")]
    assert sent == ["> register_workflow", "> create_task"] and "stopped" not in going.stderr


def test_help_is_complete_for_the_command_and_each_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """`onceflow --help` names every subcommand with its synopsis and the exit statuses, its description is
    a whole sentence; `onceflow X --help` says what X does."""
    from onceflow.cli.main import _parser

    parser = _parser(every=True)
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])  # the lazy parser, as `onceflow --help` makes it
    shown = capsys.readouterr().out
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "Exit status: 0 on success" in shown and "--log-json" in shown
    assert parser.description and parser.description.endswith(".")
    for name, sub in subcommands.items():
        assert f"onceflow {name}" in shown or name in (
            "runs",
            "entries",
            "decisions",
            "outcomes",
            "workflows",
        ), name
        assert sub.description and sub.description.startswith(f"onceflow {name}: "), name
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        assert sub.description.split(": ", 1)[1] in capsys.readouterr().out.replace("\n", " ")


def test_run_from_line_resumes_a_script_where_it_stopped(tmp_path: Path) -> None:
    creates = [{"type": "create_task", "task_id": f"T{n}", "workflow_id": "fixture"} for n in range(3)]
    script, db = _script(tmp_path / "s.jsonl", *creates), str(tmp_path / "r.db")
    run = ["run", "--json", "--workflow", str(MINIMAL), "--db", db]
    first = onceflow(tmp_path, *run, "--script", str(_script(tmp_path / "first.jsonl", creates[0])))
    assert first.returncode == 0, first.stderr
    rest = onceflow(tmp_path, *run, "--script", str(script), "--from-line", "2")
    assert rest.returncode == 0, rest.stderr  # line 1 is not sent again: no conflict
    assert [json.loads(line)["command"] for line in rest.stdout.splitlines()] == ["register_workflow"] + [
        "create_task"
    ] * 2


def test_demo_and_run_say_where_the_database_is_alike(tmp_path: Path) -> None:
    demo = onceflow(tmp_path, "demo", "--db", str(tmp_path / "d.db"))
    assert demo.returncode == 0, demo.stderr
    assert demo.stderr.splitlines() == [f"database: {tmp_path / 'd.db'}"]
    script = _script(tmp_path / "s.jsonl", {"type": "create_task", "task_id": "T1", "workflow_id": "fixture"})
    run = onceflow(
        tmp_path, "run", "--workflow", str(MINIMAL), "--script", str(script), "--db", str(tmp_path / "r.db")
    )
    assert run.returncode == 0 and run.stderr.splitlines() == [f"database: {tmp_path / 'r.db'}"]


def test_an_interrupted_demo_says_where_its_work_is_and_how_to_start_again() -> None:
    from onceflow.cli.main import Progress, _interrupted

    line = _interrupted(argparse.Namespace(command="demo"), "SIGINT", Path("/tmp/d.db"), Progress())
    assert line.startswith("onceflow: interrupted by SIGINT: the runtime shut down and released /tmp/d.db")
    assert "onceflow history --db /tmp/d.db --task DEMO-1" in line and "`onceflow demo`" in line
