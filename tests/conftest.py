import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# default: quick local runs; ci: derandomized and larger (the CI script selects it).
settings.register_profile("default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent")
    return SHARED_DATA


def _gpu_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_usable():
        return
    skip = pytest.mark.skip(reason="no usable CUDA GPU / CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
