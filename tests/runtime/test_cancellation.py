"""`Runtime.send` is a cancel point: a caller in a cancelled scope gets `trio.Cancelled`, never a loop that
cannot stop, and a program embedding the runtime stops on SIGINT under load."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import pytest
import trio
from helpers import FIXTURES, FakeClock

import onceflow
from onceflow.actors.runtime.startup import open_runtime
from onceflow.testing import RecordingHost

CHILD = Path(__file__).resolve().parent / "embedding_child.py"


async def test_sends_in_an_already_cancelled_scope_raise_cancelled_and_apply_nothing(db_path: Path) -> None:
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:
        yaml = (FIXTURES / "workflows" / "minimal.yml").read_text()
        assert (await rt.send({"type": "register_workflow", "yaml": yaml})).ok
        raised = 0
        with trio.CancelScope() as scope:
            scope.cancel()
            for n in range(5):  # task commands (lent to the asker) and runtime commands alike
                command = (
                    {"type": "create_task", "task_id": f"T{n}", "workflow_id": "fixture"}
                    if n % 2 == 0
                    else {"type": "list_tasks"}
                )
                try:
                    await rt.send(command)
                except trio.Cancelled:
                    raised += 1
                    continue
        assert raised == 5
        listed = await rt.send({"type": "list_tasks"})
        assert listed.ok and listed.result["tasks"] == []


async def test_a_send_cancelled_mid_command_raises_cancelled_once_the_command_is_done(db_path: Path) -> None:
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:
        yaml = (FIXTURES / "workflows" / "minimal.yml").read_text()
        assert (await rt.send({"type": "register_workflow", "yaml": yaml})).ok
        with trio.CancelScope() as scope:
            scope.deadline = trio.current_time()  # cancelled at the command's first checkpoint
            await rt.send({"type": "create_task", "task_id": "T1", "workflow_id": "fixture"})
        assert scope.cancelled_caught
        # the command itself ran, as documented: it is safe to send again, and the task is there
        assert (await rt.send({"type": "get_task", "task_id": "T1"})).ok


def _run_child(db: Path, *interrupt_at: str) -> tuple[float, str]:
    """Start the embedding child, SIGINT it once commands flow (or let it raise SIGINT itself, from inside the
    runtime, at `interrupt_at`), and return how many seconds it took to exit and its stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(db), *interrupt_at], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        if interrupt_at:
            assert proc.stdout.readline() == b"interrupting\n"  # the line ran: the signal was raised there
        else:
            time.sleep(0.5)  # under load: eight senders busy
            proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            proc.wait(timeout=STOP_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_BOUND} s after SIGINT")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return took, proc.stderr.read().decode() if proc.stderr else ""


STOP_BOUND = 5.0  # seconds


def test_a_program_embedding_the_runtime_stops_within_seconds_of_sigint(tmp_path: Path) -> None:
    took, stderr = _run_child(tmp_path / "embedded.db")
    assert took < STOP_BOUND, took
    assert "KeyboardInterrupt" in stderr  # stopped by the signal, as a Trio program is
    assert "TrioInternalError" not in stderr


@pytest.mark.parametrize(
    "where",
    [
        # a request is queued for the writer, its caller not yet parked: raised here, the caller would be
        # gone when the writer woke it (TrioInternalError)
        "store/writer.py:return await trio.lowlevel.wait_task_rescheduled",
        # a lent command's bookkeeping: raised here, the command would stay lent and shutdown wait forever
        "actors/runtime/supervisor.py:epochs.CURRENT_TASK.reset(token)",
    ],
)
def test_a_sigint_arriving_inside_the_runtime_stops_it_with_keyboard_interrupt(
    tmp_path: Path, where: str
) -> None:
    took, stderr = _run_child(tmp_path / "embedded.db", where)
    assert "TrioInternalError" not in stderr
    assert "KeyboardInterrupt" in stderr
    assert took < STOP_BOUND, took


def test_no_line_of_the_runtime_runs_where_a_keyboard_interrupt_could_land(tmp_path: Path) -> None:
    """Trio raises KeyboardInterrupt wherever SIGINT finds the Trio thread unless that code is KI-protected;
    the runtime's code always is (so it is delivered to the host's main task at a checkpoint): every line of
    onceflow/actors and onceflow/store run on the Trio thread, through start-up, lent and queued commands,
    the events stream and shutdown, runs protected."""
    roots = tuple(str(Path(onceflow.__file__).parent / room) for room in ("actors", "store"))
    exposed: set[str] = set()

    def line(frame: FrameType, event: str, arg: object) -> object:
        if event == "line" and not trio.lowlevel.currently_ki_protected():  # judged for `frame`, our caller
            exposed.add(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        return line

    async def main() -> None:
        async with open_runtime(tmp_path / "db.sqlite", host=RecordingHost(), clock=FakeClock()) as rt:
            yaml = (FIXTURES / "workflows" / "minimal.yml").read_text()
            assert (await rt.send({"type": "register_workflow", "yaml": yaml})).ok
            stream = rt.events()

            async def sender(n: int) -> None:  # two per task: the second queues behind a busy actor
                task = f"T{n // 2}"
                await rt.send({"type": "create_task", "task_id": task, "workflow_id": "fixture"})
                await rt.send({"type": "move_task", "task_id": task, "step_id": "review"})

            async with trio.open_nursery() as nursery:
                for n in range(6):
                    nursery.start_soon(sender, n)
            async for _ in stream:
                break
            assert (await rt.send({"type": "list_tasks"})).ok

    sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename.startswith(roots) else None)
    try:
        trio.run(main)
    finally:
        sys.settrace(None)
    assert not exposed, sorted(exposed)
