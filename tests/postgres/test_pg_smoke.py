"""Smoke: the office cycle on PostgreSQL."""

from __future__ import annotations

from onceflow.actors.runtime.startup import open_runtime


async def test_runtime_opens_on_postgres(pg_url: str) -> None:
    async with open_runtime(pg_url) as rt:
        assert rt.services.store.postgres
