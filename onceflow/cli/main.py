"""The `onceflow` command: demo, run, validate, schema, serve, test and the read-only views. Main thread: each
subcommand runs its own Trio run.

  onceflow demo [--db PATH]                                   the bundled walkthrough
  onceflow run --workflow FILE --script FILE [--db PATH] [--json] [--keep-going] [--from-line N]
                                                              replay protocol commands, print the events
  onceflow validate [--strict] FILE...                        check workflow templates (and lint them)
  onceflow schema [--template [--import-path] | --markdown]   JSON Schema of commands, events, reply and
                                                              results; of the template format; or the
                                                              protocol reference page (docs/protocol.md)
  onceflow serve --db FILE --workflow FILE... [--socket PATH | --stdio]
                                                              the protocol over a socket (onceflow.serve)
  onceflow test SCENARIO.yml...                               scenario tests (onceflow.scenario)
  onceflow tasks|runs|entries|decisions|outcomes|workflows --db FILE|URL [--task ID] [--json] [--limit N]
                                                              read-only views (onceflow.cli.views), streamed
  onceflow queue --db FILE|URL [--json]                       per agent: queued, claimed, ceiling, oldest age,
                                                              paused, refused in the last hour
  onceflow history --db FILE|URL --task ID [--json] [--limit N]
                                                              a task's history (onceflow.cli.history)
  onceflow prune --db FILE|URL [--older-than SECONDS]         retention now (onceflow.cli.prune)
  onceflow --version

Exit status: 0 on success; 1 when a template is invalid or a replayed command was refused; 2 when the
command cannot run: a usage error, or a file it names cannot be used (missing, a directory, not UTF-8, not
a database, a database another runtime owns, a --db whose folder does not exist: no folder is created), or
a `postgresql://` --db that cannot be used (a bad URL, a server that does not answer, credentials refused,
no such database, no onceflow schema). Such a file or URL gets one `error:` line on stderr naming it
(password redacted), never a traceback. A closed stdout (`onceflow runs --json | head -1`) ends the command
quietly with 141. SIGINT or SIGTERM during `run` or `demo` finishes the command under way, closes the
runtime (releasing the database) and exits with 130 or 143 after one line on stderr saying what was
finished and how to resume; a second signal cancels at once. Human output escapes control characters
(`onceflow.cli.trace.escape_controls`); `--json` output is JSON. Logs go to stderr (WARNING and up unless
--verbose), coloured only when stderr is a terminal and NO_COLOR is unset; --log-json writes them as one
JSON object per line.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onceflow.cli.trace import escape_controls

if TYPE_CHECKING:
    import argparse

    import trio

    _SUBPARSERS = argparse._SubParsersAction[argparse.ArgumentParser]

# Only what every subcommand needs is imported here: each subcommand imports its own machinery when it runs
# (the runtime, trio, pydantic's protocol models, the scenario runner, serve, psycopg), so `onceflow --help`
# and `onceflow validate` start as fast as Python allows.

REFUSED = 1
"""Exit status: a template is invalid or a replayed command was refused."""
CANNOT_RUN = 2
"""Exit status: a usage error, or a file the command names cannot be used."""
CLOSED_PIPE = 141
"""Exit status when stdout was closed under the command (its reader, such as `head`, went away): 128 +
SIGPIPE (13), as a tool killed by SIGPIPE, with nothing on stderr. (`signal` is imported only where a
command handles signals: its enums cost a CLI start ~3 M instructions.)"""


def configure_logging(verbose: bool, as_json: bool = False) -> None:
    """Structured logs to stderr; identifying fields stay discrete keys, control characters escaped.

    With `as_json` (`--log-json`) one JSON object per record (`event`, its fields, `level`, `timestamp` in
    RFC 3339 UTC); otherwise coloured (ANSI escapes) only when stderr is a terminal and NO_COLOR is unset
    or empty: a pipe, a file or a supervisor's log gets plain text, tracebacks included.
    """
    import logging

    import structlog

    colors = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=True)
        if colors
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    stamp = (
        structlog.processors.TimeStamper(fmt="iso", utc=True)
        if as_json
        else structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            stamp,
            *([structlog.processors.format_exc_info] if as_json else [_escape_values]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG if verbose else logging.WARNING),
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),  # the stderr of each call
        cache_logger_on_first_use=False,
    )


def _escape_values(_: object, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    return {key: escape_controls(value) if isinstance(value, str) else value for key, value in event.items()}


def say(text: str, *, err: bool = False) -> None:
    """Print one line of human output, control characters escaped."""
    print(escape_controls(text), file=sys.stderr if err else sys.stdout)


def read_text(path: Path) -> str:
    """The UTF-8 text of `path`.

    Raises:
        OSError: the file cannot be read (its `filename` names it). ValueError: it is not UTF-8 (the message
            names the file and the offset of the first bad byte).
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_script(path: Path) -> list[tuple[int, Any]]:
    """Commands from a script, each with its 1-based line number in the file: JSON lines (`.jsonl`/`.json`;
    `#` starts a comment line), or a YAML list (the line each item starts on).

    A JSON line is passed to the runtime as its raw bytes, so a line that is not UTF-8 or not JSON gets its
    own typed reply and the rest of the script still runs.

    Raises:
        OSError: the file cannot be read. ValueError: a YAML script is not UTF-8 or not a list (the message
        names the file).
    """
    if path.suffix not in (".jsonl", ".json"):
        import yaml

        text = read_text(path)
        try:
            loaded = yaml.safe_load(text)
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, list) or not isinstance(node, yaml.SequenceNode):
            raise ValueError(f"{path}: a YAML script must be a list of commands")
        return [(item.start_mark.line + 1, value) for item, value in zip(node.value, loaded, strict=True)]
    return [
        (number, line)
        for number, line in enumerate(path.read_bytes().splitlines(), start=1)
        if line.strip() and not line.lstrip().startswith(b"#")
    ]


