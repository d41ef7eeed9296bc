"""`onceflow serve`'s command line: its options and `run`. Trio thread (it starts the Trio run)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import trio

from onceflow.actors.kernel.event_window import DEFAULT_EVENT_WINDOW, MAX_EVENT_WINDOW
from onceflow.actors.runtime.startup import SWITCH_INTERVAL
from onceflow.protocol.durations import seconds
from onceflow.protocol.limits import MAX_MESSAGE_BYTES
from onceflow.serve.descriptors import DEFAULT_MAX_CONNECTIONS
from onceflow.serve.http.options import BindError, HttpOptions, Tokens, parse_bind
from onceflow.serve.options import ServeOptions
from onceflow.serve.server import serve
from onceflow.store.backends.urls import database_arg


def add_parser(sub: Any) -> None:
    """Add the `serve` subcommand to the CLI's subparsers."""
    parser = sub.add_parser(
        "serve", help="serve the protocol as JSON lines over a Unix socket or stdio, and/or over HTTP"
    )
    parser.add_argument("--db", type=database_arg, required=True, help="SQLite file or postgresql:// URL")
    parser.add_argument(
        "--workflow", type=Path, nargs="+", action="extend", default=[], help="templates to register at start"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", type=Path, help="Unix domain socket path to listen on")
    where.add_argument("--stdio", action="store_true", help="one client on stdin/stdout")
    parser.add_argument(
        "--http",
        metavar="HOST:PORT",
        type=_bind_arg,
        help="serve the HTTP API, its events and the board too (beside --socket, or alone); "
        "a non-loopback HOST needs --token-file",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help="bearer tokens for --http, one a line: `write TOKEN` or `read TOKEN` (read: the board's)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="an origin whose pages may call the HTTP API (repeatable; default: CORS off)",
    )
    defaults = ServeOptions()
    count = _count_arg
    parser.add_argument(
        "--queue-size", type=count, default=defaults.queue_size, help="lines a client may lag"
    )
    parser.add_argument(
        "--queue-bytes", type=count, default=defaults.queue_bytes, help="bytes a client may lag"
    )
    parser.add_argument(
        "--max-line",
        type=_line_arg,
        default=defaults.max_line,
        help=f"bytes in one request line (at most the message limit, {MAX_MESSAGE_BYTES})",
    )
    parser.add_argument("--grace", type=float, default=defaults.grace, help="seconds to read before close")
    parser.add_argument(
        "--max-connections",
        type=count,
        default=defaults.max_connections,
        help=f"clients served at once (default {DEFAULT_MAX_CONNECTIONS}, or fewer if the open-files limit "
        "allows fewer; a larger value is lowered to what it allows)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=functools.partial(_seconds_arg, "--idle-timeout"),
        default=defaults.idle_timeout,
        help="seconds a client may stay idle before it is closed (0: never)",
    )
    parser.add_argument(
        "--backlog", type=count, default=defaults.backlog, help="connections queued before accept"
    )
    parser.add_argument(
        "--event-window",
        type=_window_arg,
        default=DEFAULT_EVENT_WINDOW,
        help=f"events kept for subscribers resuming with after (1 to {MAX_EVENT_WINDOW})",
    )
    parser.add_argument(
        "--switch-interval",
        type=functools.partial(_seconds_arg, "--switch-interval"),
        default=SWITCH_INTERVAL,
        help="GIL switch interval in seconds while serving (0: Python's own)",
    )
    parser.add_argument(
        "--host-timeout",
        type=functools.partial(_positive_seconds_arg, "--host-timeout"),
        default=defaults.host_timeout,
        help="seconds a host connection has to answer a call (register_host)",
    )
    parser.add_argument(
        "--host-wait",
        type=functools.partial(_positive_seconds_arg, "--host-wait"),
        default=defaults.host_wait,
        help="seconds a call waits for a host with its capability before it is host_unavailable",
    )


def _count_arg(text: str) -> int:
    """A count or size option: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _line_arg(text: str) -> int:
    """`--max-line`: a count of at most the protocol's message limit (a longer line would be read only for
    the runtime to refuse it for its size)."""
    value = _count_arg(text)
    if value > MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be at most the message limit {MAX_MESSAGE_BYTES}, not {value}"
        )
    return value


def _window_arg(text: str) -> int:
    """`--event-window`: a count of at most `MAX_EVENT_WINDOW` (the ring is allocated up front)."""
    value = _count_arg(text)
    if value > MAX_EVENT_WINDOW:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_EVENT_WINDOW}, not {value}")
    return value


def _seconds_arg(flag: str, text: str) -> float:
    """`--switch-interval`, `--idle-timeout`: seconds, finite and >= 0 (0 has the flag's own meaning)."""
    try:
        return seconds(flag, float(text), allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds_arg(flag: str, text: str) -> float:
    """`--host-timeout`, `--host-wait`: seconds, finite and > 0."""
    try:
        return seconds(flag, float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bind_arg(text: str) -> tuple[str, int]:
    """`--http HOST:PORT`."""
    try:
        return parse_bind(text)
    except BindError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def http_options(args: argparse.Namespace) -> HttpOptions | None:
    """The HTTP listener's options from the parsed arguments (None without `--http`). Raises ValueError
    (a bad token file, a non-loopback bind without one, `--token-file` or `--cors-origin` without
    `--http`, `--http` with `--stdio`) and OSError (the token file cannot be read)."""
    if args.http is None:
        if args.token_file is not None or args.cors_origin:
            raise ValueError("--token-file and --cors-origin go with --http")
        return None
    if args.stdio:
        raise ValueError("--http goes with --socket or alone, not with --stdio")
    host, port = args.http
    tokens = Tokens.load(args.token_file) if args.token_file is not None else Tokens()
    return HttpOptions(host=host, port=port, tokens=tokens, cors_origins=tuple(args.cors_origin))


def run(args: argparse.Namespace) -> int:
    """Run `onceflow serve` from parsed arguments (see `add_parser`). Raises as `serve` does; a bad HTTP
    option (`http_options`) is one `error:` line on stderr and exit status 2."""
    if args.socket is None and not args.stdio and args.http is None:
        print("error: serve needs --socket, --stdio or --http", file=sys.stderr)
        return 2
    try:
        http = http_options(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    options = ServeOptions(
        queue_size=args.queue_size,
        queue_bytes=args.queue_bytes,
        max_line=args.max_line,
        grace=args.grace,
        max_connections=args.max_connections,
        idle_timeout=args.idle_timeout,
        backlog=args.backlog,
        host_timeout=args.host_timeout,
        host_wait=args.host_wait,
    )
    return trio.run(
        functools.partial(
            serve,
            args.db,
            args.workflow,
            socket_path=args.socket,
            options=options,
            switch_interval=args.switch_interval or None,
            event_window=args.event_window,
            http=http,
        )
    )
