"""The run idempotency-key format (store/runs/keys.py): every key parses back into its parts, whatever the ids
hold (the limits allow any character but control characters, `:` and `%` included); the SQL builders write
the same bytes as the Python ones, on both backends; keys of ordinary ids are what they always were."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from onceflow.protocol.limits import MAX_ID_CHARS
from onceflow.protocol.operation_ids import decision_operation_id
from onceflow.store.runs import keys
from onceflow.store.writer import open_store

# What protocol/limits.py admits as an id: 1..256 characters, none a control character (C0, DEL, C1);
# the punctuation a key uses, and what encoding it writes, drawn often.
ids = st.one_of(
    st.text(
        st.characters(
            blacklist_categories=("Cs",),
            blacklist_characters=[chr(c) for c in range(32)] + [chr(c) for c in range(0x7F, 0xA0)],
        ),
        min_size=1,
        max_size=MAX_ID_CHARS,
    ),
    st.text(st.sampled_from(":%3Aa5"), min_size=1, max_size=12),
)
digests = st.text(st.sampled_from("0123456789abcdef"), min_size=16, max_size=16)
counts = st.integers(min_value=0, max_value=2**63 - 1)


@given(task=ids, step=ids, seq=counts, position=st.integers(0, 999), agent=ids, digest=digests)
@example(task="T:1", step="re%3Aview", seq=1, position=0, agent="a:b%", digest="0" * 16)
def test_an_on_enter_key_parses_back_into_its_parts(
    task: str, step: str, seq: int, position: int, agent: str, digest: str
) -> None:
    key = keys.entry_key(task, step, seq, position, agent, digest)
    assert keys.parse(key) == keys.EntryRunKey(task, step, seq, position, agent, digest)
    assert key.startswith(keys.entry_prefix(task, step, seq))
    assert keys.position_in(key, keys.entry_prefix(task, step, seq)) == position
    assert keys.ON_ENTER_RANGE[0] <= key < keys.ON_ENTER_RANGE[1]


@given(task=ids, step=ids, agent=ids, digest=digests, decision=ids)
@example(task="T:1", step="s", agent="%", digest="f" * 16, decision="d:1:2")
def test_an_operation_key_parses_back_into_its_parts(
    task: str, step: str, agent: str, digest: str, decision: str
) -> None:
    operation = decision_operation_id(task, step, decision)  # an operation id holds colons of its own
    key = keys.operation_key(operation, step, task, agent, digest)
    assert keys.parse(key) == keys.OperationRunKey(operation, step, task, agent, digest)


@given(component=ids)
def test_encoding_is_reversible_and_leaves_ordinary_ids_alone(component: str) -> None:
    encoded = keys.encode(component)
    assert keys.decode(encoded) == component
    assert ":" not in encoded
    assert (encoded == component) == (":" not in component and "%" not in component)


def test_keys_of_ordinary_ids_are_byte_for_byte_what_they_were() -> None:
    """A database written before ids were encoded keeps its keys: ids without `:` or `%` are as written."""
    assert keys.entry_key("T-1", "review", 3, 1, "rev-a", "0123456789abcdef") == (
        "on_enter:T-1:review:3:1:rev-a:0123456789abcdef"
    )
    assert keys.operation_key("task_comment:c-1", "work", "T-1", "worker", "f" * 16) == (
        "task_comment:c-1:work:T-1:worker:" + "f" * 16
    )


@pytest.mark.parametrize("key", ["", "on_enter:a:b", "on_enter:a:b:x:1:c:d", "a:b:c", "on_enter:a:b:1:y:c:d"])
def test_a_malformed_key_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="run key"):
        keys.parse(key)


async def test_the_sql_builders_write_the_python_bytes(db_path: Path | str) -> None:
    """On this test's backend (SQLite, or PostgreSQL with --backend=postgres): the key a statement builds from
    column values is the key `entry_key` builds, for ids holding what encoding rewrites."""
    cases = [
        ("T-1", "review", 3, 1, "rev-a"),
        ("T:1", "re%view", 12, 0, "a:%3A"),
        ("%%", "::", 1, 7, "é:ü"),
    ]
    sql = (
        "SELECT " + keys.entry_prefix_sql("?1", "?2", "?3") + " || " + keys.entry_suffix_sql("?4", "?5", "?6")
    )
    around = (
        "SELECT "
        + keys.entry_prefix_sql("?1", "?2", "?3")
        + " || "
        + keys.suffix_around_sql("?4", "?5", "?6")
    )
    async with open_store(db_path) as store:
        for task, step, seq, position, agent in cases:
            expected = keys.entry_key(task, step, seq, position, agent, "0123456789abcdef")
            params = (task, step, seq, position, agent, "0123456789abcdef")
            (got,) = await store.transact(lambda conn, p=params: conn.execute(sql, p).fetchone())
            assert got == expected
            head, tail = keys.suffix_around(position, "0123456789abcdef")
            parts = (task, step, seq, head, agent, tail)
            (got,) = await store.transact(lambda conn, p=parts: conn.execute(around, p).fetchone())
            assert got == expected


@settings(max_examples=200)
@given(task=ids, step=ids, seq=counts)
def test_on_enter_keys_of_one_entry_share_a_prefix_no_other_entry_has(task: str, step: str, seq: int) -> None:
    """The prefix names one entry: another entry's keys never start with it (so the set path's probes and the
    common entry's position parse read only their own entry's keys)."""
    prefix = keys.entry_prefix(task, step, seq)
    other = keys.entry_key(task + ":x", step, seq, 0, "a", "0" * 16)
    assert not other.startswith(prefix)
