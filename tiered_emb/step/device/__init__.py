"""The step on a GPU: the device twins of the host's stages, each giving the host's bytes.

- :mod:`.launch`: :class:`~.launch.DeviceKernels`, the launches a resolver holds as
  ``kernels`` when the HBM tier lives on a GPU (``None``: the host's Numba kernels);
- :mod:`.native`: the CUDA C of ``native/step_kernels.cu``, compiled by CuPy's NVRTC;
- :mod:`.cuda_kernels`: their numba-cuda twins (``TIERED_EMB_CUDA_KERNELS=numba``, and
  Numba's CUDA simulator in CI);
- :mod:`.staging`: a launch's host arrays sent up in one page-locked copy;
- :mod:`.plan`: a table held whole in HBM planned on the device (no host dedupe or grouping).

Nothing here imports CuPy or ``numba.cuda`` at import time.
"""
