"""The host role over `onceflow serve`: what a host connection registers for, the calls the runtime sends it,
the replies it answers them with, and the one owner of call ids. Pure: the wire, no thread.

A connection becomes a host by sending `register_host` with its capabilities; the server then sends it
`{"call": HostCall}` lines and it answers each with a `host_reply` line (actors/runtime/host_broker.py does
the routing, onceflow/serve/ the framing). Each capability stands for the in-process contract it replaces:
`session_action` and `code_review` for `Host.perform_session_action` and `Host.start_code_review`,
`preflight` for `Host.preflight_transition`, `coordinator` for the outcome `Coordinator` (`deliver` and
`acknowledge`).

Call ids are deterministic, so a host that performs side effects dedupes them by id (the same call offered
again after its host went away keeps its id; so does the same declared action of the same step entry at a
later recovery):

- `session_action/<task>/<admission_seq>/<trigger>/<position>`: one declared action of one step entry (the
  identity `SessionActionRequest` documents);
- `code_review/<task>/<review_run_id>`: one review run (the row `run_code_review` claims once per entry and
  action, reused by recovery: on-enter spec AC-A8);
- `preflight/<task>/<from_step>/<to_step>`: the question "may this task move there now" (no side effect);
- `deliver/<outcome_id>/cycle-NNNNNN/attempt-N`, `ack/<outcome_id>/cycle-NNNNNN/attempt-N`: one attempt of a
  coordinator cycle (the cycle id, `protocol/coordinator.py`, is what a coordinator dedupes on).

`<task>` is the task id percent-encoded (`/` and `%` and every byte outside unreserved URI characters), so an
id is read back unambiguously by splitting on `/`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.limits import ID_PATTERN, MAX_TEXT_CHARS

Capability = Literal["session_action", "code_review", "preflight", "coordinator"]
"""What a host connection may be asked to do."""
CallKind = Literal["session_action", "code_review", "preflight", "deliver", "acknowledge"]
"""What one call asks."""
CallStatus = Literal["pending", "answered", "refused", "host_unavailable", "host_timeout", "cancelled"]
"""Where a call stands: `pending` (waiting for a host or its reply), `answered` (`ok: true`), `refused` (the
host answered `ok: false`), `host_unavailable` (no host with the capability took it within `--host-wait`
seconds), `host_timeout` (its host did not answer by the deadline), `cancelled` (the runtime stopped
first)."""

CAPABILITY: Mapping[CallKind, Capability] = {
    "session_action": "session_action",
    "code_review": "code_review",
    "preflight": "preflight",
    "deliver": "coordinator",
    "acknowledge": "coordinator",
}
"""The capability a host needs to be offered a call of each kind."""

MAX_CALL_ID_CHARS = 4096
"""A call id's length: a task id of 256 characters, percent-encoded (up to 12 bytes a character), fits."""
MAX_ERROR_CODE_CHARS = 64


def _segment(value: str) -> str:
    return quote(value, safe="")


def session_action_call_id(task_id: str, admission_seq: int, trigger: str, position: int) -> str:
    """`session_action/<task>/<admission_seq>/<trigger>/<position>`: one declared action of one entry."""
    return f"session_action/{_segment(task_id)}/{admission_seq}/{_segment(trigger)}/{position}"


def code_review_call_id(task_id: str, review_run_id: int) -> str:
    """`code_review/<task>/<review_run_id>`: one review run (the same id when recovery starts it again)."""
    return f"code_review/{_segment(task_id)}/{review_run_id}"


def preflight_call_id(task_id: str, from_step: str, to_step: str) -> str:
    """`preflight/<task>/<from_step>/<to_step>`: may the task move from one step to the other now."""
    return f"preflight/{_segment(task_id)}/{_segment(from_step)}/{_segment(to_step)}"


def coordinator_call_id(cycle_id: str, attempt: int) -> str:
    """`<cycle_id>/attempt-<attempt>`: one attempt of a coordinator cycle (`deliver/...` or `ack/...`)."""
    return f"{cycle_id}/attempt-{attempt}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)


CallId = Annotated[str, Field(min_length=1, max_length=MAX_CALL_ID_CHARS, pattern=ID_PATTERN)]


class RegisterHost(_Model):
    """`{"type": "register_host", "capabilities": [...]}`: make this connection a host (serve only). Answered
    with `HostRegistered`; from then on the connection is sent the calls of those capabilities."""

    type: Literal["register_host"] = "register_host"
    """The request name."""
    capabilities: Annotated[list[Capability], Field(min_length=1, max_length=4)]
    """What this host performs: any of `session_action`, `code_review`, `preflight`, `coordinator`."""

    @field_validator("capabilities")
    @classmethod
    def _distinct(cls, capabilities: list[Capability]) -> list[Capability]:
        if len(set(capabilities)) != len(capabilities):
            raise ValueError("capabilities must not repeat")
        return capabilities


class HostError(_Model):
    """Why a host did not do what a call asked (a `host_reply` with `ok: false`)."""

    code: Annotated[str, Field(min_length=1, max_length=MAX_ERROR_CODE_CHARS, pattern=r"^[A-Za-z0-9_.-]+$")]
    """The host's own error code (letters, digits, `_`, `.`, `-`)."""
    message: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] = ""
    """What happened, for a human."""
    retryable: bool = False
    """Whether the same call may succeed later."""


class HostReply(_Model):
    """`{"type": "host_reply", "call_id": ..., "ok": true}`, or `"ok": false` with an `error`: a host's answer
    to one call (serve only). `result` carries what a call returns: a `deliver` call's receipt
    (`{delivery_ref, coordinator_fence}`); the other kinds return nothing."""

    type: Literal["host_reply"] = "host_reply"
    """The request name."""
    call_id: CallId
    """The call answered (its `call.call_id`)."""
    ok: bool
    """True when the host did what the call asked; for `preflight`, False refuses the move."""
    result: dict[str, Any] | None = None
    """A `deliver` call's receipt; None for the other kinds."""
    error: HostError | None = None
    """Required when `ok` is false, refused when it is true."""

    @model_validator(mode="after")
    def _error_iff_not_ok(self) -> HostReply:
        if self.ok and self.error is not None:
            raise ValueError("error is only for ok: false")
        if not self.ok and self.error is None:
            raise ValueError("ok: false needs an error {code, message, retryable}")
        return self


class HostCall(_Model):
    """One call the server sends a host, as `{"call": HostCall}`: answer it with a `host_reply` naming its
    `call_id` before `deadline`."""

    call_id: CallId
    """Deterministic, so a host dedupes side effects on it: `session_action/<task>/<admission_seq>/<trigger>/
    <position>`, `code_review/<task>/<review_run_id>`, `preflight/<task>/<from_step>/<to_step>`, or a
    coordinator cycle's id and `/attempt-<n>` (the task id percent-encoded)."""
    kind: CallKind
    """What the call asks."""
    request: dict[str, Any]
    """The call's arguments, by kind: `session_action` the `SessionActionRequest` fields (task_id,
    session_id, step_id, action, config, entry_path, trigger, position, entry_seq, admission_seq);
    `code_review` {task_id, step_id, entry_seq, review_run_id, agent_profile_id}; `preflight` {task_id,
    from_step, to_step}; `deliver` {message: {envelope, delivery_cycle}, cycle_id, attempt}; `acknowledge`
    {acknowledgement: {store_ref, outcome_id, work_id, coordinator_fence, acknowledged_by}, cycle_id,
    attempt}."""
    deadline: str
    """RFC 3339 UTC: when the server stops waiting for this host's answer (`--host-timeout` seconds after
    the offer); a later answer is refused."""
