"""Durable step-entry records and their per-action markers (on-enter-action-dispatch.md, Execution model).
Writer thread: every function runs inside the caller's transaction.

An entry is identified by (task_id, step_id, entry_seq). It is allocated in the transaction that admits the
task, so replay (no step change, no allocation) and re-entry (a fresh entry_seq) are told apart by committed
state. A marker per (position, kind) moves absent → in_progress(epoch) → done | skipped | failed by
compare-and-set (`decide_claim` is the one rule): an in_progress marker of our own epoch belongs to a live
peer dispatcher, one of another epoch is stale (its runtime is gone) and may be re-claimed — unless, on
PostgreSQL, that epoch's runtime is still live.

Markers born done in the transaction that creates their entry (the common entry,
store/entries/common_entry.py, which writes its entry terminal) are kept on the entry row instead of as rows:
`step_entries.done_markers`, one kind code and position per marker (`DONE_CODES`, e.g. `c0f1`), each done,
with no epoch, an empty detail and the entry's `created_at` as its time. They are never claimed (no
dispatcher ever sees them absent or in progress), so the compare-and-set of every claim stays the one on the
marker rows; a reader takes both, a row over a code for the same position.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from onceflow.protocol.results import MarkerInfo, StepEntryInfo
from onceflow.protocol.workflow import ENGINE_ACTION_TYPES, Step
from onceflow.store.backends import epochs
from onceflow.store.backends.connection import Connection
from onceflow.store.records import Marker, StepEntry
from onceflow.store.runs import digests

TERMINAL_STATES = frozenset({"done", "skipped", "failed"})
ClaimOutcome = Literal["claimed", "terminal", "live_peer"]


@attrs.frozen
class EntryKey:
    task_id: str
    step_id: str
    entry_seq: int


def declaration_digest(kinds: Sequence[str]) -> str:
    """Digest of the ordered (position, kind) pairs of a whole on_enter list (64 hex chars).

    Covers kinds and order only, never action config (Execution model, "Marker keying").
    """
    return _digest(tuple(kinds))


@functools.lru_cache(maxsize=1024)  # a handful of distinct declarations, hashed on every dispatch
def _digest(kinds: tuple[str, ...]) -> str:
    pairs = [[position, kind] for position, kind in enumerate(kinds)]
    return hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()


DONE_CODES = {
    "clear_decisions": "c",
    "queue_run_for_each_participant": "f",
    "queue_run": "q",
    "run_code_review": "r",
    "ensure_participant_seat": "s",
}
"""The one-letter code of each engine-owned kind in `step_entries.done_markers`; a letter is never reused
(migration 23 wrote these)."""
_KINDS = {code: kind for kind, code in DONE_CODES.items()}
_DONE = re.compile(r"([a-z])(\d+)")


def done_markers(pairs: Sequence[tuple[int, str]]) -> str:
    """`step_entries.done_markers` for done markers at these (position, kind) pairs.

    Raises:
        KeyError: a kind that is not engine-owned (no code).
    """
    return "".join(f"{DONE_CODES[kind]}{position}" for position, kind in pairs)


def done_of(stored: str | None) -> dict[int, Marker]:
    """The done markers a `done_markers` value (None: none) holds, by position."""
    if not stored:
        return {}
    return {
        int(position): Marker(int(position), _KINDS[code], "done", None, "")
        for code, position in _DONE.findall(stored)
    }


def _entry(row: tuple[Any, ...]) -> StepEntry:
    return StepEntry(
        task_id=row[0],
        step_id=row[1],
        entry_seq=row[2],
        workflow_id=row[3],
        declaration_digest=row[4],
        entry_path=row[5],
        terminal=bool(row[6]),
    )


_ENTRY_NAMES = [
    "task_id",
    "step_id",
    "entry_seq",
    "workflow_id",
    "declaration_digest",
    "entry_path",
    "terminal",
]
DIGEST_SQL = "(SELECT dg.digest FROM digests AS dg WHERE dg.id = {entry}declaration_digest)"
"""SQL for an entry's declaration digest (`entry` its table's alias, with the dot): the column holds the id
of its row in `digests` (store/runs/digests.py, migration 23), one row per digest."""
_ENTRY_COLUMNS = ", ".join(_ENTRY_NAMES).replace("declaration_digest", DIGEST_SQL.format(entry=""))


def allocate_entry(
    conn: Connection,
    *,
    task_id: str,
    step_id: str,
    workflow_id: str,
    digest: str,
    entry_path: str,
    now: float,
) -> EntryKey:
    """Allocate the next entry for (task, step) inside the admitting transaction.

    Monotonicity is enforced by the UNIQUE (task_id, step_id, entry_seq) constraint: a racing allocator
    fails with sqlite3.IntegrityError and its whole transition rolls back (AC-B7).
    """
    (seq,) = conn.execute(
        "SELECT COALESCE(MAX(entry_seq), 0) + 1 FROM step_entries WHERE task_id = ? AND step_id = ?",
        (task_id, step_id),
    ).fetchone()
    digests.keep(conn, (digest,))
    conn.execute(
        f"INSERT INTO step_entries ({', '.join(_ENTRY_NAMES)}, created_at)"
        f" VALUES (?, ?, ?, ?, {digests.id_sql('?')}, ?, 0, ?)",
        (task_id, step_id, seq, workflow_id, digest, entry_path, now),
    )
    return EntryKey(task_id, step_id, int(seq))


def allocate_for(
    conn: Connection, *, task_id: str, workflow_id: str, step: Step, path: str, now: float
) -> EntryKey | None:
    """Allocate the step-entry record of an admission to `step` if its on_enter declares an engine-owned
    action (AC-E5), else None. The declaration is the caller's resolved `Step`, read once (Allocation
    inputs): nothing here parses YAML."""
    declaration = step.events.on_enter
    if not any(action.type in ENGINE_ACTION_TYPES for action in declaration):
        return None
    return allocate_entry(
        conn,
        task_id=task_id,
        step_id=step.id,
        workflow_id=workflow_id,
        digest=declaration_digest([action.type for action in declaration]),
        entry_path=path,
        now=now,
    )


def get_entry(conn: Connection, key: EntryKey) -> StepEntry | None:
    row = conn.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM step_entries WHERE task_id = ? AND step_id = ? AND entry_seq = ?",
        (key.task_id, key.step_id, key.entry_seq),
    ).fetchone()
    return _entry(row) if row else None


def entries_for_task(conn: Connection, task_id: str) -> list[StepEntry]:
    rows = conn.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM step_entries WHERE task_id = ? ORDER BY step_id, entry_seq", (task_id,)
    ).fetchall()
    return [_entry(row) for row in rows]


@attrs.frozen
class UndecodableEntry:
    """An open entry row whose stored values are not what this code writes (text that is not UTF-8, a number
    where text belongs, a non-integer entry_seq). `rowid` identifies the row; `task_id`, `step_id` and
    `entry_seq` are its values as far as they can be shown (invalid UTF-8 backslash-escaped); `cause` says
    what failed to decode."""

    rowid: int
    task_id: str
    step_id: str
    entry_seq: str
    cause: str


def open_entries(conn: Connection) -> list[tuple[StepEntry, int] | UndecodableEntry]:
    """Every non-terminal entry with the greatest entry_seq of its (task, step) over ALL its entries,
    open or not, in (task_id, step_id, entry_seq) order: one indexed query (AC-B9, AC-B9(a2)).

    Rows are decoded one by one, so a row that cannot be decoded is returned as an `UndecodableEntry` in its
    place and never fails the others (AC-B9(f); otherwise one corrupt row would stop the scan at every start).
    """
    factory = conn.text_factory
    conn.text_factory = bytes  # decoded below, per row: SQLite's own decoding fails the whole fetch
    try:
        rows = conn.execute(
            f"SELECT rowid, {_ENTRY_COLUMNS}, (SELECT MAX(entry_seq) FROM step_entries AS later"
            " WHERE later.task_id = open.task_id AND later.step_id = open.step_id),"
            " COALESCE((SELECT workflow_version FROM tasks WHERE tasks.id = open.task_id), 1)"
            " FROM step_entries AS open WHERE terminal = 0 ORDER BY task_id, step_id, entry_seq"
        ).fetchall()
    finally:
        conn.text_factory = factory
    return [_open_entry(row) for row in rows]


def _open_entry(row: tuple[Any, ...]) -> tuple[StepEntry, int] | UndecodableEntry:
    rowid, task_id, step_id, entry_seq, workflow_id, digest, entry_path, terminal, latest, version = row
    if type(entry_seq) is int and type(terminal) is int and type(latest) is int:
        try:  # the common case, inline: ~10k entries per start are decoded here (bench/recovery.py)
            entry = StepEntry(
                task_id.decode(),
                step_id.decode(),
                entry_seq,
                workflow_id.decode(),
                digest.decode(),
                entry_path.decode(),
                bool(terminal),
                int(version),
            )
        except (AttributeError, UnicodeDecodeError):  # not text (no .decode), or not UTF-8
            pass
        else:
            return entry, latest
    return _undecodable(rowid, row[1:-2], latest)


def _undecodable(rowid: int, values: tuple[Any, ...], latest: object) -> UndecodableEntry:
    """The row as far as it can be shown, with the first reason it cannot be decoded."""
    try:
        for name, value in zip(_ENTRY_NAMES, values, strict=True):
            _check_stored(name, value)
        cause = f"the greatest entry_seq of its task and step is {latest!r:.80}, not an integer"
    except ValueError as exc:
        cause = str(exc)
    task_id, step_id, entry_seq = (_shown(value) for value in values[:3])
    return UndecodableEntry(rowid, task_id, step_id, entry_seq, cause)


def _check_stored(column: str, value: object) -> None:
    """Raise ValueError unless a stored value is as this code writes it: an integer for entry_seq and
    terminal, UTF-8 text otherwise."""
    if column in ("entry_seq", "terminal"):
        if type(value) is not int:
            raise ValueError(f"column {column} holds {value!r:.80}, not an integer")
        return
    if not isinstance(value, bytes):
        raise ValueError(f"column {column} holds {value!r:.80}, not text")
    try:
        value.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"column {column} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def _shown(value: object) -> str:
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else repr(value)


def markers(conn: Connection, key: EntryKey) -> dict[int, Marker]:
    """The entry's markers by position (absent positions are missing from the map)."""
    rows = conn.execute(_MARKERS, (key.task_id, key.step_id, key.entry_seq)).fetchall()
    found: dict[int, Marker] = {}
    for row in rows:
        if row[0] is None:  # the entry's own done markers: a row for the same position wins
            found = done_of(row[1]) | found
        else:
            found[row[0]] = Marker(row[0], row[1], row[2], row[3], row[4])
    return found


