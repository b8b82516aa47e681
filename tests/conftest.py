import importlib.util
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Without an NVIDIA driver and numba-cuda the step's CUDA kernels run in Numba's simulator, so
# every CI run checks their logic bitwise against the host kernels (tests/step/device/test_cuda_kernels.py,
# tests/step/device/test_device_path.py; docs/gpu.md).  Numba reads the variable when it is first imported:
# it must be set before anything imports numba.  NUMBA_ENABLE_CUDASIM=0 in the environment wins.
if shutil.which("nvidia-smi") is None or importlib.util.find_spec("numba_cuda") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# The small job that compiles a first run's kernels beside it (tiered_emb/apps/warm.py) stays
# off: the suite's first `tiered-emb train` would otherwise share the cores with one.
# tests/apps/test_warm.py turns it on where it is the subject.
os.environ.setdefault("TIERED_EMB_WARM", "0")

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
