"""A stable argsort of integer keys by one vectorised sort.

NumPy sorts an int64 array several times faster than it argsorts one (its sort runs on
SIMD; its stable argsort is a merge sort).  Where the keys' range leaves room for the
positions' bits, each key less the smallest is packed with its position into one int64,
those are sorted, and the positions read back: equal keys keep their positions' order,
so the permutation is exactly the stable argsort's.  The write-back's cut, the segment
index's merges and the step's id-order reads sort tens of thousands of ids a step.
"""

from __future__ import annotations

import numpy as np


def stable_argsort(keys: np.ndarray, runs: bool = False) -> np.ndarray:
    """The permutation ``np.argsort(keys, kind="stable")`` gives (int64), for 1-d ``keys``.

    ``runs``: the keys are a few sorted runs one after another (the segments of a store
    that opens): NumPy's merge sort, which finds and merges runs, sorts the packed keys
    there faster than its SIMD sort, which is the faster on keys in no order
    (figures: docs/benchmarks.md, "The SSD tier at scale").

    Examples
    --------
    >>> stable_argsort(np.array([5, -2, 5, 0, -2])).tolist()
    [1, 4, 3, 0, 2]
    """
    keys = np.asarray(keys)
    n = keys.shape[0]
    if n < 2:
        return np.arange(n, dtype=np.int64)
    if keys.dtype.kind not in "iu":
        return np.argsort(keys, kind="stable")
    if bool((keys[1:] >= keys[:-1]).all()):  # (in order already, as a bulk write's ids often are)
        return np.arange(n, dtype=np.int64)
    bits = (n - 1).bit_length()
    lo = keys.min()
    if int(keys.max()) - int(lo) >= 1 << (63 - bits):
        return np.argsort(keys, kind="stable")
    packed = (keys - lo).astype(np.int64, copy=False)  # (in the keys' own type: no overflow)
    packed <<= bits
    packed |= np.arange(n, dtype=np.int64)
    packed.sort(kind="stable" if runs else "quicksort")
    packed &= (1 << bits) - 1
    return packed
