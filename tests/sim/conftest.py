from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "../shared/data"


@pytest.fixture
def sim_shared_data() -> Path:
    """The real traces in ../shared/data; the test is skipped where they are absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent")
    return SHARED_DATA.resolve()
