"""The host contract: what the embedding application performs on the runtime's behalf.

Session-scoped actions (reset_agent_context, configure_session, enable_plan_mode, set_session_mode,
auto_start_agent, disable_plan_mode) are owned by the host; the runtime asks, the host acts
(on-enter-action-dispatch.md, "The ownership partition"). A host implements `Host`, or subclasses
`BaseHost` and overrides only what it performs. Pure contract: no thread, no machinery.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs


@attrs.frozen
class SessionActionRequest:
    """One session action for one task's live session, with its declared config and where it comes from.

    `trigger` names the declaration list (on_enter, on_exit, on_turn_complete, ...) and `position` the
    action's index in it (0-based, the declared position, not the dispatch order). For on_enter, the entry
    identity is (`task_id`, `step_id`, `entry_seq`): `entry_seq` is the step-entry record's sequence number,
    None when the step allocates no record (its on_enter declares only host-owned actions, AC-E5) and for
    every other trigger. `admission_seq` is the task's admission counter (+1 at every step entry, on every
    path, whether or not the step allocates a record): for on_enter it names the entry being dispatched,
    for on_exit the entry being left. A host makes a start idempotent by keying it on (task_id,
    admission_seq, trigger, position) — one declared action of one entry, on every step — or on (task_id,
    admission_seq) for "at most once per entry".
    """

    task_id: str
    session_id: str
    step_id: str
    action: str
    config: dict[str, Any]
    entry_path: str | None
    trigger: str
    position: int
    entry_seq: int | None
    admission_seq: int


class Host(Protocol):
    """Callbacks a host supplies.

    A raising `perform_session_action` or `start_code_review` is reported and the runtime goes on (except
    that a raising reset_agent_context stops the later session actions of its entry); a raising
    `preflight_transition` refuses the step change before anything commits.
    """

    async def perform_session_action(self, request: SessionActionRequest) -> None: ...

    async def start_code_review(
        self, *, task_id: str, step_id: str, entry_seq: int, review_run_id: int, agent_profile_id: str | None
    ) -> None:
        """Start a code-review pass for the step entry (task_id, step_id, entry_seq).

        At-least-once across a crash (on-enter spec AC-A8): a launch repeated by recovery carries the same
        `review_run_id`, a new entry's launch a new one, so a host that remembers the ids it started (or
        asks `list_review_runs`) starts each pass once.
        """
        ...

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None: ...


class BaseHost:
    """A host that performs nothing and accepts every transition: the runtime's default, and a base class
    for a host that performs only some of the calls (override those).

    A host whose `preflight_transition` is this one's is never asked (every transition is accepted, so the
    runtime skips the await on the hot path); overriding it on the class or the instance makes it asked.
    """

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        """Do nothing: the action is reported as performed (`session_action` event)."""

    async def start_code_review(
        self, *, task_id: str, step_id: str, entry_seq: int, review_run_id: int, agent_profile_id: str | None
    ) -> None:
        """Do nothing: the review run is recorded as started."""

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        """Accept the transition."""


def preflight_is_noop(host: Host) -> bool:
    """Whether `host.preflight_transition` is `BaseHost`'s (accepts everything), on its class and not
    replaced on the instance: then the runtime need not await it."""
    own = "preflight_transition" in getattr(host, "__dict__", {})
    return not own and getattr(type(host), "preflight_transition", None) is BaseHost.preflight_transition
