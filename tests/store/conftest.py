"""The ``store`` fixture of tests/store/test_store_*.py: a small CPU store, closed after the test."""

import pytest
from store_setup import TABLES, cpu

from tiered_emb import TieredStore


@pytest.fixture
def store(tmp_path):
    s = TieredStore.create(tmp_path / "s", TABLES, cpu(4, 4), seed=3)
    yield s
    s.close()
