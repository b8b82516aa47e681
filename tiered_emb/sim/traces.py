"""Trace sources: seeded id streams for simulation, benchmarks and the main job."""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def _zipf_cdf(n_ids: int, alpha: float) -> np.ndarray:
    w = np.arange(1, n_ids + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return cdf


def _scatter_multiplier(n_ids: int) -> int:
    """An odd multiplier coprime with ``n_ids``: rank -> (rank * a + b) mod n is a bijection."""
    a = 2654435761 % n_ids if n_ids > 2 else 1
    while math.gcd(a, n_ids) != 1 or a == 0:
        a += 1
    return a


def zipf_ids(n_ids: int, alpha: float, size: int, seed: int, scatter: bool = True) -> np.ndarray:
    """``size`` ids in ``[0, n_ids)`` with P(rank r) proportional to r**-alpha (exact, finite support).

    Parameters
    ----------
    n_ids : int, number of distinct ids
    alpha : float, skew (> 0; 1.05 is typical of recommendation features)
    size : int
    seed : int, the only source of randomness
    scatter : bool, map ranks to ids by a fixed bijection so hot ids are not 0, 1, 2...

    Returns
    -------
    int64 array (size,)

    Examples
    --------
    >>> ids = zipf_ids(1000, 1.05, 10_000, seed=0)
    >>> ids.dtype, int(ids.min()) >= 0, int(ids.max()) < 1000
    (dtype('int64'), True, True)
    """
    rng = np.random.default_rng(seed)
    cdf = _zipf_cdf(int(n_ids), float(alpha))
    ranks = np.searchsorted(cdf, rng.random(size), side="right").astype(np.int64)
    np.minimum(ranks, n_ids - 1, out=ranks)
    if scatter:
        a = _scatter_multiplier(n_ids)
        ranks = (ranks * a + 12345) % n_ids
    return ranks
