"""Issue 13 item 4: logging as a library — through stdlib `logging` unless the host configured structlog."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.logs import get_logger

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


def test_issue13_embedded_runtime_prints_nothing_to_stdout(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EMBEDDED, str(tmp_path / "board.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""


async def test_issue13_host_logging_handler_receives_records_with_discrete_fields(
    db_path: Path, onceflow_records: list[logging.LogRecord]
) -> None:
    async with open_runtime(db_path) as rt:
        epoch = rt.epoch
    by_event = {record.getMessage(): record for record in onceflow_records}
    opened = by_event["store_opened"]
    assert (opened.name, opened.levelno) == ("onceflow.store.writer", logging.INFO)
    assert (opened.path, opened.epoch, opened.durability) == (str(db_path.resolve()), epoch, "FULL")  # type: ignore[attr-defined]
    assert by_event["database_lock_acquired"].pid > 0  # type: ignore[attr-defined]
    assert "store_closed" in by_event


def test_issue13_a_field_named_like_a_logrecord_attribute_is_kept_renamed(
    onceflow_records: list[logging.LogRecord],
) -> None:
    get_logger("onceflow.test").error("odd_fields", name="x", module="m", task_id="T1")
    [record] = onceflow_records
    assert (record.name, record.name_, record.module_, record.task_id) == ("onceflow.test", "x", "m", "T1")  # type: ignore[attr-defined]


def test_issue13_a_host_that_configured_structlog_gets_the_records_there(
    onceflow_records: list[logging.LogRecord],
) -> None:
    with capture_logs() as captured:
        get_logger("onceflow.test").warning("through_structlog", task_id="T1")
    assert captured == [{"event": "through_structlog", "task_id": "T1", "log_level": "warning"}]
    assert onceflow_records == []
