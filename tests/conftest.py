"""Integration-test fixtures: a real SQLite file in tmp_path, a RecordingHost, a fake clock.

`--backend=postgres` makes `db_path` a fresh database on a throw-away PostgreSQL server (tests/pg_support.py)
instead of a SQLite file, for the store and engine files listed in tests/postgres/BOTH_BACKENDS (`.ci/run`
runs them so after the whole suite). The files left out read or damage the SQLite file itself (triggers,
sqlite_master, file paths, migrations from old SQLite versions), or time redelivery under a MockClock,
which the PostgreSQL runtime's periodic epoch sweep perturbs. Tests of PostgreSQL
itself use `postgres_server` / `pg_url` directly; the server starts at the first such test, at most once
per session, and a server that cannot start fails the test (never skips it).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog
from hand_clock import HandClock
from helpers import FakeClock, setup_office
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from pg_support import PostgresServer, start_postgres
from trio.testing import MockClock

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.testing import RecordingHost

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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="the database behind the db_path fixture (postgres: a throw-away local server)",
    )


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throw-away PostgreSQL server for the session (tests/pg_support.py), stopped and deleted at its
    end."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


_databases = itertools.count(1)


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a fresh, empty database on the session's PostgreSQL server, dropped after the test (each
    is a 7.5 MB copy of template1: hundreds of them left to the end cost minutes of disk at teardown)."""
    name = f"t{next(_databases)}"
    yield postgres_server.create_database(name)
    postgres_server.drop_database(name)


@pytest.fixture
def db_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    if request.config.getoption("--backend") == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return tmp_path / "onceflow.db"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hand_clock(db_path: Path | str) -> HandClock:
    """Trio's clock for the test (pytest-trio runs it on this MockClock), and the server's on PostgreSQL,
    both standing still until moved by hand (tests/hand_clock.py)."""
    return HandClock(db_path)


@pytest.fixture
def host() -> RecordingHost:
    return RecordingHost()


@pytest.fixture
async def runtime(db_path: Path | str, host: RecordingHost, clock: FakeClock) -> AsyncIterator[Runtime]:
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


@pytest.fixture
def autojump_clock() -> MockClock:
    """pytest-trio's autojump clock, but jumping only after 1 ms of real idleness instead of at once: with a
    threshold of 0 the Trio thread spins while the store's writer thread works (no deadline to jump to, or
    one it must not reach yet), holding the GIL, so every statement of the writer waits a GIL switch
    interval (5 ms) for it. 1 ms of real time per jump costs nothing a test can see."""
    return MockClock(autojump_threshold=0.001)
