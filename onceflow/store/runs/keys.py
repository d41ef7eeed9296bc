"""The run idempotency-key format: its one owner (builders, the SQL that builds the same keys, the parser,
and the config digest in them). Pure: runs on either thread.

Two shapes (on-enter-action-dispatch.md AC-B1, AC-H6, AC-H7; kandev-engine-notes.md "Runs queue"):

- an on_enter run: `on_enter:<task>:<step>:<entry_seq>:<position>:<agent>:<digest>`, scoped to one step
  entry, so a re-entry (a new entry_seq) queues anew and a redelivered entry never does;
- a run queued by an operation-bearing trigger: `<operation_id>:<step>:<task>:<agent>:<digest>`.

`<digest>` is `config_digest` of the action's config. Ids may contain any character but control
characters, so every id component is percent-encoded (`%` as `%25`, then `:` as `%3A`): an id without
either character is written as it is, so keys of ordinary ids are byte for byte what they always were, and
every key parses back into its parts. The operation id comes first in its shape and is written as it is
(it holds colons of its own); the parser takes it as what precedes the last four fields. The SQL builders
produce the same bytes inside a statement (both backends have `LIKE ... ESCAPE`, `replace` and `||`).

How a key is stored (`runs`): an on_enter key is not stored as text but by its parts, which the run's own
columns already hold but two: task_id, workflow_step_id, entry_seq, agent_profile_id, and `key_position`,
`key_digest`; a unique index over (task_id, workflow_step_id, entry_seq, key_position, agent_profile_id)
keeps one run per agent, position and entry (AC-B1, AC-B4). Every other key is `idempotency_key`'s text.
`stored_columns` chooses, `STORED_KEY_SQL` reads either back as the key's bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

import attrs

ON_ENTER = "on_enter"
"""The first field of every on_enter key (no operation id is `on_enter:...`)."""

ON_ENTER_RANGE = ("on_enter:", "on_enter;")
"""Every on_enter key sorts in [low, high): an index range that finds them all."""

_DECODE = re.compile("%(25|3A)")


def encode(component: str) -> str:
    """An id as it stands in a key: `%` → `%25`, then `:` → `%3A` (an id with neither is unchanged)."""
    if "%" not in component and ":" not in component:
        return component
    return component.replace("%", "%25").replace(":", "%3A")


def decode(field: str) -> str:
    """The id an encoded field stands for (`encode`'s inverse)."""
    return _DECODE.sub(lambda m: "%" if m.group(1) == "25" else ":", field)


def encoded_sql(expression: str) -> str:
    """SQL for `encode(expression)`: an id with neither character is taken as it is, without the two
    `replace` calls (each copies the string)."""
    return (
        f"CASE WHEN {expression} LIKE '%!%%' ESCAPE '!' OR {expression} LIKE '%:%'"
        f" THEN replace(replace({expression}, '%', '%25'), ':', '%3A') ELSE {expression} END"
    )


def config_digest(config: dict[str, Any]) -> str:
    """16 hex of a SHA-256 over the canonical JSON (sorted keys) of an action's config (AC-H7)."""
    try:  # a config without a payload recurs on every entry of its step: hash it once
        return _cached_digest(tuple(sorted(config.items())))
    except TypeError:  # an unhashable value (a payload mapping)
        return _digest(config)


@functools.lru_cache(maxsize=1024)
def _cached_digest(items: tuple[tuple[str, Any], ...]) -> str:
    return _digest(dict(items))


def _digest(config: dict[str, Any]) -> str:
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# --- on_enter keys ---------------------------------------------------------------------------------------


def entry_prefix(task_id: str, step_id: str, entry_seq: int) -> str:
    """`on_enter:<task>:<step>:<entry_seq>:`: what every run key of one step entry starts with."""
    return f"on_enter:{encode(task_id)}:{encode(step_id)}:{entry_seq}:"


def entry_suffix(position: int, agent_profile_id: str, digest: str) -> str:
    """`<position>:<agent>:<digest>`: what follows `entry_prefix` for one run."""
    return f"{position}:{encode(agent_profile_id)}:{digest}"


def entry_key(
    task_id: str, step_id: str, entry_seq: int, position: int, agent_profile_id: str, digest: str
) -> str:
    """The idempotency key of the on_enter run of `agent_profile_id` at `position` of one step entry."""
    return entry_prefix(task_id, step_id, entry_seq) + entry_suffix(position, agent_profile_id, digest)


def entry_prefix_sql(task_sql: str, step_sql: str, seq_sql: str) -> str:
    """SQL for `entry_prefix` of three SQL expressions (the entry_seq an integer)."""
    return (
        f"'on_enter:' || {encoded_sql(task_sql)} || ':' || {encoded_sql(step_sql)} || ':' || {seq_sql} || ':'"
    )


def entry_suffix_sql(position_sql: str, agent_sql: str, digest_sql: str) -> str:
    """SQL for `entry_suffix` of three SQL expressions (the position an integer or its text)."""
    return f"{position_sql} || ':' || {encoded_sql(agent_sql)} || ':' || {digest_sql}"


def suffix_around(position: int, digest: str) -> tuple[str, str]:
    """What `entry_suffix` puts before and after the encoded agent: `<position>:` and `:<digest>`, for a
    statement that builds many runs' keys of one plan (`suffix_around_sql`)."""
    return f"{position}:", f":{digest}"


def suffix_around_sql(head_sql: str, agent_sql: str, tail_sql: str) -> str:
    """SQL for `entry_suffix` from `suffix_around`'s two parts (SQL expressions) and the agent's."""
    return f"{head_sql} || {encoded_sql(agent_sql)} || {tail_sql}"


def position_in(key: str, prefix: str) -> int:
    """The position field of an on_enter `key` that starts with `prefix` (an `entry_prefix`)."""
    return int(key[len(prefix) : key.index(":", len(prefix))])


def stored_columns(
    key: str, task_id: str | None, step_id: str | None, entry_seq: int | None, agent_profile_id: str
) -> tuple[int, str] | None:
    """(key_position, key_digest) when `key` is the on_enter key of a run with these columns, which then
    stores it by its parts (`STORED_KEY_SQL` gives back its bytes); None: the key is stored as its text."""
    parts = entry_parts(key)
    if parts is None or (parts.task_id, parts.step_id, parts.entry_seq, parts.agent_profile_id) != (
        task_id,
        step_id,
        entry_seq,
        agent_profile_id,
    ):
        return None
    rebuilt = entry_key(
        parts.task_id, parts.step_id, parts.entry_seq, parts.position, agent_profile_id, parts.digest
    )
    if rebuilt != key:
        return None  # not byte for byte what the parts give back (a leading zero, say): keep the text
    return parts.position, parts.digest


def entry_parts(key: str) -> EntryRunKey | None:
    """The parts of `key` when it is an on_enter key (`parse`), else None."""
    if not key.startswith("on_enter:"):
        return None
    try:
        parts = parse(key)
    except ValueError:
        return None
    return parts if isinstance(parts, EntryRunKey) else None


def stored_key_sql(alias: str = "") -> str:
    """SQL for the idempotency key of a `runs` row (`alias` its table's, with the dot): its text, or the
    on_enter key its parts give (NULL when it has neither)."""
    a = alias
    prefix = entry_prefix_sql(f"{a}task_id", f"{a}workflow_step_id", f"{a}entry_seq")
    digest = f"(SELECT dg.digest FROM digests AS dg WHERE dg.id = {a}key_digest)"  # store/runs/digests.py
    suffix = entry_suffix_sql(f"{a}key_position", f"{a}agent_profile_id", digest)
    return f"COALESCE({a}idempotency_key, {prefix} || {suffix})"


STORED_KEY_SQL = stored_key_sql()
"""`stored_key_sql` of an unaliased `runs`."""

ENTRY_KEY_COLUMNS = "task_id, workflow_step_id, entry_seq, key_position, agent_profile_id"
"""The unique index `runs_by_entry_key` over an on_enter key's parts (a conflict target)."""


# --- operation keys ---------------------------------------------------------------------------------------


def operation_key(operation_id: str, step_id: str, task_id: str, agent_profile_id: str, digest: str) -> str:
    """The idempotency key of a run an operation-bearing trigger queues for `agent_profile_id`."""
    return f"{operation_id}:{encode(step_id)}:{encode(task_id)}:{encode(agent_profile_id)}:{digest}"


def escalation_key(run_id: int) -> str:
    """The idempotency key of the `agent_error` run a failed run `run_id` queues for a CEO agent: one per
    failed run, so a replayed failure never escalates twice."""
    return f"escalation:{run_id}"


# --- scopes: what an executor's context builds its keys from -------------------------------------------


@attrs.frozen
class EntryScope:
    """The keys of the runs one on_enter position of one step entry queues."""

    task_id: str
    step_id: str
    entry_seq: int
    position: int

    def key(self, agent_profile_id: str, digest: str) -> str:
        """`entry_key` of this position for one agent."""
        return entry_key(self.task_id, self.step_id, self.entry_seq, self.position, agent_profile_id, digest)


@attrs.frozen
class OperationScope:
    """The keys of the runs an operation-bearing trigger queues at one step of one task."""

    operation_id: str
    step_id: str
    task_id: str

    def key(self, agent_profile_id: str, digest: str) -> str:
        """`operation_key` of this trigger delivery for one agent."""
        return operation_key(self.operation_id, self.step_id, self.task_id, agent_profile_id, digest)


# --- parsing ----------------------------------------------------------------------------------------------


@attrs.frozen
class EntryRunKey:
    """A parsed on_enter run key."""

    task_id: str
    step_id: str
    entry_seq: int
    position: int
    agent_profile_id: str
    digest: str


@attrs.frozen
class OperationRunKey:
    """A parsed run key of an operation-bearing trigger."""

    operation_id: str
    step_id: str
    task_id: str
    agent_profile_id: str
    digest: str


def parse(key: str) -> EntryRunKey | OperationRunKey:
    """The parts of a run key this module built.

    Raises:
        ValueError: `key` is not one (too few fields, or an on_enter key whose entry_seq or position is not
            a decimal integer).
    """
    fields = key.split(":")
    if fields[0] == ON_ENTER:
        if len(fields) != 7 or not (fields[3].isdecimal() and fields[4].isdecimal()):
            raise ValueError(f"not an on_enter run key: {key!r}")
        _, task, step, seq, position, agent, digest = fields
        return EntryRunKey(decode(task), decode(step), int(seq), int(position), decode(agent), digest)
    if len(fields) < 5 or not fields[0]:
        raise ValueError(f"not a run key: {key!r}")
    step, task, agent, digest = fields[-4:]
    return OperationRunKey(":".join(fields[:-4]), decode(step), decode(task), decode(agent), digest)
