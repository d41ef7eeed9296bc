"""Integration-test fixtures: a real SQLite file in tmp_path, a RecordingHost, a fake clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from helpers import FakeClock, setup_office
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from onceflow.actors.host import RecordingHost
from onceflow.actors.supervisor import Runtime, open_runtime

# The project's own stand-ins for Kandev's five templates (tests/fixtures/kandev/README.md).
KANDEV_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "kandev"


@pytest.fixture(autouse=True)
def default_structlog() -> None:
    """Start every test from structlog's defaults: the CLI tests configure it process-wide."""
    structlog.reset_defaults()


@pytest.fixture
def kandev_templates() -> Path:
    """The folder of fixture templates in Kandev's format (office-default.yml, kanban.yml, ...)."""
    return KANDEV_TEMPLATES


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "onceflow.db"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def host() -> RecordingHost:
    return RecordingHost()


@pytest.fixture
async def runtime(db_path: Path, host: RecordingHost, clock: FakeClock) -> AsyncIterator[Runtime]:
    async with open_runtime(db_path, host=host, clock=clock) as rt:
        yield rt


@pytest.fixture
async def office(runtime: Runtime, kandev_templates: Path) -> Runtime:
    """The runtime with office-default.yml registered and rev-a, rev-b, boss seated."""
    await setup_office(runtime, kandev_templates / "office-default.yml")
    return runtime


@pytest.fixture(scope="session")
def metric_reader() -> InMemoryMetricReader:
    """An OpenTelemetry SDK installed as the global meter provider (once per process: the API allows one)."""
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return reader
