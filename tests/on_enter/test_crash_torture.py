"""bench/torture.py at CI size: SIGKILL a busy runtime 50 times, recover, and check every invariant.

on-enter-action-dispatch.md AC-B2, AC-B5, AC-B6, AC-B9: after any number of crashes and one recovery scan,
every entry is terminal, every committed clear_decisions is counted once, and every (entry, fan-out
position, reviewer) has exactly one run. The script exits 1 on any violation and prints its figures as
a final JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TORTURE = Path(__file__).resolve().parents[2] / "bench" / "torture.py"
KILLS = 50


def test_ac_b2_ac_b6_ac_b9_sigkilled_runtimes_recover_every_entry_exactly_once(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(TORTURE),
            "--kills",
            str(KILLS),
            "--seed",
            "20261130",
            "--db",
            str(tmp_path / "t.db"),
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["violations"] == []
    assert figures["kills"] == KILLS
    assert figures["open_at_restarts"] >= 1, figures  # some kill landed mid-entry and a scan finished it
    assert figures["entries"] > KILLS and figures["clears_done"] == figures["entries"], figures
    assert figures["runs"] == figures["fan_outs_done"] * 3 > 0, figures


def test_sigkilled_runtimes_on_the_common_paths_recover_every_entry_exactly_once(
    tmp_path: Path,
) -> None:
    """bench/torture.py --common: built-in executors only, so admissions take the one-savepoint common path
    and restarts the recovery scan's set path (entries from `prep` are dispatched a commit after their
    admission, so kills leave open entries without markers). Same invariants, 30 kills."""
    kills = 30
    db = str(tmp_path / "t.db")
    done = subprocess.run(
        [sys.executable, str(TORTURE), "--kills", str(kills), "--seed", "20261130", "--common", "--db", db],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["violations"] == []
    assert figures["common"] is True and figures["kills"] == kills
    assert figures["open_at_restarts"] >= 1, figures  # some scan found open entries and finished them
    assert figures["entries"] > kills and figures["clears_done"] == figures["entries"], figures
    assert figures["runs"] == figures["fan_outs_done"] * 3 > 0, figures
