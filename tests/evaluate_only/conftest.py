"""Fixtures of the evaluate-only marking tests: the shared runtime fixture, driven by a ScriptedHost."""

from __future__ import annotations

import pytest
from eo_support import ScriptedHost


@pytest.fixture
def host() -> ScriptedHost:
    return ScriptedHost()
