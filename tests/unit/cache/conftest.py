"""Fixtures of the cache tests (helpers live in tests/cache_fixtures.py, importable by module name)."""

from __future__ import annotations

import pytest
from fakes import fake_meta


@pytest.fixture
def meta():
    return fake_meta()
