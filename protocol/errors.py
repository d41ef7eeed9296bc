"""Typed errors the runtime reports to hosts; each maps onto a protocol `ErrorInfo`.

A command that fails with one of these gets an error reply; nothing it had not committed is applied and
the runtime keeps serving. Source: the foundation issue, "Protocol" (typed error naming the field).
"""

from __future__ import annotations

import reprlib

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def shown(value: object) -> str:
    """A short, printable repr of a value a host sent, for an error message; never raises.

    Strings are cut to ~80 characters with control characters and lone surrogates escaped (a message is
    echoed to terminals and encoded as UTF-8 JSON); an integer too long to print shows its type.
    """
    try:
        return _REPR.repr(value)
    except ValueError:  # int -> str refused beyond sys.get_int_max_str_digits()
        return f"<{type(value).__name__} too large to show>"


class OnceflowError(Exception):
    """Base of every error a host can be told about. `code` is stable; `field` names the culprit if any."""

    code = "error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class ProtocolError(OnceflowError):
    """A message that is not valid JSON, has an unknown `type`, or fails validation of a field."""

    code = "invalid_message"


class NotFoundError(OnceflowError):
    """The task, workflow, step or run a command names does not exist."""

    code = "not_found"


class ConflictError(OnceflowError):
    """The command contradicts committed state (e.g. creating a task id that exists)."""

    code = "conflict"


class WorkflowInvalidError(OnceflowError):
    """A workflow template was rejected by the loader."""

    code = "workflow_invalid"


class ActionNotWiredError(OnceflowError):
    """A declared action has no registered executor; nothing ran and the operation id stays retryable."""

    code = "action_not_wired"


class WipLimitError(OnceflowError):
    """A task cannot be placed: the step and its feeder are both at their WIP limit."""

    code = "wip_limit"


class TransitionFailedError(OnceflowError):
    """A step change (with its step-entry record) failed to commit; nothing landed and it may be replayed."""

    code = "transition_failed"


class TransitionRefusedError(OnceflowError):
    """The host's preflight refused a step change; nothing was committed."""

    code = "transition_refused"


class ShuttingDownError(OnceflowError):
    """The runtime is closing or closed and accepts no more commands."""

    code = "shutting_down"


class ActionError(OnceflowError):
    """An action could not be executed (no target agent, unknown task, missing executor)."""

    code = "action_failed"


class BusyError(OnceflowError):
    """The target cannot take the message now (an outcome's acknowledgement inbox is full); retry later."""

    code = "busy"
