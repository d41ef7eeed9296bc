"""`onceflow serve`: the protocol as JSON lines over a Unix domain socket or stdin/stdout. Trio thread: one
Trio run owning the runtime and every connection (wire.py: framing; connection.py: one client; server.py:
accepting, serving and shutting down; admission.py: the connection cap and eviction; descriptors.py: the
open-files limit and the spare descriptor; options.py: the bounds; cli.py: the command line).

Wire format (one JSON object per line, UTF-8, `\\n`-terminated; a blank line is ignored):

- Request: any command object, optionally with an `"id"` (a string of at most 256 characters, or an
  integer in the int64 range) that the reply echoes; the `id` is removed before the command is decoded.
  `{"type": "subscribe"}` asks for the event stream on this connection (below, "Events").
- Reply to a request: `{"id": <id or null>, "reply": <Reply>}`, the same `Reply` model `Runtime.send`
  returns in process; its `command` is the `type` the line named whenever it named one, known or not. A
  line that is not JSON, names an unknown command or has a bad field gets an `invalid_message` reply and
  the connection stays open; `id` is null only when the line had none. A line that is not JSON (or is
  too long, below) is still scanned from its start for its top-level members: the `id` and `type` among
  those complete in its first 4 KiB are echoed and named as for a readable line.
- A bad `id` (a float, an integer outside int64, a boolean, an array or object, a string over 256
  characters) gets `invalid_message` with field `id`, and the command does not run. Its reply's `id` is
  what was sent, as a string a client can match: a string id itself, any other value its compact JSON
  text as Python writes it (`1.5` -> `"1.5"`, `2**64` -> `"18446744073709551616"`, `[1]` -> `"[1]"`,
  `true` -> `"true"`).
- A line longer than `max_line` bytes gets `invalid_message` (its `id` and `command` as found at its
  start, above) and is skipped up to its newline. By default `max_line` is the protocol's own message limit,
  `protocol.limits.MAX_MESSAGE_BYTES` (8 MiB): any line the runtime accepts is read.
- Event (after `subscribe`): `{"event_seq": <int>, "event": <Event>}`; gap: `{"gap": {"after": N, "next":
  M}}` (below).
- Connection error, the last line before the server closes the connection: `{"error": <ErrorInfo>}`;
  `slow_consumer` when the client stopped reading and its outgoing queue filled, `idle_timeout` when it
  sent nothing and had nothing in flight for `idle_timeout` seconds, `evicted` (retryable) when it was
  idle the longest as a new client arrived at `max_connections` (below), `busy` (retryable) to a new
  client when the server serves `max_connections` clients and none is idle, or has no file descriptor
  left for it: that connection gets this one line and is closed.

Events. Every event gets an `event_seq` when published: integers that increase strictly, also across
restarts of the runtime on the same database, but are not consecutive (they jump at each start and about
every 2**23 events), all below 2**53. The runtime keeps its last `--event-window` events (default 10,000, a
count; at most 1,000,000). `{"type": "subscribe"}` streams the events from now on; `{"type": "subscribe",
"after": N}` (N the last `event_seq` the client processed: an integer from 0 to 2**63-1, else
`invalid_message` with field `after`; no other field) first replays the held events after N, then goes on
live: every event after N that the runtime holds or publishes later comes once, in seq order, with no
duplicate and no gap between replay and live. When some events after N are gone (older than the window,
or from before a restart: a resume from a seq of an earlier start always gets one; or N is no seq this
stream reached), the first line after the reply is one `{"gap": {"after": N, "next": M}}`: events between
N and M may be missing, so the client reads durable state (`get_task`, `task_history`, `list_runs`, ...);
every event from M on follows. The reply's result is `{"subscribed": true, "next_event_seq": M}`: every
event line that follows has a seq of at least M, and none from M on is skipped. The replay, and whatever is
published while it runs, goes at the client's pace: it is queued only while the outgoing queue is under
half its bounds, waiting for the client to read otherwise (the other half stays free for replies), so a
replay never makes a slow consumer. Once caught up, events are queued as published and never wait: a
client that does not keep up is disconnected as `slow_consumer` (as is one the replay leaves more than the
window behind), and may reconnect and resume with `after` = the last seq it processed. A second
`subscribe` on a connection that subscribes is refused with `conflict` (open another connection to
resume elsewhere).

A connection's commands are applied one at a time in the order received (as a host awaiting each
`Runtime.send` in turn would), and replied to in that order; for parallelism open more connections. Up
to `max_pipeline` received lines, and `max_line` bytes of them, wait their turn; past that the server
stops reading that connection (the socket's own flow control), and no other client is slowed. Each
connection's commands run in a task of the server's, never cancelled by the client going away: a client
that disconnects mid-command loses nothing that committed — what it had sent still runs and commits;
the replies are dropped. The one exception is `claim_run`: a claim is work handed to its caller, so once
the client has closed its side (end of stream) a claim of its stops waiting and claims nothing (a run it
claimed meanwhile is handed back) and a later one is answered as finding none: no run is left claimed by
a client that is gone.

Bounds, per connection unless said: outgoing, at most `queue_size` lines and `queue_bytes` bytes
(each frame counted at its full encoded size, from when it is queued until the socket took all of it)
wait for the client; a frame that would pass either limit, a single frame larger than `queue_bytes`
included, makes the client a slow consumer: it is sent the `slow_consumer` error line after what is
queued (if it reads within `grace` seconds) and disconnected. Nothing the runtime does ever waits on a
client. Incoming, the line being read (`max_line` bytes) and the pipeline above. A socket connection is
idle when no byte arrives from it, no command of it is pending or running, nothing is queued for it and
it has no subscription (a subscriber waits for events; a subscriber that stops reading is a slow consumer
once events flow); after `idle_timeout` seconds idle (0: never) it gets the `idle_timeout` error line
and is closed. Any line, even a blank one, counts as activity. The one `--stdio` client is never idle.

Connections: at most `max_connections` at once (each holds a file descriptor); the listen backlog is
`backlog`. By default `max_connections` is 256, or what the open-files limit (RLIMIT_NOFILE) leaves if
that is less: at start, with the store open, the descriptors then open and a headroom of 32 (the spare
below, a store reconnection, sockets being refused, a margin) are set aside, and the rest may be clients.
The soft limit is first raised toward the hard one, as far as that needs; an explicit `max_connections`
the limit cannot hold is lowered to what it can, with a WARNING `max_connections_clamped`, and a limit
that leaves no descriptor for a single client stops the server at start with an error. When a new client
arrives at the cap, the connection idle the longest (idle as above, oldest last activity first) is sent
the `evicted` error line and closed (within 0.5 s) to make room, and the new client is served; with none
idle (subscribers and connections with commands in flight are never evicted) the new client gets the one
`busy` line instead (the server waits at most 1 s for it to be read). Either way a client is answered
within a second of connecting; an episode at the cap logs one WARNING `connections_at_cap` (and an INFO
`connections_below_cap` at its end), not one per connection. When accept fails for want of a file
descriptor all the same (EMFILE, ENFILE: the store, or the system, took them), the server closes a spare
descriptor it holds for this, accepts the waiting client in its place and sends it the `busy` line (or
serves it, if a descriptor came free meanwhile), then holds the spare again: one WARNING
`accept_out_of_descriptors` per episode. When accept fails for want of memory (ENOBUFS, ENOMEM), or the
spare cannot be held, the server stops accepting for a moment (10 ms, doubling up to 1 s, until an
accept succeeds), logging one WARNING `accept_paused` per episode and an INFO `accept_resumed` at its
end; connected clients are served meanwhile and new ones wait in the backlog.

SIGTERM or SIGINT: stop accepting and reading, let every received command finish and its reply be
written (clients get `grace` seconds to read them), close the store, remove the socket file, exit 0. A
second signal cancels what is left (the store still finishes or rolls back each transaction whole).
At start, after the workflows are registered, one line `serving on PATH` (or `serving on stdio`) goes to
stderr. The socket file is created with mode 0600 (owner only); a stale socket file is replaced, a live
one (another server answers) is an error.
"""

from onceflow.serve.cli import add_parser, run
from onceflow.serve.options import EvictedError, IdleTimeoutError, ServeOptions, SlowConsumerError
from onceflow.serve.server import Server, serve
from onceflow.serve.wire import MAX_ID_LENGTH

__all__ = [
    "MAX_ID_LENGTH",
    "EvictedError",
    "IdleTimeoutError",
    "ServeOptions",
    "Server",
    "SlowConsumerError",
    "add_parser",
    "run",
    "serve",
]
