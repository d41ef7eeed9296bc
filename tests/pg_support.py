"""A throw-away PostgreSQL server for the tests and the benchmarks.

Started from Debian's binaries under /usr/lib/postgresql/<version>/bin (installed from Debian's `postgresql`
package when they are missing and the tests run as root, as on CI). `initdb` and `pg_ctl` refuse to run as
root, so under root they run as the `postgres` user through `runuser`. The data directory is a fresh folder
under /tmp, the server listens on a free port of 127.0.0.1 only, and its unix socket lives in the data
directory, never the system one. `stop()` shuts it down immediately and deletes the folder. Nothing here
skips: a server that cannot start raises `PostgresUnavailableError`, naming what is missing.

Developers: `apt-get install -y postgresql` (or any PostgreSQL >= 13 whose `initdb` sits under
/usr/lib/postgresql/*/bin), then run pytest as usual; the suite starts and stops its own server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import attrs

PG_ROOT = Path("/usr/lib/postgresql")


class PostgresUnavailableError(RuntimeError):
    """No PostgreSQL binaries, or the throw-away server failed to start (the message carries its log)."""


def _installed() -> list[Path]:
    return sorted(
        (p for p in PG_ROOT.glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )


def _install_as_root() -> None:
    """Install Debian's `postgresql` package (root only), so the README's test command alone passes on a
    fresh machine; a failed install is reported with apt's output."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "postgresql"]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise PostgresUnavailableError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")


def pg_bin() -> Path:
    """The newest /usr/lib/postgresql/<version>/bin holding `initdb`, installing Debian's `postgresql`
    package first when none is there and we run as root (CI and fresh machines).

    Raises:
        PostgresUnavailableError: none is installed and it cannot be (not root, or apt failed).
    """
    found = _installed()
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        _install_as_root()
        found = _installed()
    if not found:
        raise PostgresUnavailableError(
            f"no PostgreSQL binaries under {PG_ROOT}/*/bin: run `apt-get install -y postgresql`"
        )
    return found[-1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.define
class PostgresServer:
    """A running throw-away server: `url` (libpq URL of its `postgres` database), `root` (its folder),
    `flags` (its `-c` settings, reused when it is started again)."""

    root: Path
    port: int
    bin: Path
    flags: str = ""
    _stopped: bool = False

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, dbname: str = "postgres") -> str:
        """The libpq URL of database `dbname` on this server (TCP on 127.0.0.1, user postgres, trust)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Create an empty database `name` (a plain identifier) with the tests' server clock
        (`TEST_SERVER_CLOCK`) and return its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        with psycopg.connect(self.url(name), autocommit=True) as conn:
            conn.execute(TEST_SERVER_CLOCK)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database `name`, closing whatever sessions a test left on it (`WITH (FORCE)`); a server
        that is down or a database already gone is left as it is."""
        import psycopg

        with contextlib.suppress(psycopg.Error), psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def pg_ctl(self, *args: str, timeout: float = 120) -> None:
        """Run `pg_ctl -D <data> args...` on this server.

        Raises:
            PostgresUnavailableError: pg_ctl failed (its output and the server's log are included).
        """
        done = _as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), *args], timeout)
        if done.returncode != 0:
            log = (self.root / "log").read_text(errors="replace") if (self.root / "log").exists() else ""
            raise PostgresUnavailableError(f"pg_ctl {' '.join(args)} failed: {done.stdout}{done.stderr}{log}")

    def halt(self) -> None:
        """Stop the server at once (`pg_ctl stop -m immediate`: no checkpoint, as in a crash), keeping its
        data for `start`."""
        self.pg_ctl("-m", "immediate", "stop")

    def start(self) -> None:
        """Start the halted server again on its data, port and settings; returns once it accepts connections
        (after its crash recovery)."""
        self.pg_ctl("-l", str(self.root / "log"), "-o", self.flags, "-w", "start")

    def restart(self) -> None:
        """`pg_ctl restart -m immediate`: stop at once, start again on the same data, port and settings;
        returns once it accepts connections."""
        self.pg_ctl("-m", "immediate", "-l", str(self.root / "log"), "-o", self.flags, "-w", "restart")

    def stop(self) -> None:
        """Stop the server at once (`pg_ctl stop -m immediate`) and delete its folder; harmless twice."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"], 30)
        shutil.rmtree(self.root, ignore_errors=True)


TEST_SERVER_CLOCK = """
CREATE TABLE onceflow_test_clock (at DOUBLE PRECISION NOT NULL);
CREATE FUNCTION onceflow_clock() RETURNS DOUBLE PRECISION LANGUAGE sql VOLATILE
    AS 'SELECT COALESCE((SELECT at FROM onceflow_test_clock LIMIT 1),
                        CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION))';
"""
"""The database server's clock as the tests' databases have it: the server's own (`clock_timestamp()`, as
the runtime's schema creates it, store/backends/pg_schema.py), unless a test froze it (`freeze_server_clock`);
the schema keeps a clock it finds."""


def freeze_server_clock(url: str, at: float | None) -> None:
    """Stop the server's clock of database `url` at `at` (Unix seconds) for every session at once (None: let
    it run again). A test that moves Trio's MockClock moves this with it (helpers.py `TestTime`), so the
    runtime's clock and the server's agree to the microsecond."""
    import psycopg

    # One transaction: a runtime reading the clock between the delete and the insert would see the real one.
    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("DELETE FROM onceflow_test_clock")
        if at is not None:
            conn.execute("INSERT INTO onceflow_test_clock (at) VALUES (%s)", (at,))


def _as_postgres(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `argv` as the `postgres` user when we are root (initdb and pg_ctl refuse root), else as us."""
    if os.geteuid() == 0:
        argv = ["runuser", "-u", "postgres", "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def start_postgres(*, durable: bool = False, settings: dict[str, str] | None = None) -> PostgresServer:
    """Initialise and start a throw-away server; return it running and accepting connections.

    `durable=False` (the tests) turns fsync off: a crash of the machine loses the throw-away data, nothing
    else changes. The benchmarks pass True. `settings` are extra `-c name=value` server settings.

    Raises:
        PostgresUnavailableError: binaries missing, or initdb / pg_ctl failed (their output is included).
    """
    binaries = pg_bin()
    root = Path(tempfile.mkdtemp(prefix="onceflow-pg-", dir="/tmp"))
    server = PostgresServer(root, free_port(), binaries)
    try:
        root.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
        init = _as_postgres(
            [
                str(binaries / "initdb"),
                "-D",
                str(server.data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
            120,
        )
        if init.returncode != 0:
            raise PostgresUnavailableError(f"initdb failed: {init.stdout}{init.stderr}")
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(server.port),
            "unix_socket_directories": str(server.data),
            "max_connections": "200",
            "fsync": "on" if durable else "off",
            "synchronous_commit": "on" if durable else "off",
            "full_page_writes": "on" if durable else "off",
        } | (settings or {})
        server.flags = " ".join(f"-c {name}={value}" for name, value in options.items())
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


def limit_memory(pid: int, limit: int | None) -> None:
    """Cap the address space of server process `pid` (a backend) at `limit` bytes (its soft RLIMIT_AS; None:
    unlimited again), through `prlimit` as the server's own user: allocations beyond it fail, and the
    server answers "out of memory" (53200).

    Raises:
        PostgresUnavailableError: prlimit failed.
    """
    done = _as_postgres(["prlimit", f"--pid={pid}", f"--as={'unlimited' if limit is None else limit}:"], 30)
    if done.returncode != 0:
        raise PostgresUnavailableError(f"prlimit failed: {done.stdout}{done.stderr}")
