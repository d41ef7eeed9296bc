"""Where a template's problem is and how it reads: a location inside the document and one message. Pure.

Validators of the template models raise `Located` to name a location below the value pydantic reports;
`problem` turns one pydantic error into (location, message), keeping those messages verbatim and naming the
closest accepted key for an unknown one. The loader (`workflow_validate.py`) builds `WorkflowError`s from
them.
"""

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from onceflow.protocol.errors import shown
from onceflow.protocol.suggest import did_you_mean, keys_at

Loc = tuple[int | str, ...]
"""A location in the template document: keys and list indexes from its root."""


class Located(ValueError):
    """Raised inside validators: `loc` extends pydantic's location of the failing value."""

    def __init__(self, loc: Loc, message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def problem(error: ErrorDetails, model: type[BaseModel]) -> tuple[Loc, str]:
    """The location and message of one validation error of `model` (our own `Located` messages kept
    verbatim; an unknown key names the closest key accepted there)."""
    loc: Loc = tuple(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, Located):
        return (*loc, *cause.loc), cause.message
    if error["type"] == "extra_forbidden":
        return loc, f"unknown key {loc[-1]!r}{did_you_mean(loc[-1], keys_at(model, loc[:-1]))}"
    if error["type"] == "missing":
        return loc, "required key is missing"
    if error["type"] == "tuple_type":
        return loc, f"expected a list (got {shown(error['input'])})"
    return loc, f"{error['msg']} (got {shown(error['input'])})"
