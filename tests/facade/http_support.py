"""`onceflow serve --http` in a process of its own, for the HTTP API and board tests: `http_serving` starts
it on a free loopback port and yields where it answers."""

from __future__ import annotations

import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from helpers import TESTS

WORKFLOW = TESTS / "fixtures" / "workflows" / "minimal.yml"


@dataclass
class HttpServed:
    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    folder: Path
    log: list[str] = field(default_factory=list)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout=30)


def start_server(*extra: str, folder: Path) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    """Start `serve --http 127.0.0.1:0` (plus `extra`); wait for its `serving on http://...` line."""
    command = [sys.executable, "-m", "onceflow.cli", "serve", "--db", str(folder / "db.sqlite")]
    command += ["--workflow", str(WORKFLOW), *extra]
    if "--http" not in extra:
        command += ["--http", "127.0.0.1:0"]
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stderr], [], [], 0.1)
        if ready:
            line = process.stderr.readline().decode()
            assert line, f"server exited before serving (status {process.wait()}): {seen}"
            if line.startswith("serving on http://"):
                threading.Thread(target=_drain, args=(process.stderr, seen), daemon=True).start()
                return process, line.split()[-1], seen
            seen.append(line)
    process.kill()
    raise AssertionError(f"server did not start: {seen}")


def _drain(stream: object, lines: list[str]) -> None:
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        lines.append(raw.decode(errors="replace"))


@contextmanager
def http_serving(*extra: str) -> Iterator[HttpServed]:
    """A server answering HTTP on a free loopback port; killed at the end if still running."""
    folder = Path(tempfile.mkdtemp(prefix="of-http-", dir="/tmp"))
    process, url, log = start_server(*extra, folder=folder)
    served = HttpServed(process, url, folder, log)
    try:
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(folder, ignore_errors=True)
