"""onceflow's loggers: structured records that go where the host's logging configuration says. Any thread (the
writer logs too).

A library must not decide where its logs go. structlog left unconfigured prints to stdout, so every module
logs through `get_logger` instead of `structlog.get_logger`:

- a host that configured structlog (`structlog.configure`, as the CLI does) gets onceflow's records through
  its own structlog pipeline, exactly as before;
- otherwise each record goes to the standard `logging` logger of the same name (`onceflow.supervisor`,
  `onceflow.store.writer`, ...), its identifying fields as discrete `extra` attributes of the `LogRecord`
  (`record.task_id`, `record.path`), the event name as the message. Levels, handlers and destinations are
  the host's `logging` configuration; with none, Python's default applies (WARNING and up to stderr).

Either way onceflow never writes to stdout on its own.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

# LogRecord's own attributes: a field named like one would make `logging` raise, so it is renamed.
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _rename_reserved(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    for key in _RESERVED.intersection(event_dict):
        event_dict[f"{key}_"] = event_dict.pop(key)
    return event_dict


_PROCESSORS = [structlog.stdlib.filter_by_level, _rename_reserved, structlog.stdlib.render_to_log_kwargs]

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