_MARKERS = (
    "SELECT position, kind, state, epoch, detail FROM step_entry_markers"
    " WHERE task_id = ?1 AND step_id = ?2 AND entry_seq = ?3"
    " UNION ALL SELECT NULL, done_markers, NULL, NULL, NULL FROM step_entries"
    " WHERE task_id = ?1 AND step_id = ?2 AND entry_seq = ?3 AND done_markers IS NOT NULL"
)
"""An entry's marker rows, then (position NULL) its `done_markers` when it has them: one statement."""


def decide_claim(conn: Connection, marker: Marker | None, epoch: str) -> ClaimOutcome:
    """The compare-and-set decision for a position whose current marker is `marker` (None: absent), asked
    by a runtime of `epoch` inside the claiming transaction.

    "claimed": absent, or in_progress under another epoch that is dead (`epochs.is_live`: always on SQLite,
    where the file's owner is the only runtime); "terminal": done, skipped or failed; "live_peer": in_progress
    under `epoch` (another dispatcher of this runtime holds it) or under a live runtime's epoch.
    """
    if marker is None:
        return "claimed"
    if marker.state in TERMINAL_STATES:
        return "terminal"
    if marker.epoch == epoch or (marker.epoch is not None and epochs.is_live(conn, marker.epoch)):
        return "live_peer"
    return "claimed"