class Progress:
    """How far a `run` got, for the line an interrupt prints: commands of the script sent (each answered)
    and the script line of the last one. (A plain class: `attrs` is not imported for `onceflow --help`.)"""

    def __init__(self) -> None:
        self.sent = 0
        self.last_line: int | None = None


def say_database(db: Path | str) -> None:
    """The one line saying where a command's state is, on stderr: `database: PATH` (a URL with its
    password redacted). `run` and `demo` print it once the runtime is open, also when the CLI picked a
    fresh file."""
    from onceflow.store.backends.urls import redacted

    say(f"database: {redacted(db) if isinstance(db, str) else db}", err=True)


async def replay(
    workflow: Path,
    script: Path,
    db: Path | str,
    as_json: bool,
    stop: trio.Event,
    keep_going: bool = False,
    from_line: int = 1,
    progress: Progress | None = None,
) -> int:
    """Register `workflow`, send every command of `script`, print each reply and its events.

    Once the runtime is open, one line `database: PATH` (a URL with its password redacted) on stderr: where
    the run's state is, also when the CLI picked a fresh file. A refusal names where the command came from
    (`FILE:LINE`, the workflow file for the registration): in the human output on the reply's line, with
    `--json` as one `refused: FILE:LINE: ...` line on stderr (stdout stays one reply per line). A refused
    `register_workflow` (the workflow's or one in the script) stops the run there, since the commands
    after it would be refused in a cascade: one `stopped: ...` line on stderr, exit 1; with `keep_going`
    the run goes on. Stops before the next command once `stop` is set; the command under way finishes and
    is printed. Only the script's commands on line `from_line` or later are sent (resuming an interrupted
    run; the workflow is registered again, which changes nothing when it is the same). `progress` counts
    the script's commands sent.
    """
    import json

    from onceflow.actors.runtime.startup import open_runtime
    from onceflow.cli.trace import describe
    from onceflow.protocol.codec import encode

    commands = [(n, c) for n, c in load_script(script) if n >= from_line]
    register = {"type": "register_workflow", "yaml": read_text(workflow), "source": str(workflow)}
    refused = 0
    progress = Progress() if progress is None else progress
    async with open_runtime(db) as runtime:
        say_database(db)
        for line, command in [(None, register), *commands]:
            if stop.is_set():
                break
            where = str(workflow) if line is None else f"{script}:{line}"
            reply = await runtime.send(command)
            if line is not None:
                progress.sent, progress.last_line = progress.sent + 1, line
            refused += not reply.ok
            kind = str(command.get("type", "?")) if isinstance(command, dict) else reply.command
            error = f"{reply.error.code}: {reply.error.message}" if reply.error else ""
            if as_json:
                print(encode(reply), flush=True)
                if not reply.ok:
                    say(f"refused: {where}: {kind}: {error}", err=True)
            else:
                status = "ok" if reply.ok else f"refused: {reply.error.code if reply.error else ''}"
                if reply.ok and isinstance(reply.result, dict) and reply.result.get("idempotent"):
                    status = "ok, idempotent: already applied, nothing ran"
                said = f" {reply.error.message} ({where})" if reply.error else ""
                say(f"> {kind} [{status}]{said}")
                for event in reply.events:
                    say(f"    {describe(event)}")
                if reply.ok and str(kind).startswith(("get_", "list_", "claim_")):
                    say(f"    result: {json.dumps(reply.result)}")
                sys.stdout.flush()
            if not reply.ok and reply.command == "register_workflow" and not keep_going:
                say(
                    f"stopped: register_workflow refused ({where}); the commands after it were not sent"
                    " (--keep-going sends them anyway)",
                    err=True,
                )
                break
    return REFUSED if refused else 0


