"""Exception groups at the edges: a single cause surfaces as itself. Pure.

Trio's nurseries wrap whatever ends them in an ExceptionGroup (strict exception groups), so one failure
inside the runtime's two nurseries reached the host as a group nested two deep, a 40-line traceback around
one line of cause. The public edges (`open_runtime`, the command line) unwrap a group
holding exactly one exception; a group of several stays a group, so no cause is ever dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NoReturn


def raise_single(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise the one non-group exception nested anywhere in `group`, as itself; or `group` when it holds
    more than one. The exception keeps its own `__context__` (raised while its group is being handled, it
    would otherwise chain the group onto itself and print it first)."""
    leaves = list(itertools.islice(_leaves(group), 2))
    if len(leaves) != 1:
        raise group
    (leaf,) = leaves
    context = leaf.__context__
    try:
        raise leaf
    finally:
        leaf.__context__ = context


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
