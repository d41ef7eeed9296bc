"""The socket sections of docs/protocol.md: `onceflow serve`'s framing, ids, subscriptions and bounds, and its
host role (capabilities, call lines, call ids, what becomes of a call no host answers). Pure.

The figures are read from the code (the server's defaults, the event window, the offer limit), so the page
cannot say what the server does not do.
"""

from __future__ import annotations

import typing

from pydantic import TypeAdapter

from onceflow.actors.kernel.event_window import DEFAULT_EVENT_WINDOW, MAX_EVENT_WINDOW, SEQ_BLOCK
from onceflow.actors.runtime.host_broker import MAX_OFFERS
from onceflow.cli.reference_tables import field_table, paragraphs
from onceflow.protocol import host_calls, results
from onceflow.protocol.host_calls import CAPABILITY, HostCall, HostError, HostReply, RegisterHost
from onceflow.serve import MAX_ID_LENGTH, ServeOptions
from onceflow.serve.descriptors import DEFAULT_MAX_CONNECTIONS, HEADROOM


def socket_section() -> str:
    """The framing of `onceflow serve` (onceflow/serve/'s wire format), with the bounds read from the
    code: the id length, the line limit and the server's defaults."""
    serve = ServeOptions()
    frames = [
        (
            "request",
            "client → server",
            'a command object, optionally with an `"id"`: `{"id": 7, "type": "move_task", ...}`',
        ),
        ("reply", "server → client", '`{"id": <the request\'s id>, "reply": <Reply>}`, one per request line'),
        (
            "event",
            "server → client",
            '`{"event_seq": <int>, "event": <Event>}`, only after the connection sent'
            ' `{"type": "subscribe"}`',
        ),
        (
            "gap",
            "server → client",
            '`{"gap": {"after": <int>, "next": <int>}}`, at most once, first after a `subscribe` with'
            " `after`",
        ),
        (
            "connection error",
            "server → client",
            '`{"error": <ErrorInfo>}`, the last line before the server closes the connection',
        ),
    ]
    table = ["| Line | Direction | Shape |", "| --- | --- | --- |"]
    table += [f"| {kind} | {direction} | {shape} |" for kind, direction, shape in frames]
    rows = "\n".join(table)
    return f"""\
## Over a socket: framing and ids

`onceflow serve` speaks this protocol as JSON lines over a Unix domain socket (`--socket PATH`, created
mode 0600) or over stdin/stdout (`--stdio`). Every line, each way, is one JSON object in UTF-8 ended by
`\\n`; a blank line is ignored.

{rows}

**Ids.** `id` is optional: a string of at most {MAX_ID_LENGTH} characters or an integer in the signed
64-bit range, echoed unchanged in the reply; it is removed before the command is decoded, so it never
counts as an unknown field. Without one the reply's `id` is `null`. Ids are the client's own: the server
does not require them to be unique, and replies come back in the order the requests were sent, so a
client may also match replies by order. A bad `id` (a float, an integer outside int64, a boolean, an
array or object, a string over {MAX_ID_LENGTH} characters) is refused with `invalid_message`,
`field: "id"`, and the command does not run; the reply's `id` is then the value as a string a client can
still match: a string id itself, any other value its compact JSON text (`1.5` → `"1.5"`, `[1]` →
`"[1]"`, `true` → `"true"`). The reply's `id` is `null` only when the line had no `id` or could not be
read.

**Replies.** A reply is the same [`Reply`](#reply) an in-process `send` returns. Its `command` is the
line's `type` whenever the line named one (known or not), `unknown` when the line is not JSON or has no
`type`. A line that is not JSON, names an unknown command or has a bad field gets an `invalid_message`
reply, and the connection stays open.

**Order.** One connection's commands are applied one at a time, in the order sent, and replied to in that
order (for parallelism, open more connections; many clients are served at once). A command whose client
went away still runs to completion; only its reply is dropped. Except `claim_run`: once its client has
closed its side, a claim stops waiting and claims nothing (a run it claimed meanwhile is handed back).

**`subscribe`.** `{{"type": "subscribe"}}` is answered
`{{"id": ..., "reply": {{"command": "subscribe", "ok": true, "result": {{"subscribed": true, "next_event_seq":
M}}, ...}}}}`; from then on the connection also receives every event the runtime emits, from any client's
commands, as `{{"event_seq": ..., "event": ...}}` lines interleaved with its replies (a reply's own
`events` are still in the reply). Every event line that follows has an `event_seq` of at least `M`.

**Event seqs.** Each event gets its `event_seq` when published: integers that increase strictly, also across
restarts of the server on the same database, but are not consecutive (they jump at each start and about
every {SEQ_BLOCK // 2:,} events); all are below 2**53, exact in JavaScript. Compare them; never count
with them.

**Resuming.** `{{"type": "subscribe", "after": N}}`, `N` the last `event_seq` the client processed (an
integer from 0 to 2**63-1; anything else, `null` included, is refused with `invalid_message`,
`field: "after"`), replays the events after `N` the server still holds (its last
{DEFAULT_EVENT_WINDOW:,} events, `--event-window`, a count of at most {MAX_EVENT_WINDOW:,}), then goes on
live: each event after `N` comes once, in seq order, with no duplicate and nothing skipped between replay
and live. If some events after `N`
are gone (older than the window; from before a restart, which a resume across one always meets; or `N`
is no seq this server reached), the first line after the reply is `{{"gap": {{"after": N, "next": M}}}}`:
events between `N` and `M` may be missing, so read the durable state (`get_task`, `task_history`,
`list_runs`, ...), then carry on; every event from `M` on follows, and the reply's `next_event_seq` is `M`.
The replay, and what is published while it runs, goes at the client's pace (queued while the outgoing
queue is under half its bounds, the other half free for replies), so it never makes a slow consumer; once
caught up, events are queued as they are published and the runtime never waits for the client. A client
that then falls behind is disconnected as `slow_consumer` (below) and resumes by subscribing on a new
connection with `after` set to the last seq it processed: it misses nothing still in the window. A second
`subscribe` on the same connection is refused with `conflict`.

**Sizes.** A request line is at most {serve.max_line:,} bytes ({_mib(serve.max_line)}; `--max-line`, by
default the protocol's own message limit, `MAX_MESSAGE_BYTES` below): a longer line is answered with
`invalid_message` (`command` `unknown`, `id` `null`: the line is not read) and skipped up to its newline,
and the connection stays open. Every other [limit](#limits) applies to the decoded command.

**Bounds.** A client that stops reading is sent `{{"error": {{"code": "slow_consumer", ...}}}}` and
disconnected once {serve.queue_size:,} lines or {serve.queue_bytes:,} bytes ({_mib(serve.queue_bytes)})
wait for it (`--queue-size`, `--queue-bytes`; a frame is counted whole: one larger than that is never
sent); one that sends nothing and has nothing in flight for {serve.idle_timeout:g} seconds
(`--idle-timeout`, 0: never; a subscriber is never idle) gets `idle_timeout` and is closed.

**Connections.** At most {DEFAULT_MAX_CONNECTIONS} clients at once (`--max-connections`), or fewer if the
open-files limit (`ulimit -n`) leaves fewer descriptors once those the server holds at start and a headroom
of {HEADROOM} are set aside; the server raises its soft limit toward the hard one as far as it needs, and
lowers an explicit `--max-connections` the limit cannot hold (with a WARNING `max_connections_clamped`).
A client connecting when the server is at its cap is still answered within a second: the connection idle
the longest (nothing in flight, nothing queued, not subscribed) is sent
`{{"error": {{"code": "evicted", ...}}}}` and closed to make room, and the new client is served; with no
connection idle it gets one `{{"error": {{"code": "busy", ...}}}}` line and is closed. It also gets `busy`
when the server has no file descriptor left for it (a spare one answers it). `evicted` and `busy` are
retryable: connect again (after a pause, for `busy`).
SIGTERM or SIGINT lets every received command finish and its reply be written, then closes the store and
removes the socket."""


