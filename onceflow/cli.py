"""The `onceflow` command: demo, run, validate, schema.

  onceflow demo [--db PATH]                                   the bundled walkthrough
  onceflow run --workflow FILE --script FILE [--db PATH] [--json]
                                                              replay protocol commands, print the events
  onceflow validate FILE...                                   check workflow templates
  onceflow schema                                             JSON Schema of commands, events, reply

Exit status: 0 on success; 1 when a template is invalid or a replayed command was refused; 2 on usage
errors (argparse). Logs go to stderr (WARNING and up unless --verbose).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import structlog
import trio
import yaml

from onceflow import serve
from onceflow.actors.supervisor import open_runtime
from onceflow.demo import run_demo
from onceflow.protocol.codec import command_schema, encode
from onceflow.protocol.workflow import WorkflowError, load_workflow_file
from onceflow.store.lock import DatabaseOwnedError
from onceflow.trace import describe


def configure_logging(verbose: bool) -> None:
    """Structured logs to stderr; identifying fields stay discrete keys."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG if verbose else logging.WARNING),
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),  # the stderr of each call
        cache_logger_on_first_use=False,
    )


def load_script(path: Path) -> list[Any]:
    """Commands from a script: JSON lines (`.jsonl`/`.json`; `#` starts a comment line), or a YAML list.

    Raises:
        OSError: the file cannot be read. ValueError: a line is not JSON, or the YAML is not a list
        (the message names the file and line).
    """
    text = path.read_text()
    if path.suffix not in (".jsonl", ".json"):
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, list):
            raise ValueError(f"{path}: a YAML script must be a list of commands")
        return loaded
    commands = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            commands.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    return commands


async def replay(workflow: Path, script: Path, db: Path, as_json: bool) -> int:
    """Register `workflow`, send every command of `script`, print each reply and its events."""
    commands = load_script(script)
    refused = 0
    async with open_runtime(db) as runtime:
        register = {"type": "register_workflow", "yaml": workflow.read_text(), "source": str(workflow)}
        for command in [register, *commands]:
            reply = await runtime.send(command)
            refused += not reply.ok
            if as_json:
                print(encode(reply))
                continue
            kind = command.get("type", "?") if isinstance(command, dict) else "?"
            status = "ok" if reply.ok else f"refused: {reply.error.code if reply.error else ''}"
            if reply.ok and isinstance(reply.result, dict) and reply.result.get("idempotent"):
                status = "ok, idempotent: already applied, nothing ran"
            print(f"> {kind} [{status}]" + (f" {reply.error.message}" if reply.error else ""))
            for event in reply.events:
                print(f"    {describe(event)}")
            if reply.ok and kind.startswith(("get_", "list_", "claim_")):
                print(f"    result: {json.dumps(reply.result)}")
    return 1 if refused else 0


def validate(paths: list[Path]) -> int:
    status = 0
    for path in paths:
        try:
            workflow = load_workflow_file(path)
        except (WorkflowError, OSError) as exc:
            print(f"invalid: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"ok: {path}: {workflow.id} ({len(workflow.steps)} steps)")
    return status


def _fresh_db(given: Path | None, name: str) -> Path:
    if given is not None:
        return given
    return Path(tempfile.mkdtemp(prefix="onceflow-")) / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="onceflow", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--verbose", action="store_true", help="debug logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the bundled office example end to end")
    demo.add_argument("--db", type=Path, help="SQLite file (default: a fresh file in a temp dir)")
    run = sub.add_parser("run", help="replay a script of protocol commands against a workflow")
    run.add_argument("--workflow", type=Path, required=True)
    run.add_argument("--script", type=Path, required=True, help="JSON lines or a YAML list of commands")
    run.add_argument("--db", type=Path, help="SQLite file (default: a fresh file in a temp dir)")
    run.add_argument("--json", action="store_true", help="print each reply as one JSON line")
    check = sub.add_parser("validate", help="check workflow template files")
    check.add_argument("files", type=Path, nargs="+")
    sub.add_parser("schema", help="print the protocol's JSON Schema")
    serve.add_parser(sub)
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        if args.command == "demo":
            final = trio.run(run_demo, _fresh_db(args.db, "demo.db"))
            return 0 if final == "done" else 1
        if args.command == "run":
            return trio.run(replay, args.workflow, args.script, _fresh_db(args.db, "run.db"), args.json)
        if args.command == "serve":
            return serve.run(args)
        if args.command == "validate":
            return validate(args.files)
        print(json.dumps(command_schema(), indent=2))
        return 0
    except (DatabaseOwnedError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