async def demo(db: Path | str, stop: trio.Event) -> int:
    """The bundled walkthrough on `db`: 0 when the task ends in Done (see `replay` for `stop`)."""
    from onceflow.cli.demo import run_demo

    return 0 if await run_demo(db, echo=say, stop=stop, opened=say_database) == "done" else REFUSED


def _import_frozen(*modules: str) -> None:
    """Import `modules` with the cyclic garbage collector off, then freeze what the process holds: importing
    pydantic and building the template's models makes thousands of long-lived objects and almost no
    garbage, yet the collections their allocations trigger rescan them all, and so would the ones after
    (and the one at exit). Only for a process that is this command (`main()` reading `sys.argv`): frozen
    objects are never collected. Saves `onceflow validate` ~55 M instructions, 7 % of it."""
    import gc

    gc.disable()
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        gc.freeze()
        gc.enable()


def validate(paths: list[Path], *, strict: bool = False) -> int:
    """Check every file and print every problem of each (`invalid:` lines), then the lint's warnings of each
    file that loads (`warning:` lines, protocol/template/lint.py): 0 all valid, 1 some invalid (or, `strict`,
    some warned), 2 some unreadable."""
    from onceflow.protocol.template.lint import lint
    from onceflow.protocol.workflow import WorkflowError, load_workflow_text

    status = 0
    for path in paths:
        try:
            text = read_text(path)
        except OSError as exc:
            say(f"error: {_os_error(exc)}", err=True)
            status = max(status, CANNOT_RUN)
            continue
        except ValueError as exc:
            say(f"error: {exc}", err=True)
            status = max(status, CANNOT_RUN)
            continue
        try:
            workflow = load_workflow_text(text, str(path))
        except WorkflowError as exc:
            for problem in (exc, *exc.others):
                say(f"invalid: {problem}", err=True)
            status = max(status, REFUSED)
            continue
        warnings = lint(workflow)
        for warning in warnings:
            say(f"{'invalid' if strict else 'warning'}: {path}: {warning.message} [{warning.code}]", err=True)
        if strict and warnings:
            status = max(status, REFUSED)
            continue
        say(f"ok: {path}: {workflow.id} ({len(workflow.steps)} steps)")
    return status


def print_schema(args: argparse.Namespace) -> int:
    """`onceflow schema`: the protocol's JSON Schema, the template format's (`--template`), or the protocol
    reference page (`--markdown`, what docs/protocol.md holds)."""
    import json

    from onceflow.cli import reference
    from onceflow.protocol.codec import command_schema
    from onceflow.protocol.template.schema import template_schema

    if args.import_path and not args.template:
        say("error: --import-path goes with --template", err=True)
        return CANNOT_RUN
    if args.markdown:
        sys.stdout.write(reference.render())
    elif args.template:
        print(json.dumps(template_schema(import_path=args.import_path), indent=2))
    else:
        print(json.dumps(command_schema(), indent=2))
    return 0


