"""Logging as a library: through stdlib `logging` (every field shown, JSON when asked) unless the host
configured structlog."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.observability.logs import formatter, get_logger

EMBEDDED = textwrap.dedent(
    """
    import sys, trio, onceflow

    async def main() -> None:
        async with onceflow.open_runtime(sys.argv[1]) as rt:
            await rt.send({"type": "create_task", "task_id": "T1", "workflow_id": "none"})  # refused
            await rt.send("not json")

    trio.run(main)
    """
)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def onceflow_records() -> Iterator[list[logging.LogRecord]]:
    """Records reaching a handler the host put on the `onceflow` logger, at DEBUG."""
    handler, logger = _Collect(), logging.getLogger("onceflow")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_embedded_runtime_prints_nothing_to_stdout(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EMBEDDED, str(tmp_path / "board.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""


async def test_host_logging_handler_receives_records_with_discrete_fields(
    db_path: Path, onceflow_records: list[logging.LogRecord]
) -> None:
    async with open_runtime(db_path) as rt:
        epoch = rt.epoch
    by_event = {record.event: record for record in onceflow_records}  # type: ignore[attr-defined]
    opened = by_event["store_opened"]
    assert (opened.name, opened.levelno) == ("onceflow.store.writer", logging.INFO)
    assert (opened.path, opened.epoch, opened.durability) == (str(db_path.resolve()), epoch, "FULL")  # type: ignore[attr-defined]
    assert by_event["database_lock_acquired"].pid > 0  # type: ignore[attr-defined]
    assert "store_closed" in by_event


def test_a_field_named_like_a_logrecord_attribute_is_kept_renamed(
    onceflow_records: list[logging.LogRecord],
) -> None:
    get_logger("onceflow.test").error("odd_fields", name="x", module="m", task_id="T1")
    [record] = onceflow_records
    assert (record.name, record.name_, record.module_, record.task_id) == ("onceflow.test", "x", "m", "T1")  # type: ignore[attr-defined]


def test_a_host_that_configured_structlog_gets_the_records_there(
    onceflow_records: list[logging.LogRecord],
) -> None:
    with capture_logs() as captured:
        get_logger("onceflow.test").warning("through_structlog", task_id="T1")
    assert captured == [{"event": "through_structlog", "task_id": "T1", "log_level": "warning"}]
    assert onceflow_records == []


def test_a_record_through_stdlib_logging_shows_its_fields_in_any_formatter(
    onceflow_records: list[logging.LogRecord],
) -> None:
    """A host with `logging.basicConfig()` (which prints only the message) sees each field, key=value."""
    get_logger("onceflow.test").warning("run_lost", run_id=3, task_id="T-1", reason="the lease ran out")
    [record] = onceflow_records
    assert record.getMessage() == 'run_lost run_id=3 task_id=T-1 reason="the lease ran out"'
    assert (record.event, record.run_id, record.task_id) == ("run_lost", 3, "T-1")  # type: ignore[attr-defined]
    text = logging.Formatter("%(levelname)s %(name)s %(message)s").format(record)
    assert text == 'WARNING onceflow.test run_lost run_id=3 task_id=T-1 reason="the lease ran out"'


def test_the_json_formatter_writes_one_object_with_the_event_and_its_fields(
    onceflow_records: list[logging.LogRecord],
) -> None:
    get_logger("onceflow.test").error("run_lost", run_id=3, task_id="T-1")
    [record] = onceflow_records
    shown = json.loads(formatter(json=True).format(record))
    assert {k: shown[k] for k in ("event", "run_id", "task_id", "level", "logger")} == {
        "event": "run_lost",
        "run_id": 3,
        "task_id": "T-1",
        "level": "error",
        "logger": "onceflow.test",
    }
    assert shown["timestamp"].endswith("Z")
    line = formatter().format(record)
    assert line.endswith("[error] onceflow.test run_lost run_id=3 task_id=T-1")


def test_an_exception_logged_through_stdlib_keeps_its_traceback(
    onceflow_records: list[logging.LogRecord],
) -> None:
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        get_logger("onceflow.test").error("crashed", task_id="T", exc_info=True)
    [record] = onceflow_records
    assert record.exc_info is not None and record.getMessage() == "crashed task_id=T"
    assert "ZeroDivisionError: boom" in formatter().format(record)


def test_the_cli_writes_json_logs_when_asked(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow.cli",
            "--log-json",
            "--verbose",
            "demo",
            "--db",
            str(tmp_path / "d.db"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    opened = next(item for item in logged if item["event"] == "store_opened")
    assert opened["path"] == str(tmp_path / "d.db") and opened["level"] == "info"
