"""A code review launched again after a crash carries the same review-run id; a new entry's launch a new one.

AC-A8 accepts at-least-once across a crash; the host gets the entry identity (task, step, entry_seq) and a
stable review-run id, and can list review runs, so it can start each pass once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from entry_support import new_task, setup_entries
from helpers import list_review_runs, ok, turn_complete

from onceflow.actors.runtime.startup import open_runtime
from onceflow.testing import RecordingHost

REVIEW = "- type: run_code_review\n"


class _CrashesMidLaunch(RecordingHost):
    """Records the launch, then never returns: the runtime dies with the review pass started but its marker
    still in_progress (the state AC-A8's at-least-once carve-out is about)."""

    def __init__(self) -> None:
        super().__init__()
        self.launched = trio.Event()

    async def start_code_review(self, **launch: Any) -> None:
        await super().start_code_review(**launch)
        self.launched.set()
        await trio.sleep_forever()


async def test_ac_a8_a_relaunch_after_a_crash_carries_the_same_review_run_id(db_path: Path) -> None:
    crashing, recovering = _CrashesMidLaunch(), RecordingHost()
    with trio.fail_after(10), trio.CancelScope() as crash:
        async with open_runtime(db_path, host=crashing) as rt:
            await setup_entries(rt, REVIEW)
            await new_task(rt, "T1")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rt.send, {"type": "move_task", "task_id": "T1", "step_id": "review"})
                await crashing.launched.wait()
                crash.cancel()  # the process dies mid-launch: no completion is written
    [(task, step, entry_seq, review_run_id, _)] = crashing.code_reviews
    assert (task, step, entry_seq) == ("T1", "review", 1)

    async with open_runtime(db_path, host=recovering) as rt:  # the recovery scan launches it again
        assert recovering.code_reviews == [("T1", "review", 1, review_run_id, None)]
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
        await turn_complete(rt, "T1")  # a new entry of review: a new pass, a new id
        [_, (_, _, new_seq, new_id, _)] = recovering.code_reviews
        assert (new_seq, new_id != review_run_id) == (2, True)
        listed = await list_review_runs(rt, task_id="T1")
        assert [(r["id"], r["step_id"], r["entry_seq"], r["launches"], r["status"]) for r in listed] == [
            (review_run_id, "review", 1, 2, "started"),
            (new_id, "review", 2, 1, "started"),
        ]
        assert await list_review_runs(rt, task_id="T2") == []
        assert len(await list_review_runs(rt)) == 2