async def until_signalled(work: Callable[[trio.Event], Awaitable[int]], signalled: list[int]) -> int:
    """Run `work(stop)` and return its status: the first SIGINT or SIGTERM sets `stop` (work finishes the
    command under way and closes the runtime), a second cancels work (the runtime still closes and releases
    the database; status 0). Signals received are appended to `signalled`. A single failure of work is
    raised as itself."""
    import signal

    import trio

    from onceflow.actors.kernel.groups import raise_single

    stop = trio.Event()
    status = 0

    async def watch(signals: AsyncIterator[int], cancel: trio.CancelScope) -> None:
        async for signum in signals:
            signalled.append(signum)
            if stop.is_set():
                cancel.cancel()
            stop.set()

    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, signals, nursery.cancel_scope)
                status = await work(stop)
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise_single(group)
    return status


def _db_path(given: Path | str | None, name: str) -> Path | str:
    """`given`, whose folder must exist (a typo must not create folders), or a fresh file in a temp dir; a
    PostgreSQL URL as given."""
    import errno
    import tempfile

    if isinstance(given, str):
        return given
    if given is None:
        return Path(tempfile.mkdtemp(prefix="onceflow-")) / name
    if not given.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"folder {given.parent} does not exist", str(given))
    return given


def _line_number(text: str) -> int:
    value = int(text)
    if value < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"{text} is not a line number (1 or more)")
    return value


def _os_error(exc: OSError) -> str:
    return f"{exc.filename}: {exc.strerror}" if exc.filename is not None and exc.strerror else str(exc)


_READ_ONLY = "(read-only; safe while it runs)"

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("onceflow.cli.main:_add_demo", "run the bundled office example end to end"),
    "run": ("onceflow.cli.main:_add_run", "replay a script of protocol commands against a workflow"),
    "validate": ("onceflow.cli.main:_add_validate", "check workflow template files"),
    "schema": ("onceflow.cli.main:_add_schema", "print the protocol's JSON Schema"),
    **{
        view: ("onceflow.cli.views:add_commands", f"show the {view} of a database {_READ_ONLY}")
        for view in ("tasks", "runs", "entries", "decisions", "outcomes", "workflows", "queue")
    },
    "history": ("onceflow.cli.history:add_command", f"show a task's history {_READ_ONLY}"),
    "prune": ("onceflow.cli.prune:add_commands", "delete resolved history older than the retention, now"),
    "test": ("onceflow.scenario.runner:add_commands", "run scenario tests of workflow templates"),
    "serve": (
        "onceflow.serve.cli:add_parser",
        "serve the protocol as JSON lines over a Unix socket or stdio, and/or over HTTP",
    ),
}
"""Every subcommand, in the order `onceflow --help` lists them: name -> (`module:function` that adds its
subparser to the subparsers, the help line that function gives it). One function may add several (the
views). The help lines are repeated here so that `onceflow --help` imports none of those modules; a test
holds them equal."""


def _version_action() -> type[argparse.Action]:
    """The action of `--version`: the installed package's version, looked up only when asked
    (importlib.metadata and the scan of the installed distributions cost more than the rest of `onceflow
    --help`). A class made on call: argparse is imported only where a parser is made."""
    import argparse

    class Version(argparse.Action):
        def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
            super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

        def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
            from importlib import metadata

            print(f"onceflow {metadata.version('onceflow')}")
            parser.exit()

    return Version


