"""The ledger actor: the process-lifetime set of applied operation ids. Trio thread.

A memo, not a mutex: `is_applied` / `mark_applied`, no check-and-set, no clear. Keys compare by exact
bytes; the empty id is never stored and never reported applied; marking is idempotent. It lives exactly as
long as the runtime process (a restart starts empty; durability belongs to the step-entry records).
Source: operation-ledger-lifetime.md.
"""

from __future__ import annotations

from typing import Literal

import attrs
import outcome
from trio.lowlevel import enable_ki_protection

from onceflow.actors.kernel.mailbox import Mailbox, reply_to


@attrs.frozen
class _LedgerRequest:
    verb: Literal["is_applied", "mark_applied"]
    operation_id: str


class LedgerActor:
    """Owns the applied-operation set; every other component reaches it through this one object."""

    def __init__(self) -> None:
        self._applied: set[str] = set()
        self._mailbox: Mailbox[_LedgerRequest] = Mailbox()

    @enable_ki_protection
    async def run(self) -> None:
        """Serve requests until the mailbox is closed and drained."""
        async for envelope in self._mailbox:
            request = envelope.message
            if request.verb == "mark_applied":
                if request.operation_id:
                    self._applied.add(request.operation_id)
                reply_to(envelope, outcome.Value(None))
            else:
                reply_to(
                    envelope,
                    outcome.Value(bool(request.operation_id) and request.operation_id in self._applied),
                )

    async def is_applied(self, operation_id: str) -> bool:
        """True when `operation_id` (non-empty) was marked applied earlier in this process."""
        applied: bool = await self._mailbox.ask(_LedgerRequest("is_applied", operation_id))
        return applied

    async def mark_applied(self, operation_id: str) -> None:
        """Record `operation_id` as applied; idempotent; the empty id is ignored."""
        await self._mailbox.ask(_LedgerRequest("mark_applied", operation_id))

    def close(self) -> None:
        self._mailbox.close()
