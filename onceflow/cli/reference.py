"""The protocol reference page (docs/protocol.md), generated from the models: `onceflow schema --markdown`.
Pure.

Commands with their fields (type, bounds, default, description) and result, the reply, events, error codes
(with `retryable`) and limits, all read from `onceflow.protocol` (field docstrings, JSON Schema bounds,
`limits.py`'s documented constants), so the page cannot say what the code does not. A test keeps the
committed page equal to `render()`.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter

from onceflow.actors.kernel.event_window import DEFAULT_EVENT_WINDOW, MAX_EVENT_WINDOW, SEQ_BLOCK
from onceflow.actors.runtime.host_broker import MAX_OFFERS
from onceflow.protocol import causation, errors, host_calls, limits, results, times, tracecontext
from onceflow.protocol.causation import CAUSE_FIELDS
from onceflow.protocol.codec import COMMAND_ADAPTER, EVENT_ADAPTER
from onceflow.protocol.commands import COMMAND_TYPES
from onceflow.protocol.events import Event, Reply
from onceflow.protocol.host_calls import CAPABILITY, HostCall, HostError, HostReply, RegisterHost
from onceflow.protocol.tracecontext import TRACE_FIELDS
from onceflow.serve import MAX_ID_LENGTH, EvictedError, IdleTimeoutError, ServeOptions, SlowConsumerError
from onceflow.serve.descriptors import DEFAULT_MAX_CONNECTIONS, HEADROOM

PAGE = "docs/protocol.md"
REGENERATE = f"onceflow schema --markdown > {PAGE}"

_EVENT_TYPES: tuple[type[BaseModel], ...] = typing.get_args(typing.get_args(Event)[0])

_INTRO = f"""\
# onceflow protocol reference

<!-- Generated from the models in protocol/ by `{REGENERATE}`; edit the models, not this file. -->