def _parser(command: str | None = None, *, every: bool = False) -> argparse.ArgumentParser:
    """The `onceflow` parser. Only `command`'s subparser is made (its module imported, its arguments added),
    or with `every` all of them; when `command` is not a subcommand (`onceflow --help`, a typo), each is
    listed by its name and help line alone, which is all the top-level help and its errors show. The usage
    names every subcommand in each case."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="onceflow",
        description="onceflow: workflow-step triggers dispatched exactly once, from the command line.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_version_action(), help="show program's version number and exit")
    parser.add_argument("--verbose", action="store_true", help="debug logs on stderr")
    parser.add_argument("--log-json", action="store_true", help="logs as one JSON object per line")
    if command in COMMANDS and not every:
        every_name = "{" + ",".join(COMMANDS) + "}"  # the usage as if each subcommand were made
        sub = parser.add_subparsers(dest="command", required=True, metavar=every_name)
        _adder(COMMANDS[command][0])(sub)
        _describe(sub)
        return parser
    sub = parser.add_subparsers(dest="command", required=True)
    added: set[str] = set()
    for name, (adder, help_line) in COMMANDS.items():
        if not every:
            sub.add_parser(name, help=help_line)
        elif adder not in added:
            added.add(adder)
            _adder(adder)(sub)
    if every:
        _describe(sub)
    return parser


def _adder(where: str) -> Callable[[_SUBPARSERS], None]:
    module, function = where.split(":")
    found: Callable[[_SUBPARSERS], None] = getattr(importlib.import_module(module), function)
    return found


def _add_demo(sub: _SUBPARSERS) -> None:
    from onceflow.store.backends.urls import database_arg

    demo = sub.add_parser("demo", help=COMMANDS["demo"][1])
    demo.add_argument(
        "--db",
        type=database_arg,
        help="SQLite file or postgresql:// URL (default: a fresh file in a temp dir)",
    )


def _add_run(sub: _SUBPARSERS) -> None:
    from onceflow.store.backends.urls import database_arg

    run = sub.add_parser("run", help=COMMANDS["run"][1])
    run.add_argument("--workflow", type=Path, required=True, help="the template to register first (YAML)")
    run.add_argument("--script", type=Path, required=True, help="JSON lines or a YAML list of commands")
    run.add_argument(
        "--db",
        type=database_arg,
        help="SQLite file or postgresql:// URL (default: a fresh file in a temp dir)",
    )
    run.add_argument("--json", action="store_true", help="print each reply as one JSON line")
    run.add_argument(
        "--from-line",
        type=_line_number,
        default=1,
        metavar="N",
        help="send only the script's commands from line N on (to resume an interrupted run)",
    )
    run.add_argument(
        "--keep-going", action="store_true", help="go on after a refused register_workflow (default: stop)"
    )


def _add_validate(sub: _SUBPARSERS) -> None:
    check = sub.add_parser("validate", help=COMMANDS["validate"][1])
    check.add_argument("files", type=Path, nargs="+", help="template YAML files")
    check.add_argument("--strict", action="store_true", help="a lint warning makes the file invalid")


def _add_schema(sub: _SUBPARSERS) -> None:
    schema = sub.add_parser("schema", help=COMMANDS["schema"][1])
    shown = schema.add_mutually_exclusive_group()
    shown.add_argument(
        "--template", action="store_true", help="the template format's JSON Schema (for an editor)"
    )
    shown.add_argument("--markdown", action="store_true", help="the protocol reference page (Markdown)")
    schema.add_argument(
        "--import-path", action="store_true", help="with --template: the import path's allow-lists"
    )


def _describe(sub: _SUBPARSERS) -> None:
    """`onceflow X --help` says what X does, in full: a subparser without a description gets its help line."""
    for action in sub._choices_actions:
        chosen = sub.choices[action.dest]
        if chosen.description is None and action.help:
            chosen.description = f"onceflow {action.dest}: {action.help}."


def _epilog() -> str:
    """The module docstring from its command synopsis on (commands, exit status), for `--help`."""
    text = __doc__ or ""
    return "commands:\n" + text.split("\n\n", 1)[1] if "\n\n" in text else text


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # outside the signal receiver (start-up, validate): nothing is left open
        import signal

        say("onceflow: interrupted by SIGINT", err=True)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # the reader went away (`onceflow runs | head -1`): as a killed-by-SIGPIPE tool
        _discard_stdout()
        return CLOSED_PIPE


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail on the closed pipe again
    (and print 'Exception ignored')."""
    with open(os.devnull, "wb") as null, contextlib.suppress(OSError, ValueError):
        os.dup2(null.fileno(), sys.stdout.fileno())


