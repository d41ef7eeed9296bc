"""onceflow's loggers: structured records that go where the host's logging configuration says. Any thread (the
writer logs too).

A library must not decide where its logs go. structlog left unconfigured prints to stdout, so every module
logs through `get_logger` instead of `structlog.get_logger`:

- a host that configured structlog (`structlog.configure`, as the CLI does) gets onceflow's records through
  its own structlog pipeline, exactly as before;
- otherwise each record goes to the standard `logging` logger of the same name (`onceflow.supervisor`,
  `onceflow.store.writer`, ...). Its message is the event with its fields, `key=value` in the order given
  (`run_lost run_id=3 task_id=T-1 reason=superseded`; a value with spaces, quotes or `=` is written as a
  JSON string), so any formatter, `logging.basicConfig()`'s included, shows them. The fields are also
  discrete `extra` attributes of the `LogRecord` (`record.task_id`, `record.path`), and `record.event` is
  the bare event name. Levels, handlers and destinations are the host's `logging` configuration; with
  none, Python's default applies (WARNING and up to stderr).

`formatter(json=True)` is a `logging.Formatter` (structlog's `ProcessorFormatter`) that writes each record
as one JSON object instead (`{"event": ..., <fields>, "level", "logger", "timestamp"}`, RFC 3339 UTC):
`handler.setFormatter(onceflow.observability.logs.formatter(json=True))`. Either way onceflow never writes to
stdout on its own.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

# LogRecord's own attributes: a field named like one would make `logging` raise, so it is renamed.
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _rename_reserved(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    for key in _RESERVED.intersection(event_dict).difference(structlog.stdlib.LOG_KWARG_NAMES):
        event_dict[f"{key}_"] = event_dict.pop(key)
    return event_dict


_BARE = re.compile(r"[^\s\"'=]*")


def _shown(value: Any) -> str:
    """A field's value as `key=value` writes it: bare when it holds no space, quote or `=`, else JSON."""
    text = (
        value if isinstance(value, str) else repr(value) if not isinstance(value, int | float) else str(value)
    )
    return text if text and _BARE.fullmatch(text) else json.dumps(text)


def render_with_fields(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """The keyword arguments of a `logging` call for `event_dict`: the message is the event with its fields
    as `key=value` (module docstring), the fields and the bare `event` go into `extra`; `exc_info`,
    `stack_info` and `stacklevel` stay `logging`'s own arguments."""
    passed = {kw: event_dict.pop(kw) for kw in structlog.stdlib.LOG_KWARG_NAMES if kw in event_dict}
    event = event_dict.pop("event")
    message = " ".join([str(event), *(f"{key}={_shown(value)}" for key, value in event_dict.items())])
    return {"msg": message, "extra": {**event_dict, "event": event}, **passed}


_PROCESSORS = [structlog.stdlib.filter_by_level, _rename_reserved, render_with_fields]


def _drop_formatted(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Drop what an earlier `logging.Formatter` left on the record (`message`, `asctime`): not fields."""
    event_dict.pop("message", None)
    event_dict.pop("asctime", None)
    return event_dict


def _render_line(_: WrappedLogger, __: str, event_dict: EventDict) -> str:
    """`timestamp [level] logger event key=value ...`, then the exception's traceback if any."""
    head = [event_dict.pop(key, "-") for key in ("timestamp", "level", "logger", "event")]
    trace = event_dict.pop("exception", None)
    line = " ".join([head[0], f"[{head[1]}]", *map(str, head[2:])])
    line = " ".join([line, *(f"{key}={_shown(value)}" for key, value in event_dict.items())])
    return f"{line}\n{trace}" if trace else line


def formatter(*, json: bool = False) -> logging.Formatter:
    """A `logging.Formatter` for a host's handler that writes onceflow's records (and any other's) with
    their fields: one JSON object per record when `json`, else `timestamp [level] logger event key=value`
    (one line, a traceback after it).

    Built on structlog's `ProcessorFormatter`: a record's `extra` attributes become the object's keys, the
    bare event name its `event` (a record from another library: its message), plus `level`, `logger` and
    `timestamp` (RFC 3339 UTC). Exceptions are rendered into `exception`.
    """
    pre_chain: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        _drop_formatted,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = structlog.processors.JSONRenderer() if json else _render_line
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )


_FILTERING = {
    structlog.make_filtering_bound_logger(level): level
    for level in (logging.NOTSET, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.FATAL)
}
"""structlog's filtering bound logger classes (one per level, made once by structlog) -> the level below
which each drops a record."""


class Logger:
    """A logger for one onceflow module: `log.error("event_name", task_id=..., cause=...)`.

    Each call goes to structlog when the host configured it, else to stdlib `logging` (module docstring).
    Never raises for a field's name; a field named like a LogRecord attribute gets a trailing `_`.
    """

    __slots__ = ("_logging", "_stdlib", "_structlog", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._logging = logging.getLogger(name)
        self._stdlib = structlog.stdlib.BoundLogger(self._logging, _PROCESSORS, {})
        self._structlog = structlog.get_logger(name)

    def _target(self, level: int) -> Any:
        """Where a record at `level` goes; None when stdlib `logging` would drop it anyway (the level test
        `filter_by_level`, the first of `_PROCESSORS`, and then `logging` itself make), made before the
        record is built. For structlog, the bound logger its lazy proxy's `__getattr__` would bind, without
        the failed attribute lookup first, and None as well when the configured wrapper class is one of
        structlog's filtering loggers that drops `level` (no logger is bound for a record it would drop). A
        filtered-out diagnostic then costs ~5k instructions, not ~20k (~35k when structlog binds one)."""
        if structlog.is_configured():
            floor = _FILTERING.get(structlog.get_config()["wrapper_class"])
            return None if floor is not None and level < floor else self._structlog.bind()
        return self._stdlib if self._logging.isEnabledFor(level) else None

    def debug(self, event: str, **fields: Any) -> None:
        if (target := self._target(logging.DEBUG)) is not None:
            target.debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        if (target := self._target(logging.INFO)) is not None:
            target.info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        if (target := self._target(logging.WARNING)) is not None:
            target.warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        if (target := self._target(logging.ERROR)) is not None:
            target.error(event, **fields)


def get_logger(name: str) -> Logger:
    """The logger for module `name` (use `"onceflow.<module>"` or `__name__`)."""
    return Logger(name)
