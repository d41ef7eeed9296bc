"""`onceflow serve --http HOST:PORT`: the protocol over HTTP/1.1 (and h2), its events as Server-Sent Events,
an OpenAPI 3.1 document, and a board. Trio thread: hypercorn's Trio protocol server in the same Trio run as
the runtime and the socket (listen.py; protocol.py: its HTTP/1.1 protocol answering `POST /v1/commands`
itself, the hot path), a Starlette app (app.py: the routes and the token check; api.py: commands, resource
routes, statuses; sse.py: events; openapi.py; graph.py: workflow graphs as SVG; options.py: the bind,
bounds and tokens; board/: the pages).

Routes (every JSON answer is the socket's `Reply` object; its status follows the error code):

- `POST /v1/commands`: the body is one command object (as a socket line, without `id`); the response is
  its `Reply`. `POST /v1/commands/{type}`: the same, the body's `type` may be left out. `subscribe`,
  `register_host` and `host_reply` are the socket's (400, field `type`).
- `GET /v1/tasks` (`list_tasks`; `after`, `limit`), `/v1/tasks/{task_id}` (`get_task`),
  `/v1/tasks/{task_id}/history` (`task_history`; `after`, `limit`), `/v1/runs` (`list_runs`; `task_id`,
  `agent_profile_id`, `status`, `after`, `limit`), `/v1/host-calls` (`list_host_calls`),
  `/v1/workflows` (`list_workflows`), `/v1/workflows/{workflow_id}` (`get_workflow`; `version`),
  `/v1/workflows/{workflow_id}/graph.svg` (its graph), `/v1/runs/{run_id}` (`get_run`), `/v1/queue`
  (`queue_stats`), `/v1/pauses` (`list_pauses`): each sends the command named, query parameters as its
  fields.
- `GET /v1/events`: `text/event-stream`; each event `id: <event_seq>` and `data: <Event JSON>`; resumes
  after the `Last-Event-ID` header (or `?after=N`) exactly as the socket's `subscribe after`: the held
  events after it, then live ones, each once in seq order; `event: gap` with data `{after, next}` first
  when some are gone (read durable state). A `: keepalive` comment every `heartbeat` seconds.
- `GET /openapi.json` (OpenAPI 3.1, from the pydantic models `onceflow schema` prints), `GET /docs` (a page
  rendering it), `GET /` (the board), `GET /v1/session` (`{role, tokens}`: what this request's token may do).

Status: 200 ok; 400 invalid_message, workflow_invalid; 401 unauthorized; 403 forbidden; 404 not_found; 409
conflict and the other refusals of a valid command (fence_required, wip_limit, transition_refused,
transition_failed, host_refused); 413 too_large; 429 busy, rate_limited; 503 shutting_down,
host_unavailable and the retryable storage faults (504 host_timeout; 500 action_failed,
action_not_wired, storage_read_only, storage_corrupt); a code not listed is 503 when retryable, else 400.
A retryable refusal carries `Retry-After: 1`.

Safe by default: binds 127.0.0.1; a non-loopback address needs `--token-file` (bearer tokens, `read` or
`write`; with a file every /v1/ route needs a token, 401 otherwise; a `read` token may only GET and send
the read-only commands, 403 otherwise); the pages and /openapi.json hold no data and need none. Bounds:
request body `max_body` bytes (413), request line and headers `max_header` bytes, `max_connections` at once
(past it a new client gets one 503 `busy` and is closed), keep-alive and read timeouts. CORS is off unless
`--cors-origin` names origins. Commands run as the socket's do, in the server's command nursery: a client
going away never cancels one (but a `claim_run`, which then claims nothing). An event stream whose client
does not take a write within `grace` seconds is closed (it resumes with Last-Event-ID). SIGTERM: stop
accepting, finish the requests under way, end the event streams.
"""

from onceflow.serve.http.options import HttpOptions, Tokens

__all__ = ["HttpOptions", "Tokens"]