def claim_marker(
    conn: Connection, key: EntryKey, position: int, kind: str, epoch: str, now: float
) -> ClaimOutcome:
    """Compare-and-set absent (or stale in_progress) → in_progress(epoch), as a durable claim.

    Returns `decide_claim`'s outcome: "claimed" for the winner, "terminal" when the action already reached
    a terminal state, "live_peer" when a live dispatcher holds it (the caller must abandon the entry).
    For an action applied and finished in one transaction no durable claim is needed: decide with
    `decide_claim` on the markers read in that transaction.
    """
    found = conn.execute(_CLAIMED, (key.task_id, key.step_id, key.entry_seq, position, kind)).fetchall()
    row = next((r for r in found if r[0] is not None), None)
    marker = None if row is None else Marker(position, kind, row[0], row[1], "")
    if marker is None and found:  # a done marker kept on the entry row
        born = done_of(found[0][2]).get(position)
        marker = born if born is not None and born.kind == kind else None
    outcome = decide_claim(conn, marker, epoch)
    if outcome != "claimed":
        return outcome
    if row is None:
        conn.execute(
            "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch,"
            " updated_at) VALUES (?, ?, ?, ?, ?, 'in_progress', ?, ?)",
            (key.task_id, key.step_id, key.entry_seq, position, kind, epoch, now),
        )
        return "claimed"
    holder = row[1]
    cur = conn.execute(
        "UPDATE step_entry_markers SET epoch = ?, updated_at = ? WHERE task_id = ? AND step_id = ?"
        " AND entry_seq = ? AND position = ? AND kind = ? AND state = 'in_progress' AND epoch = ?",
        (epoch, now, key.task_id, key.step_id, key.entry_seq, position, kind, holder),
    )
    return "claimed" if cur.rowcount == 1 else "live_peer"


_CLAIMED = (
    "SELECT state, epoch, NULL FROM step_entry_markers"
    " WHERE task_id = ?1 AND step_id = ?2 AND entry_seq = ?3 AND position = ?4 AND kind = ?5"
    " UNION ALL SELECT NULL, NULL, done_markers FROM step_entries"
    " WHERE task_id = ?1 AND step_id = ?2 AND entry_seq = ?3 AND done_markers IS NOT NULL"
)
"""A position's marker row (state, epoch) and the entry's `done_markers` (third column) when it has them."""