A host talks to onceflow in commands and replies: in process, `await runtime.send(command)` takes a command
model, a dict or a JSON line and returns a [`Reply`](#reply); over `onceflow serve`, each line is one
command object and each reply one line. Every command is a JSON object whose `type` names it; unknown
fields are refused. A reply carries the command's `result` (its shape is listed with each command) or an
[`error`](#errorinfo), and the [events](#events) the command caused, in order; `subscribe` streams every
event as it is emitted, each with its `event_seq`, and resumes after a seq. Times are RFC 3339 text in
UTC (`2026-03-01T12:00:00.250000Z`: results and events always write six fraction digits and `Z`); a time a
command carries (`finish_run.retry_at`, `heartbeat.unix`, `budget_alert.period_start`) also accepts a
number of Unix seconds, as it always has. `None` in a description is JSON `null`.

`onceflow schema` prints the same as JSON Schema (`command`, `event`, `reply`, and `results` per command
type). `onceflow schema --template` prints the JSON Schema of the workflow template format (add
`--import-path` for the import path's allow-lists), for an editor: save it, e.g. as
`onceflow-template.schema.json`, and start a template with
`# yaml-language-server: $schema=./onceflow-template.schema.json`, or map it to your templates in the
editor's settings (VS Code: `yaml.schemas`). Checks a schema cannot express (unique step ids and positions,
one start step, move targets and feeders that exist) are `onceflow validate`'s. What each template key does is
[docs/templates.md](templates.md); what survives a crash, a restart or a database fault is
[docs/guarantees.md](guarantees.md).
"""

_INTERNAL = (
    "internal",
    False,
    "Anything unexpected inside the runtime (a bug): logged at ERROR with its traceback; the runtime keeps "
    "serving.",
)


def render() -> str:
    """The whole page, as Markdown (ends with one newline)."""
    sections = [_INTRO.rstrip(), _contents(), _socket(), _hosts()]
    sections += [_reply(), _commands(), _events(), _types(), _results(), _errors(), _limits()]
    return "\n\n".join(sections) + "\n"


def _contents() -> str:
    return "\n".join(
        [
            "## Contents",
            "",
            "- [Over a socket: framing and ids](#over-a-socket-framing-and-ids)",
            "- [Over a socket: the host role](#over-a-socket-the-host-role)",
            "- [Replies](#replies)",
            "- [Commands](#commands): " + ", ".join(_link(m) for m in COMMAND_TYPES),
            "- [Events](#events): " + ", ".join(_link(m) for m in _EVENT_TYPES),
            "- [Types used in commands](#types-used-in-commands)",
            "- [Result types](#result-types)",
            "- [Error codes](#error-codes)",
            "- [Limits](#limits)",
        ]
    )


# --- sections -----------------------------------------------------------------------------------------


def _socket() -> str:
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


def _hosts() -> str:
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

{_paragraphs(RegisterHost.__doc__ or "")}

{_fields(RegisterHost.model_json_schema(), "type")}

**Result:** [HostRegistered](#hostregistered).

### HostRegistered

{_paragraphs(results.HostRegistered.__doc__ or "")}

{_fields(TypeAdapter(results.HostRegistered).json_schema(), host_sends=False)}

### HostCall

{_paragraphs(HostCall.__doc__ or "")}

{_fields(HostCall.model_json_schema(), host_sends=False)}

### HostReply

{_paragraphs(HostReply.__doc__ or "")}

{_fields(HostReply.model_json_schema(), "type")}

**Result:** [HostReplyTaken](#hostreplytaken).

### HostReplyTaken

{_paragraphs(results.HostReplyTaken.__doc__ or "")}

{_fields(TypeAdapter(results.HostReplyTaken).json_schema(), host_sends=False)}

### HostError

{_paragraphs(HostError.__doc__ or "")}

{_fields(HostError.model_json_schema())}"""


def _reply() -> str:
    schema = Reply.model_json_schema()
    parts = ["## Replies", "", "### Reply", "", _paragraphs(schema["description"]), ""]
    parts.append(_fields(schema, host_sends=False))
    error = schema["$defs"]["ErrorInfo"]
    parts += [
        "",
        "### ErrorInfo",
        "",
        _paragraphs(error["description"]),
        "",
        _fields(error, host_sends=False),
    ]
    return "\n".join(parts)


def _commands() -> str:
    defs = COMMAND_ADAPTER.json_schema()["$defs"]
    parts = [
        "## Commands",
        _shared_fields(defs, "Trace context", TRACE_FIELDS, tracecontext),
        _shared_fields(defs, "Causation", CAUSE_FIELDS, causation),
    ]
    for model in COMMAND_TYPES:
        schema = defs[model.__name__]
        tag = _tag(model)
        result = _python_type(results.RESULTS[tag])
        skip = ("type", *TRACE_FIELDS, *CAUSE_FIELDS)
        parts += [f"### `{tag}`", _paragraphs(schema.get("description", "")), _fields(schema, skip=skip)]
        parts.append(f"**Result:** {result}.")
    return "\n\n".join(parts)


def _shared_fields(
    defs: Mapping[str, Any], title: str, names: tuple[str, ...], module: types.ModuleType
) -> str:
    """Fields every command has, said once under `title` (their tables leave them out): `module`'s
    docstring after its first paragraph, then the fields' table. The trace context (protocol/tracecontext.py)
    and the causation (protocol/causation.py) are two such groups."""
    schema = defs[COMMAND_TYPES[0].__name__]
    fields = {"properties": {name: schema["properties"][name] for name in names}}
    text = _paragraphs(inspect.getdoc(module) or "").split("\n\n", 1)[1]
    intro = (
        f"Every command below also accepts the two {title.lower()} fields, left out of its table: "
        + ", ".join(f"`{name}`" for name in names)
        + "."
    )
    return "\n\n".join([f"### {title}", intro, text, _fields(fields)])


def _events() -> str:
    defs = EVENT_ADAPTER.json_schema()["$defs"]
    parts = ["## Events", "Every event is a JSON object whose `type` names it."]
    for model in _EVENT_TYPES:
        schema = defs[model.__name__]
        description = _paragraphs(schema.get("description", ""))
        parts += [f"### `{_tag(model)}`", description, _fields(schema, "type", host_sends=False)]
    return "\n\n".join(parts)


def _types() -> str:
    command_models = {model.__name__ for model in COMMAND_TYPES}
    defs = COMMAND_ADAPTER.json_schema()["$defs"]
    parts = ["## Types used in commands"]
    for name, schema in defs.items():
        if name not in command_models:
            parts += [f"### {name}", _paragraphs(schema.get("description", "")), _fields(schema)]
    return "\n\n".join(parts)


def _results() -> str:
    parts = [
        "## Result types",
        "What `Reply.result` holds when `ok`, per the command's **Result** line; "
        "`onceflow.protocol.result_of(reply)` validates it into the model.",
    ]
    shown = set(COMMAND_ADAPTER.json_schema()["$defs"])
    for name, schema in _result_models():
        if name not in shown:
            shown.add(name)
            description = _paragraphs(schema.get("description", ""))
            parts += [f"### {name}", description, _fields(schema, host_sends=False)]
    return "\n\n".join(parts)


def _errors() -> str:
    rows = [(cls.code, cls.retryable, _first_paragraph(cls.__doc__ or "")) for cls in _error_classes()]
    rows.insert(1, _INTERNAL)
    storage = _storage_kinds()
    for kind in typing.get_args(errors.StorageKind):
        retryable = kind in errors.RETRYABLE_STORAGE_KINDS
        rows.append((f"storage_{kind}", retryable, storage[kind]))
    lines = [
        "## Error codes",
        "",
        "`error.code` is stable. `retryable` is true when nothing of the command was committed and "
        "sending the same command again may succeed once the condition clears. A storage fault rolls back "
        "the failing request's writes (and, when it ended the transaction, those of every request sharing "
        "its group commit); an earlier, separate transaction of the same command stands.",
        "",
        "| Code | Retryable | Meaning |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| `{code}` | {'yes' if retry else 'no'} | {_cell(meaning)} |" for code, retry, meaning in rows
    ]
    return "\n".join(lines)


def _limits() -> str:
    documented = _module_docstrings(limits)
    lines = [
        "## Limits",
        "",
        "From `protocol/limits.py`. Anything beyond a limit is refused with a typed error naming the field "
        "(`invalid_message`, or `workflow_invalid` for a template) before anything is stored.",
        "",
        "| Name | Value | Meaning |",
        "| --- | --- | --- |",
    ]
    for name, doc in documented.items():
        value = getattr(limits, name)
        shown = f"{value:,}" if isinstance(value, int) else f"`{value}`"
        lines.append(f"| `{name}` | {_cell(shown)} | {_cell(_join(doc))} |")
    return "\n".join(lines)


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


# --- what goes into them ------------------------------------------------------------------------------


def _tag(model: type[BaseModel]) -> str:
    return str(model.model_fields["type"].default)


def _anchor(name: str) -> str:
    """The anchor GitHub gives a heading: command and event sections are headed by their `type` tag."""
    for model in (*COMMAND_TYPES, *_EVENT_TYPES):
        if model.__name__ == name:
            return _tag(model)
    return name.lower()


def _link(model: type[BaseModel] | str) -> str:
    name = model if isinstance(model, str) else model.__name__
    label = name if isinstance(model, str) else f"`{_tag(model)}`"
    return f"[{label}](#{_anchor(name)})"


def _fields(schema: Mapping[str, Any], skip: tuple[str, ...] | str = (), *, host_sends: bool = True) -> str:
    """A table of the model's fields: name, type with bounds, default (or required), description. A model
    the runtime sends (`host_sends=False`: replies, events, results) has every field present, so it gets
    no default column."""
    required = set(schema.get("required", ()))
    lines = ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
    if not host_sends:
        lines = ["| Field | Type | Description |", "| --- | --- | --- |"]
    for name, prop in schema.get("properties", {}).items():
        if name in ((skip,) if isinstance(skip, str) else skip):
            continue
        cells = [f"`{name}`", _schema_type(prop)]
        if host_sends:
            cells.append("required" if name in required else f"`{json.dumps(_default(prop))}`")
        cells.append(_join(prop.get("description", "")))
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines)


def _default(prop: Mapping[str, Any]) -> Any:
    """The default of an optional field; a schema shows none for a default factory (an empty list or
    mapping here)."""
    if "default" in prop:
        return prop["default"]
    return [] if prop.get("type") == "array" else {}


def _schema_type(prop: Mapping[str, Any]) -> str:
    """A JSON Schema property as words: its type, then its bounds."""
    if "$ref" in prop:
        return _link(prop["$ref"].rsplit("/", 1)[1])
    if "discriminator" in prop:
        return "[an event](#events)"
    if "anyOf" in prop:
        return " or ".join(_schema_type(option) for option in prop["anyOf"])
    if "allOf" in prop and len(prop["allOf"]) == 1:
        return _schema_type(prop["allOf"][0])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        items = _schema_type(prop.get("items", {}))
        return f"list of {items}" + _bounded(_size(prop, "minItems", "maxItems", "items"))
    if kind == "string":
        return "string" + _bounded([*_size(prop, "minLength", "maxLength", "characters"), *_pattern(prop)])
    if kind == "integer":
        if (prop.get("minimum"), prop.get("maximum")) == (limits.INT64_MIN, limits.INT64_MAX):
            return "integer (int64)"
        return "integer" + _bounded(_range(prop))
    return str(kind) if kind else "any JSON"


def _bounded(bounds: list[str]) -> str:
    return f" ({', '.join(bounds)})" if bounds else ""


def _size(prop: Mapping[str, Any], low: str, high: str, unit: str) -> list[str]:
    lo: int | None = prop.get(low)
    hi: int | None = prop.get(high)
    if lo is not None and hi is not None:
        return [f"{lo:,} to {hi:,} {unit}"]
    if hi is not None:
        return [f"at most {hi:,} {_unit(hi, unit)}"]
    if lo is not None:
        return [f"at least {lo:,} {_unit(lo, unit)}"]
    return []


def _unit(count: int, unit: str) -> str:
    return unit.removesuffix("s") if count == 1 else unit


def _range(prop: Mapping[str, Any]) -> list[str]:
    bounds = []
    for key, sign in [
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
    ]:
        if key in prop:
            value = prop[key]
            shown = "int64 max" if value == limits.INT64_MAX else f"{value:,}"
            bounds.append(f"{sign} {shown}")
    return bounds


def _pattern(prop: Mapping[str, Any]) -> list[str]:
    pattern = prop.get("pattern")
    if pattern is None:
        return []
    if pattern == limits.ID_PATTERN:
        return ["no control characters"]
    if pattern == times.RFC3339_UTC.pattern:
        return ["RFC 3339 UTC, `2026-03-01T12:00:00Z`"]
    return [f"matching `{pattern}`"]


def _python_type(tp: Any) -> str:
    """A result type (`RESULTS` value) as words with links."""
    if tp is None or tp is type(None):
        return "`null`"
    if typing.get_origin(tp) is list:
        return f"list of {_python_type(typing.get_args(tp)[0])}"
    if isinstance(tp, types.UnionType):
        return " or ".join(_python_type(arg) for arg in typing.get_args(tp))
    return _link(tp.__name__)


def _result_models() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every model a result is made of (top level, then nested), in `RESULTS` order."""
    for command in results.RESULTS:
        schema = results.result_adapter(command).json_schema()
        if "properties" in schema:
            yield schema["title"], schema
        yield from schema.get("$defs", {}).items()


def _error_classes() -> list[type[errors.OnceflowError]]:
    """Every error class with a code of its own, in definition order (storage errors are per kind; a
    `RefusedError` carries the code of the reply it raises)."""
    found = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.OnceflowError)
        if cls not in (errors.OnceflowError, errors.StorageError, errors.RefusedError)
    ]
    from onceflow.serve.http.api import ForbiddenError, TooLargeError, UnauthorizedError

    return [
        *found,
        SlowConsumerError,
        IdleTimeoutError,
        EvictedError,
        UnauthorizedError,
        ForbiddenError,
        TooLargeError,
    ]


def _storage_kinds() -> dict[str, str]:
    """Each storage kind's meaning: its line in `StorageKind`'s docstring (with the SQLite codes)."""
    doc = _module_docstrings(errors)["StorageKind"]
    bullets = re.findall(r"^- (\w+): (.*?)(?=^- |\Z)", doc, flags=re.MULTILINE | re.DOTALL)
    return {kind: _join(text).rstrip(";.").capitalize() + "." for kind, text in bullets}


def _module_docstrings(module: types.ModuleType) -> dict[str, str]:
    """The documented module-level names, in order: `NAME = ...` followed by a string literal."""
    body = ast.parse(inspect.getsource(module)).body
    found: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        target = (
            statement.targets[0] if isinstance(statement, ast.Assign) else getattr(statement, "target", None)
        )
        literal = following.value if isinstance(following, ast.Expr) else None
        if (
            isinstance(target, ast.Name)
            and isinstance(literal, ast.Constant)
            and isinstance(literal.value, str)
        ):
            found[target.id] = inspect.cleandoc(literal.value)
    return found


def _first_paragraph(text: str) -> str:
    return _join(inspect.cleandoc(text).split("\n\n")[0])


def _paragraphs(text: str) -> str:
    return "\n\n".join(_join(paragraph) for paragraph in inspect.cleandoc(text).split("\n\n"))


def _join(text: str) -> str:
    """Docstring lines as one line."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
