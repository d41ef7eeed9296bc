"""What every command is made of: the base models and the field types commands share (identifiers, text,
int64, page sizes). Pure: the wire, no thread.

Identifiers are non-empty strings of at most MAX_ID_CHARS characters without control characters, free text
at most MAX_TEXT_CHARS, integers int64 (`limits.py`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from onceflow.protocol.causation import Causation
from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.limits import ID_PATTERN, INT64_MAX, INT64_MIN, MAX_ID_CHARS, MAX_TEXT_CHARS
from onceflow.protocol.tracecontext import TraceContext

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
"""A required identifier."""
Name = Annotated[str, Field(max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
"""An optional identifier or short name, where empty means "none" (as `agent_profile_id: ""`)."""
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
"""Free text: a title or a comment."""
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
HISTORY_CURSOR = r"^-?[0-9][0-9.e+-]*:[0-4]:[0-9]+$"
"""A `task_history` cursor: `<time>:<rank>:<key>`, as a page's `next` gives it."""
Role = Literal["reviewer", "approver", "watcher", "collaborator", "runner"]
Priority = Literal["critical", "high", "medium", "low"]


class CommandModel(BaseModel):
    """The base of every model a command is or carries: unknown fields refused, immutable; its fields'
    docstrings are the descriptions `onceflow schema` and docs/protocol.md show."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)


class BaseCommand(CommandModel, TraceContext, Causation):
    """A command: its own fields, and the trace context (`tracecontext.py`) and causation (`causation.py`)
    every command may carry."""


Limit = Annotated[int, Field(ge=1, le=1000)]
"""How many rows one page of a `list_*` query holds at most (1..1000)."""
