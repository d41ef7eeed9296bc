"""Runs as a schema-20 onceflow stored them, before on_enter keys were stored by their parts (store/backends/
schema.py and pg_schema.py migration 21): what the migration tests of both backends write and read back."""

from __future__ import annotations

T0 = 1_800_000_000.0

OldRun = tuple[int, str, str, int | None, str, str | None]
"""(id, task_id, step, entry_seq, agent, key)."""

OLD_RUNS: list[OldRun] = [
    (1, "T1", "review", 1, "rev-a", "on_enter:T1:review:1:1:rev-a:0123456789abcdef"),
    (2, "T:1%", "re:view", 3, "rev:%b", "on_enter:T%3A1%25:re%3Aview:3:0:rev%3A%25b:fedcba9876543210"),
    (3, "T1", "review", None, "rev-a", "op-1:review:T1:rev-a:0123456789abcdef"),
    # an on_enter key on a run without an entry_seq (another trigger's): its text
    (4, "T1", "review", None, "rev-a", "on_enter:T1:review:7:1:rev-a:0123456789abcdef"),
    # run 1's (entry, position, agent) again, another digest: its text
    (5, "T1", "review", 1, "rev-a", "on_enter:T1:review:1:1:rev-a:1111111111111111"),
    # not what its parts give back (a leading zero): its text
    (6, "T1", "review", 2, "rev-a", "on_enter:T1:review:2:01:rev-a:0123456789abcdef"),
    (7, "T1", "review", 2, "rev-a", None),
    (8, "T1", "review", 2, "rev-a", "escalation:3"),
]