_IN_PROCESS = {
    "session_action": "`Host.perform_session_action`: one declared action of a step entry "
    "(`auto_start_agent`, `set_session_mode`, ...)",
    "code_review": "`Host.start_code_review`: one review pass",
    "preflight": "`Host.preflight_transition`: may this task move there now (`ok: false` refuses the move)",
    "coordinator": "the outcome `Coordinator`: hand an outcome over, commit its acknowledgement",
}

_ONE_CALL = """\
```mermaid
sequenceDiagram
    participant C as client (Kandev)
    participant S as onceflow serve
    participant H as host connection
    H->>S: register_host {capabilities: [session_action]}
    S-->>H: reply {host_id: host-1}
    C->>S: move_task {task_id: T1, step_id: work}
    Note over S: on_enter declares auto_start_agent
    S->>H: call {call_id: session_action/T1/1/on_enter/0, kind, request, deadline}
    Note over H: not performed yet under this id: perform it, record the id
    H->>S: host_reply {call_id: session_action/T1/1/on_enter/0, ok: true}
    S-->>H: reply {status: answered}
    S-->>C: reply to move_task (its events include the session_action)
```"""


_CALL_IDS = [
    (
        "`session_action`",
        "`session_action/<task>/<admission_seq>/<trigger>/<position>`",
        "declared action of a step entry",
    ),
    (
        "`code_review`",
        "`code_review/<task>/<review_run_id>`",
        "review run (recovery starting it again reuses it)",
    ),
    (
        "`preflight`",
        "`preflight/<task>/<from_step>/<to_step>`",
        'question "may this task move there now" (no side effect)',
    ),
    (
        "`deliver`, `acknowledge`",
        "`deliver/<outcome_id>/cycle-NNNNNN/attempt-N`, `ack/<outcome_id>/cycle-NNNNNN/attempt-N`",
        "attempt of a coordinator cycle (a coordinator dedupes on the cycle id)",
    ),
]