def _validate_args(argv: list[str]) -> tuple[list[Path], bool] | None:
    """The files and `--strict` of the plain `validate [--strict] FILE...` (or `--strict` last), read without
    argparse, whose import and parser cost `onceflow validate` ~11 M instructions of its start; None for
    any other command line (an option or file starting with `-`, no file, ...), which argparse reads (and
    words its errors). Where it answers, argparse reads `argv` alike (a test holds them equal)."""
    if argv[:1] != ["validate"]:
        return None
    rest = argv[1:]
    strict = "--strict" in rest[:1] + rest[-1:]
    files = rest[1:] if rest[:1] == ["--strict"] else rest[:-1] if strict else rest
    if not files or any(name.startswith("-") for name in files):
        return None
    return [Path(name) for name in files], strict


def _main(argv: list[str] | None) -> int:
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    plain = _validate_args(argv)
    if plain is not None and own_process:
        _import_frozen("onceflow.protocol.workflow", "onceflow.protocol.template.lint")
    if plain is not None:
        files, strict = plain
        return validate(files, strict=strict)
    command = next(
        (arg for arg in argv if not arg.startswith("-")), None
    )  # no top-level option takes a value
    args = _parser(command).parse_args(argv)
    if args.command == "validate":  # no runtime, so no logs
        return validate(args.files, strict=args.strict)
    if args.command == "schema":
        return print_schema(args)
    configure_logging(args.verbose, args.log_json)
    if hasattr(args, "handler"):  # the subcommands defined in their own modules
        return int(args.handler(args))
    import functools

    import trio

    from onceflow.protocol.errors import OnceflowError
    from onceflow.store.backends import faults
    from onceflow.store.backends.lock import DatabaseOwnedError

    signalled: list[int] = []
    progress = Progress()
    db: Path | str | None = args.db
    try:
        if args.command == "serve":  # handles its own signals: drains, removes the socket, exits 0
            from onceflow.serve.cli import run

            return run(args)
        db = _db_path(args.db, f"{args.command}.db")
        if args.command == "demo":
            work = functools.partial(demo, db)
        else:
            work = functools.partial(
                replay,
                args.workflow,
                args.script,
                db,
                args.json,
                keep_going=args.keep_going,
                from_line=args.from_line,
                progress=progress,
            )
        status = trio.run(until_signalled, work, signalled)
    except DatabaseOwnedError as exc:
        say(f"error: {exc}", err=True)
        return CANNOT_RUN
    except BrokenPipeError:
        raise  # stdout closed: `main` exits quietly
    except OSError as exc:
        say(f"error: {_os_error(exc)}", err=True)
        return CANNOT_RUN
    except faults.any_database_errors(
        OnceflowError
    ) as exc:  # the database cannot be used (not one, damaged, ...)
        say(f"error: {db}: {exc}", err=True)
        return CANNOT_RUN
    except ValueError as exc:  # a script or template file that cannot be read (the message names it)
        say(f"error: {exc}", err=True)
        return CANNOT_RUN
    if signalled:
        import signal

        say(_interrupted(args, signal.Signals(signalled[0]).name, db, progress), err=True)
        return 128 + signalled[0]
    return status


def _interrupted(args: argparse.Namespace, name: str, db: Path | str | None, progress: Progress) -> str:
    """The one line an interrupted `run` or `demo` prints: what was finished, that the database was
    released, and the command that resumes."""
    from onceflow.store.backends.urls import redacted

    shown = redacted(db) if isinstance(db, str) else str(db)
    if args.command == "demo":
        return (
            f"onceflow: interrupted by {name}: the runtime shut down and released {shown}; what the demo"
            f" did is there (onceflow history --db {shown} --task DEMO-1); to walk it through, run"
            " `onceflow demo` again (a fresh database)"
        )
    done = (
        f"{progress.sent} command(s) of {args.script} sent and answered,"
        f" the last on line {progress.last_line}"
        if progress.last_line is not None
        else f"no command of {args.script} was sent"
    )
    resume = (progress.last_line + 1) if progress.last_line is not None else args.from_line
    return (
        f"onceflow: interrupted by {name}: {done}; the runtime shut down and released {shown}; to resume:"
        f" onceflow run --workflow {args.workflow} --script {args.script} --db {shown} --from-line {resume}"
    )


if __name__ == "__main__":
    sys.exit(main())
