"""Typed errors the runtime reports to hosts; each maps onto a protocol `ErrorInfo`. Pure.

A command that fails with one of these gets an error reply; nothing it had not committed is applied and
the runtime keeps serving.
"""

from __future__ import annotations

import reprlib
from typing import Literal

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
    """Base of every error a host can be told about. `code` is stable; `field` names the culprit if any.

    `retryable` is True when nothing of the command was committed and sending it again unchanged may succeed
    once the condition clears (a busy database, a full disk); False when a retry alone cannot help.
    """

    code = "error"
    retryable = False

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


class FenceRequiredError(OnceflowError):
    """A `finish_run` without a `claim_token` for a claimed run: an unfenced finish would resolve whichever
    claim holds the run now, perhaps another host's. Send the claim's token, or `unfenced: true` to opt out
    explicitly; nothing changed. `field` is `claim_token`."""

    code = "fence_required"


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


class HostUnavailableError(OnceflowError):
    """No host connection with the capability a call needs took it within `--host-wait` seconds (`onceflow
    serve`'s host role): the call reached no executor. A preflight so refused commits nothing."""

    code = "host_unavailable"
    retryable = True


class HostTimeoutError(OnceflowError):
    """The host holding a call did not answer it by its deadline (`--host-timeout` seconds after the offer);
    a later answer is refused. A preflight so refused commits nothing."""

    code = "host_timeout"
    retryable = True


class HostRefusedError(OnceflowError):
    """A host connection answered a call `ok: false`: `host_id` names it, `host_code` is its own error code,
    `retryable` what it said of a retry. A refused preflight refuses the step change (`transition_refused`,
    naming the host and its reason)."""

    code = "host_refused"

    def __init__(self, host_id: str, host_code: str, message: str, *, retryable: bool) -> None:
        super().__init__(
            f"host {host_id} answered {host_code}: {message}"
            if message
            else f"host {host_id} answered {host_code}"
        )
        self.host_id = host_id
        self.host_code = host_code
        self.retryable = retryable


class ShuttingDownError(OnceflowError):
    """The runtime is closing or closed and accepts no more commands."""

    code = "shutting_down"


class ActionError(OnceflowError):
    """An action could not be executed (no target agent, unknown task, missing executor)."""

    code = "action_failed"


class BusyError(OnceflowError):
    """The target cannot take the message now (an outcome's acknowledgement inbox is full, or `onceflow
    serve` serves its `--max-connections` clients, none of them idle, or has no file descriptor left for
    another); retry later."""

    code = "busy"
    retryable = True


StorageKind = Literal["busy", "full", "io", "out_of_memory", "read_only", "corrupt", "aborted"]
"""What went wrong with the database (the SQLite result codes, then PostgreSQL's SQLSTATEs:
store/backends/postgres.py
`FAULTS` has them all):

- busy: another connection held a lock past the busy timeout, or the transaction lost a race with another
  (SQLITE_BUSY, SQLITE_LOCKED; lock_timeout, statement_timeout, serialization failure, deadlock);
- full: the disk, a file-size limit or `max_page_count` left no room (SQLITE_FULL; disk_full);
- io: the operating system failed a read, write, sync or open, or the connection to the database server
  was lost or refused (SQLITE_IOERR, SQLITE_CANTOPEN, SQLITE_PROTOCOL; connection exceptions, a server shut
  down, crashed or starting up, too many connections, a failed file operation of the server);
- out_of_memory: the database could not allocate memory (SQLITE_NOMEM; insufficient resources);
- read_only: the database cannot be written (SQLITE_READONLY, SQLITE_PERM, SQLITE_AUTH; a read-only
  transaction or server, a missing privilege, a refused login);
- corrupt: the file is damaged or not a database (SQLITE_CORRUPT, SQLITE_NOTADB; data or index corrupted);
- aborted: the database ended the transaction for a reason it did not report as a storage fault
  (SQLITE_ABORT; another transaction rollback, a prepared statement gone, an internal error).
"""

RETRYABLE_STORAGE_KINDS: frozenset[StorageKind] = frozenset(
    {"busy", "full", "io", "out_of_memory", "aborted"}
)
"""The kinds whose `storage_<kind>` error is retryable."""

STORAGE_EXPLANATIONS: dict[StorageKind, str] = {
    "busy": "the database is busy: a lock was held past the busy timeout, or a concurrent transaction won",
    "full": "the database or disk is full",
    "io": "the database hit an I/O error",
    "out_of_memory": "the database ran out of memory",
    "read_only": "the database cannot be written",
    "corrupt": "the database file is corrupt",
    "aborted": "the database ended the transaction",
}
"""What each kind means, as the start of its error message (and in docs/protocol.md)."""


class StorageError(OnceflowError):
    """The database could not serve the command.

    None of the failing store request's writes were committed; when the fault ended the transaction (disk
    full, I/O, out of memory, corrupt, a lost connection) neither were those of any request sharing its
    group commit. An earlier, separate transaction of the same command stands.

    `code` is `storage_<kind>` (see `StorageKind`). `retryable` is True for busy, full, io, out_of_memory and
    aborted: the same command may succeed once the lock is released, space returns or the device recovers.
    It is False for read_only and corrupt, which need an operator. `detail` (the database's message, with
    PostgreSQL's SQLSTATE, and why this request failed when another one ended its batch) goes into the
    message; the database error that caused it (sqlite3's, or psycopg's) is chained as `__cause__`.
    """

    def __init__(self, kind: StorageKind, detail: str) -> None:
        retryable = kind in RETRYABLE_STORAGE_KINDS
        advice = "retry once the condition clears" if retryable else "a retry alone will not help"
        super().__init__(f"{STORAGE_EXPLANATIONS[kind]} ({detail}); its writes were rolled back, {advice}")
        self.kind: StorageKind = kind
        self.code = f"storage_{kind}"
        self.retryable = retryable


class RefusedError(OnceflowError):
    """A refused `Reply` raised as an exception (`Reply.raise_for_error()`): for a host that would rather
    catch than test `reply.ok`.

    `code`, `message`, `field` and `retryable` are the reply's `error`'s; `command` is the refused command's
    `type` as sent. Match on `code` (`invalid_message`, `not_found`, `conflict`, `storage_busy`, ...: the
    error codes of docs/protocol.md), not on the message.
    """

    def __init__(self, command: str, code: str, message: str, *, field: str | None, retryable: bool) -> None:
        super().__init__(f"{command} refused: {code}: {message}", field=field)
        self.command = command
        self.code = code
        self.reason = message
        self.retryable = retryable
