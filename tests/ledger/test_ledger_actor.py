"""The ledger actor on its own: a process-lifetime memo of applied operation ids.

Source: operation-ledger-lifetime.md, groups L and S.
"""

from __future__ import annotations

import unicodedata
from collections.abc import AsyncIterator

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.actors.kernel.ledger import LedgerActor


@pytest.fixture
async def ledger() -> AsyncIterator[LedgerActor]:
    actor = LedgerActor()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        yield actor
        actor.close()


def run_with_ledger(body: object) -> None:
    """Run an async body against a fresh ledger in its own trio.run (for hypothesis examples)."""

    async def main() -> None:
        actor = LedgerActor()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            await body(actor)  # type: ignore[operator]
            actor.close()

    trio.run(main)


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_ac_l3a_a_fresh_ledger_reports_nothing_applied(operation_id: str) -> None:
    async def body(ledger: LedgerActor) -> None:
        assert not await ledger.is_applied(operation_id)

    run_with_ledger(body)


async def test_ac_s1_the_empty_id_is_never_stored_nor_reported(ledger: LedgerActor) -> None:
    await ledger.mark_applied("")
    assert not await ledger.is_applied("")
    await ledger.mark_applied("x")
    assert not await ledger.is_applied("")


async def test_ac_s2_marking_is_idempotent_and_there_is_no_unmark(ledger: LedgerActor) -> None:
    for _ in range(3):
        await ledger.mark_applied("op-1")
    assert await ledger.is_applied("op-1")
    public = {name for name in dir(LedgerActor) if not name.startswith("_")}
    assert public == {
        "is_applied",
        "mark_applied",
        "run",
        "close",
    }  # close stops the mailbox, forgets nothing
    await ledger.mark_applied("op-1")
    assert await ledger.is_applied("op-1")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(max_size=300), max_size=8))
def test_ac_s3_neither_call_fails_for_any_input(operation_ids: list[str]) -> None:
    async def body(ledger: LedgerActor) -> None:
        for operation_id in operation_ids:
            await ledger.mark_applied(operation_id)
            assert await ledger.is_applied(operation_id) is bool(operation_id)

    run_with_ledger(body)


async def test_ac_s7_keys_compare_by_exact_bytes(ledger: LedgerActor) -> None:
    composed = "caf\u00e9"
    decomposed = unicodedata.normalize("NFD", composed)
    long_key = "k" * 1_000_000
    for key in ("Task_Comment:1", " padded ", composed, long_key, "agent_error:run-1"):
        await ledger.mark_applied(key)
    for key in (
        "task_comment:1",
        "padded",
        decomposed,
        long_key[:-1],
        "agent_error:run-1 ",
        "AGENT_ERROR:run-1",
    ):
        assert not await ledger.is_applied(key), key
    for key in ("Task_Comment:1", " padded ", composed, long_key):
        assert await ledger.is_applied(key)


async def test_ac_s6_the_ledger_is_a_memo_not_a_mutex(ledger: LedgerActor) -> None:
    """Two checkers of one unmarked id may both see "not applied" and both proceed (AC-S6, AC-L6)."""
    seen: list[bool] = []
    both_checked = trio.Event()

    async def checker() -> None:
        seen.append(await ledger.is_applied("op-shared"))
        if len(seen) == 2:
            both_checked.set()
        await both_checked.wait()  # neither marks before both have checked
        await ledger.mark_applied("op-shared")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(checker)
        nursery.start_soon(checker)
    assert seen == [False, False]
    assert await ledger.is_applied("op-shared")
    mutex_verbs = {"check_and_set", "mark_if_absent", "load_or_store", "setdefault", "claim", "try_mark"}
    assert mutex_verbs.isdisjoint(dir(LedgerActor))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=5), min_size=10, max_size=60))
def test_ac_l6_concurrent_marks_and_checks_under_many_interleavings(pauses: list[int]) -> None:
    """Many Trio tasks mark and check the same and different ids; hypothesis draws how many checkpoints
    each one yields between its check and its mark, so every example is a different interleaving."""

    async def body(ledger: LedgerActor) -> None:
        marked: set[str] = set()

        async def worker(operation_id: str, pause: int) -> None:
            before = await ledger.is_applied(operation_id)
            assert not before or operation_id in marked  # never a false positive
            for _ in range(pause):
                await trio.lowlevel.checkpoint()
            await ledger.mark_applied(operation_id)
            marked.add(operation_id)
            assert await ledger.is_applied(operation_id)  # never lost once marked

        async with trio.open_nursery() as nursery:
            for i, pause in enumerate(pauses):
                nursery.start_soon(worker, f"op-{i % 7}", pause)
        for operation_id in marked:
            assert await ledger.is_applied(operation_id)
        assert not await ledger.is_applied("op-never")

    run_with_ledger(body)
