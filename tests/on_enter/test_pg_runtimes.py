"""Several runtimes on one PostgreSQL database: epochs whose liveness is real, the sweep that
finishes a dead runtime's entries while the others keep serving, and `--db postgresql://…`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from entry_support import (
    CLEAR_AND_FAN_OUT,
    admit,
    entries_yaml,
    kinds_of,
    mark,
    new_task,
    setup_entries,
    states,
)

from onceflow.actors.runtime.startup import open_runtime
from onceflow.cli.main import main
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.writer import open_store
from onceflow.testing import RecordingHost

KEY = EntryKey("T1", "review", 1)
REVIEW_FIRST = "- type: run_code_review\n" + CLEAR_AND_FAN_OUT
REPO = Path(__file__).resolve().parents[2]


async def _claimed_by(pg_url: str, epoch: str, kinds: list[str]) -> None:
    async with open_store(pg_url) as store:
        await store.transact(
            lambda conn: mark(
                conn, admit(conn, "T1", "review", kinds), 0, "run_code_review", "in_progress", epoch=epoch
            )
        )


async def test_a_live_runtime_finishes_the_entry_a_dead_runtimes_epoch_left_without_a_restart(
    pg_url: str,
) -> None:
    kinds = kinds_of(entries_yaml(REVIEW_FIRST), "review")
    async with open_runtime(pg_url) as first:
        await setup_entries(first, REVIEW_FIRST)
        await new_task(first, "T1")
    host = RecordingHost()
    async with open_runtime(pg_url, host=host, epoch_sweep_interval=0.1) as live:
        async with open_store(pg_url) as peer:  # a peer runtime claims the host action, then dies
            await _claimed_by(pg_url, peer.epoch, kinds)
            await trio.sleep(0.5)  # several sweeps: a live peer's claim is left alone
            assert host.code_reviews == []
            assert (await live.services.store.transact(lambda c: states(c, KEY)))[0][2] == "in_progress"
        with trio.fail_after(10):  # the peer's session ended: its epoch is dead, the sweep finishes the entry
            while not host.code_reviews:
                await trio.sleep(0.05)
        assert (await live.services.store.transact(lambda c: states(c, KEY)))[0] == (
            0,
            "run_code_review",
            "done",
        )
    assert [(t, s, seq) for t, s, seq, _, _ in host.code_reviews] == [("T1", "review", 1)]


async def test_a_starting_runtime_leaves_a_live_peers_claim_to_the_peer(pg_url: str) -> None:
    """The start-up scan too: on SQLite any other epoch is dead, on PostgreSQL only one whose lock is free."""
    kinds = kinds_of(entries_yaml(REVIEW_FIRST), "review")
    async with open_runtime(pg_url) as first:
        await setup_entries(first, REVIEW_FIRST)
        await new_task(first, "T1")
    async with open_store(pg_url) as peer:
        await _claimed_by(pg_url, peer.epoch, kinds)
        host = RecordingHost()
        async with open_runtime(pg_url, host=host) as second:
            assert host.code_reviews == []
            assert (await second.services.store.transact(lambda c: states(c, KEY)))[0][2] == "in_progress"


def test_cli_run_accepts_a_postgresql_url(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "run",
            "--workflow",
            str(REPO / "tests" / "fixtures" / "kandev" / "office-default.yml"),
            "--script",
            str(REPO / "tests" / "scripts" / "office-default-rejection.jsonl"),
            "--db",
            pg_url,
            "--json",
        ]
    )
    assert status == 0
    replies = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert replies and all(r["ok"] for r in replies)
