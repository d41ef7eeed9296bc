"""What a user's code touches is typed and raises what it says: `Reply.raise_for_error()` and the typed
`onceflow.aio.open_runtime` signature."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import trio

import onceflow
import onceflow.aio
from onceflow.actors.runtime.startup import open_runtime as trio_open_runtime


def test_a_refused_reply_raises_its_error_typed(tmp_path: Path) -> None:
    async def main() -> None:
        async with onceflow.open_runtime(tmp_path / "board.db") as rt:
            reply = await rt.send({"type": "move_task", "task_id": "nobody", "step_id": "work"})
            with pytest.raises(onceflow.RefusedError) as raised:
                reply.raise_for_error()
            assert isinstance(raised.value, onceflow.OnceflowError)
            assert (raised.value.code, raised.value.field, raised.value.command) == (
                "not_found",
                reply.error.field if reply.error else None,
                "move_task",
            )
            assert raised.value.retryable is False and "not_found" in str(raised.value)
            listed = await rt.send({"type": "list_tasks"})
            assert listed.raise_for_error() is listed  # an ok reply is returned, for chaining

    trio.run(main)


def test_the_asyncio_open_runtime_takes_every_option_of_the_trio_one_typed() -> None:
    """Each keyword of `onceflow.open_runtime` is a keyword of `onceflow.aio.open_runtime` with the same
    default and annotation (no `**options`), so an IDE shows them and a misspelt one fails type-checking."""
    trio_params = inspect.signature(trio_open_runtime).parameters
    aio_params = dict(inspect.signature(onceflow.aio.open_runtime).parameters)
    assert aio_params.pop("host_loop").kind is inspect.Parameter.KEYWORD_ONLY
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in aio_params.values())
    assert list(aio_params) == list(trio_params)
    for name, param in trio_params.items():
        mirrored = aio_params[name]
        assert (mirrored.default, mirrored.annotation) == (param.default, param.annotation), name
