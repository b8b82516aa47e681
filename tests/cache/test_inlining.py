"""The tier kernels' helpers (index probes, policy list operations) are Numba functions
of their own (``inline="never"``), not ``inline="always"``: Numba then types each once
instead of at every call site, and LLVM inlines them into the kernels all the same.
These tests hold LLVM to that: in the optimised code of each hot kernel, every call into
the package is to another kernel (a unit compiled on its own on purpose), never to a
helper, and no reference count came back with an inlined helper.
"""

from __future__ import annotations

import importlib
import re

import numba
import numpy as np
import pytest

from tiered_emb.cache import index, slots
from tiered_emb.tiers.ddr import DdrTier
from tiered_emb.tiers.hbm import HbmTier

_SYMBOL = re.compile(r'call [^@\n]*@"?(_ZN10tiered_emb[A-Za-z0-9_]+)')


def _qualname_of(symbol: str) -> tuple[str, str]:
    """``(module, name)`` of a Numba-mangled symbol ``_ZN<len><part>...<len><name>B...``."""
    parts, i = [], 3
    while i < len(symbol) and symbol[i].isdigit():
        j = i
        while symbol[j].isdigit():
            j += 1
        n = int(symbol[i:j])
        parts.append(symbol[j : j + n])
        i = j + n
    return ".".join(parts[:-1]), parts[-1]


def _helpers_called(py_func, *args) -> list[str]:
    """The package functions that a fresh compile of ``py_func`` (as a kernel is compiled:
    no reference counts) still calls after LLVM's optimisation, other than itself and
    other kernels; and "reference counts" if an inlined helper brought any back."""
    fresh = numba.njit(nogil=True, _nrt=False)(py_func)
    fresh(*args)
    ir = fresh.inspect_llvm(fresh.signatures[0])
    left = ["reference counts"] if "atomicrmw" in ir or re.search(r"@\"?NRT_(incref|decref)", ir) else []
    for symbol in sorted(set(_SYMBOL.findall(ir))):
        module, name = _qualname_of(symbol)
        if name == py_func.__name__:
            continue  # (its own entry, called by its Python wrapper)
        try:
            target = getattr(importlib.import_module(module), name, None)
        except ImportError:  # (a function local to another: an overload's, never a kernel)
            target = None
        if getattr(target, "targetoptions", {}).get("_nrt") is False:
            continue  # another kernel
        left.append(f"{module}.{name}")
    return left


_IDS = np.unique(np.random.default_rng(0).integers(0, 5_000, 900))


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc"])
def test_the_resolve_kernel_calls_no_helper(policy):
    h = HbmTier(1_000, 17, policy, np)
    k = _IDS.shape[0]
    out = slots.Resolved(*(np.empty(k, np.int64) for _ in range(4)), np.empty(k, np.uint8), np.empty(k, np.int32))
    assert _helpers_called(slots.cache_resolve.py_func, h.tag, h.state, _IDS, False, out, False, 0) == []


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_the_admit_take_and_release_kernels_call_no_helper(policy):
    d = DdrTier(500, 17, policy)
    k = _IDS.shape[0]
    args = (np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int32), np.empty(k, np.int64))
    assert (
        _helpers_called(
            slots.cache_admit_slots.py_func,
            d.tag,
            d.state,
            np.full(500, -1, np.int32),
            _IDS,
            np.empty(0, np.int32),
            np.zeros(k, np.uint8),
            *args,
        )
        == []
    )
    found = d.find(_IDS)
    assert _helpers_called(slots.cache_take_slots.py_func, d.tag, d.state, _IDS, found, np.empty(k, np.uint8), 0) == []
    h = HbmTier(1_000, 17, policy, np)
    resolved = h.decide(_IDS)[0]
    assert _helpers_called(slots.cache_release.py_func, h.tag, h.state, resolved) == []


def test_the_index_probe_calls_no_helper():
    keys, vals = index.new_index(1_000)
    assert (
        _helpers_called(index.index_find_many.py_func, keys, vals, _IDS, np.empty(_IDS.shape[0], np.int64), 0, -1) == []
    )


def test_the_helpers_are_typed_once():
    """The index's helpers are not Numba-inlined (each would be typed again at every call
    site: the first run's compile time)."""
    for f in (index.hash_home, index.home_of, index.index_prefetch_of, index.index_prefetch):
        assert f.targetoptions.get("inline") == "never"