def finish_marker(
    conn: Connection,
    key: EntryKey,
    position: int,
    kind: str,
    state: Literal["done", "skipped", "failed"],
    detail: str,
    now: float,
) -> None:
    """Write a terminal state for a position (from absent or in_progress); the epoch is cleared."""
    conn.execute(
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch, detail,"
        " updated_at) VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?)"
        " ON CONFLICT (task_id, step_id, entry_seq, position, kind)"
        " DO UPDATE SET state = excluded.state, epoch = NULL, detail = excluded.detail,"
        " updated_at = excluded.updated_at",
        (key.task_id, key.step_id, key.entry_seq, position, kind, state, detail, now),
    )


def skip_claimed_markers(conn: Connection, key: EntryKey, reason: str, now: float) -> None:
    """Close every in_progress marker of the entry as skipped(reason) (an entry closed without dispatch)."""
    conn.execute(
        "UPDATE step_entry_markers SET state = 'skipped', epoch = NULL, detail = ?, updated_at = ?"
        " WHERE task_id = ? AND step_id = ? AND entry_seq = ? AND state = 'in_progress'",
        (reason, now, key.task_id, key.step_id, key.entry_seq),
    )


def mark_terminal(conn: Connection, key: EntryKey) -> None:
    conn.execute(
        "UPDATE step_entries SET terminal = 1 WHERE task_id = ? AND step_id = ? AND entry_seq = ?",
        (key.task_id, key.step_id, key.entry_seq),
    )


def entry_info(entry: StepEntry, entry_markers: dict[int, Marker]) -> StepEntryInfo:
    """An entry and its markers, by position, as replies show them."""
    return StepEntryInfo(
        task_id=entry.task_id,
        step_id=entry.step_id,
        entry_seq=entry.entry_seq,
        workflow_id=entry.workflow_id,
        declaration_digest=entry.declaration_digest,
        entry_path=entry.entry_path,
        terminal=entry.terminal,
        markers=[
            MarkerInfo(position=m.position, kind=m.kind, state=m.state, epoch=m.epoch, detail=m.detail)
            for m in (entry_markers[p] for p in sorted(entry_markers))
        ],
    )


EntryCursor = tuple[str, str, int]
"""An entry's key (task_id, step_id, entry_seq): where a page of entries ends and the next begins."""


def entries_page(
    conn: Connection, *, task_id: str | None, after: EntryCursor | None, limit: int
) -> tuple[list[StepEntryInfo], bool]:
    """Up to `limit` entries (of one task, or all) after the key `after` (exclusive; None: from the first), in
    (task, step, entry_seq) order, each with its markers (`entry_info`), and whether more follow (a page of
    `list_step_entries`). Two statements per page, over the entries' unique key: a page costs the same
    however deep it is."""
    key, args = "(task_id, step_id, entry_seq) > (?, ?, ?)", list(after or ("", "", -1))
    scope, scope_args = (" AND task_id = ?", [task_id]) if task_id is not None else ("", [])
    rows = conn.execute(
        f"SELECT {_ENTRY_COLUMNS}, done_markers FROM step_entries WHERE {key}{scope}"
        " ORDER BY task_id, step_id, entry_seq LIMIT ?",
        [*args, *scope_args, limit + 1],
    ).fetchall()
    entries = [_entry(row) for row in rows[:limit]]
    if not entries:
        return [], False
    first, last = entries[0], entries[-1]
    found = {EntryKey(row[0], row[1], row[2]): done_of(row[7]) for row in rows[:limit] if row[7] is not None}
    for row in conn.execute(
        "SELECT task_id, step_id, entry_seq, position, kind, state, epoch, detail FROM step_entry_markers"
        " WHERE (task_id, step_id, entry_seq) >= (?, ?, ?) AND (task_id, step_id, entry_seq) <= (?, ?, ?)",
        (first.task_id, first.step_id, first.entry_seq, last.task_id, last.step_id, last.entry_seq),
    ):
        found.setdefault(EntryKey(row[0], row[1], row[2]), {})[row[3]] = Marker(*row[3:])
    infos = [entry_info(e, found.get(EntryKey(e.task_id, e.step_id, e.entry_seq), {})) for e in entries]
    return infos, len(rows) > limit


def entries_with_markers(conn: Connection, task_id: str) -> list[StepEntryInfo]:
    """Every entry of the task with its markers (`entry_info`), in (step, entry_seq) order."""
    return [
        entry_info(entry, markers(conn, EntryKey(entry.task_id, entry.step_id, entry.entry_seq)))
        for entry in entries_for_task(conn, task_id)
    ]