def hosts_section() -> str:
    """The host role of `onceflow serve` (protocol/host_calls.py, actors/runtime/host_broker.py,
    onceflow/serve/hosting.py): capabilities, lines, call ids, and what becomes of a call no host answers,
    with the defaults read from the code."""
    serve = ServeOptions()
    capabilities = ["| Capability | Calls | Stands for |", "| --- | --- | --- |"]
    for capability in typing.get_args(host_calls.Capability):
        kinds = ", ".join(f"`{kind}`" for kind, needs in CAPABILITY.items() if needs == capability)
        capabilities.append(f"| `{capability}` | {kinds} | {_IN_PROCESS[capability]} |")
    lines = [
        (
            "register_host",
            "host → server",
            '`{"id": 1, "type": "register_host", "capabilities": ["session_action", "code_review"]}`, '
            'replied `{"id": 1, "reply": {"command": "register_host", "ok": true, "result": {"host_id": '
            '"host-1", "capabilities": [...]}, ...}}`',
        ),
        (
            "call",
            "server → host",
            '`{"call": {"call_id": "session_action/T1/1/on_enter/0", "kind": "session_action", '
            '"request": {...}, "deadline": "2026-01-01T00:00:30Z"}}`, only to a registered host',
        ),
        (
            "host_reply",
            "host → server",
            '`{"id": 2, "type": "host_reply", "call_id": ..., "ok": true}`, or `"ok": false` with '
            '`"error": {"code": ..., "message": ..., "retryable": ...}`; replied `{"id": 2, "reply": '
            '{"command": "host_reply", "ok": true, "result": {"call_id": ..., "status": "answered"}, ...}}`',
        ),
    ]
    table = ["| Line | Direction | Shape |", "| --- | --- | --- |"]
    table += [f"| `{kind}` | {direction} | {shape} |" for kind, direction, shape in lines]
    example = host_calls.session_action_call_id("T/1", 3, "on_enter", 0)
    ids = ["| Kind | Call id | One id per |", "| --- | --- | --- |"]
    ids += [f"| {kinds} | {formats} | {what} |" for kinds, formats, what in _CALL_IDS]
    return f"""\
## Over a socket: the host role

A connection that sends `register_host` becomes a *host*: where an in-process host's method (or the outcome
coordinator) would be awaited, the runtime sends that connection a **call** line and waits for its
`host_reply`, so a host in any language takes that part of the contract over the socket. The dispatch order,
the no-live-session rule and which actions are the host's are those of an in-process host.
[examples/go](../examples/go/) is a host in Go, standard library only.

{chr(10).join(capabilities)}

{chr(10).join(table)}

One call, from the move that causes it to the move's reply:

{_ONE_CALL}

**Call ids** are deterministic, so a host that performs side effects dedupes them on the id: the same call
offered again after its host went away keeps its id, and so does the same declared action of the same
step entry when recovery dispatches it again.

{chr(10).join(ids)}

`<task>` and the names in an id (steps, trigger) are percent-encoded (`/`, `%` and every byte outside
the unreserved URI characters), so an id splits on `/` unambiguously: the first `on_enter` action of task
`T/1` at `admission_seq` 3 is `{example}`.

**Until a host registers, serve behaves as before.** As long as no connection has registered a
capability, the calls needing it are answered as the default host answers them: session actions and
review starts reported done, every move accepted, nothing recorded. A client that never registers sees
what it always saw. The runtime's own start (its recovery scan) comes before any registration.

**Offers and deadlines.** Once a capability has been registered, each call needing it is offered to one
live host holding it (the one holding the fewest calls), with a `deadline` {serve.host_timeout:g} seconds
away (`--host-timeout`). A host whose connection ends before it answers (it closed, crashed, or was
disconnected) loses the call: it is offered to the next host with the capability under the same
`call_id`, at most {MAX_OFFERS} times in all. With no live host holding the capability, a call waits up
to {serve.host_wait:g} seconds (`--host-wait`) for one to register, then ends `host_unavailable`; a host
that does not answer by the deadline ends it `host_timeout`, and its late answer is refused. Either way
the dispatch goes on as after a host method that raised: a session action or a review start is reported
failed (`diagnostic` events `session_action_failed`, `code_review_start_failed`), a preflight refuses the
move with `host_unavailable` or `host_timeout` (retryable, nothing committed), a delivery attempt fails
and follows the retry policy. An answer `ok: false` is the host refusing: a move its preflight refused
fails with `transition_refused` naming the host and its reason.

**Answers.** A `host_reply` is taken as soon as it is read, ahead of the commands its connection has
waiting: a host may answer the calls its own commands cause, and the reply to a `host_reply` can come
before the replies to commands sent earlier on the same connection (match replies by `id`). A
`host_reply` is refused, changing nothing, when its connection is not a host (`invalid_message`, field
`type`), when its shape is wrong (`invalid_message` naming the field: `ok: false` needs an `error`),
when no call of that id waits (`not_found`, field `call_id`), and when the call was already answered,
ended (a late answer) or is held by another host (`conflict`, field `call_id`). A second `register_host`
on the same connection is a `conflict`.

**Host connections.** A host is never idle: it is neither closed for `--idle-timeout` nor evicted. A
call line its outgoing queue cannot take makes it a slow consumer, disconnected like any other, and its
calls go to the next host. A host that reconnects registers again (a new `host_id`); the calls its old
connection held go to a live host with the capability (it, once registered), under the same ids. A host
may also `subscribe` on its connection.

**Draining at shutdown.** On SIGTERM or SIGINT the server keeps reading host connections for their
answers while the other clients' received commands finish (anything else a host sends then, and any new
`register_host`, is refused `shutting_down`); a call no host holds ends `host_unavailable` at once. Once
the other clients are done, the host connections are closed too, and the calls they still hold end
`host_unavailable`.

**Records.** Every call that went the host path ends as one record, read with
[`list_host_calls`](#list_host_calls) (status, attempts, the host that answered or last held it, times,
the error; the calls still pending on its last page) and in a task's [`task_history`](#task_history)
(items of kind `host_call`). A call that ended unanswered (`host_unavailable`, `host_timeout`,
`cancelled`) is also the event [`host_call_unanswered`](#host_call_unanswered) and a WARNING log.
Records are written in batches after their calls ended: a crash can lose the records of the calls that
ended last, never what the calls did.

### RegisterHost

{paragraphs(RegisterHost.__doc__ or "")}

{field_table(RegisterHost.model_json_schema(), "type")}

**Result:** [HostRegistered](#hostregistered).

### HostRegistered

{paragraphs(results.HostRegistered.__doc__ or "")}

{field_table(TypeAdapter(results.HostRegistered).json_schema(), host_sends=False)}

### HostCall

{paragraphs(HostCall.__doc__ or "")}

{field_table(HostCall.model_json_schema(), host_sends=False)}

### HostReply

{paragraphs(HostReply.__doc__ or "")}

{field_table(HostReply.model_json_schema(), "type")}

**Result:** [HostReplyTaken](#hostreplytaken).

### HostReplyTaken

{paragraphs(results.HostReplyTaken.__doc__ or "")}

{field_table(TypeAdapter(results.HostReplyTaken).json_schema(), host_sends=False)}

### HostError

{paragraphs(HostError.__doc__ or "")}

{field_table(HostError.model_json_schema())}"""


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
