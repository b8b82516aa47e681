"""The one-pass LRU curve equals per-size simulation; Belady's curve equals per-size Belady."""

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_emb.errors import ConfigError, IdRangeError, IdTypeError
from tiered_emb.sim import lru_curve, opt_curve, simulate, zipf_ids
from tiered_emb.testing.sim_reference import stack_distance_hits


@given(st.lists(st.integers(0, 15), min_size=1, max_size=150))
def test_lru_curve_equals_per_size_simulation(trace):
    tr = np.array(trace, dtype=np.int64)
    c = lru_curve(tr)
    assert c.distinct_ids == len(set(trace))
    assert c.hits[0] == 0
    for cap in range(1, c.distinct_ids + 1):
        assert c.hits[cap] == simulate(tr, cap, "lru") == stack_distance_hits(trace, cap)


@given(st.lists(st.one_of(st.integers(0, 6), st.integers(0, 3000)), min_size=1, max_size=300), st.booleans())
def test_lru_curve_long_ids_both_paths(trace, huge):
    """Ids far apart (the argsort path when ``huge``), reuses across the two chunks the
    pass sweeps apart: the reference's hits at every size."""
    tr = np.array(trace, dtype=np.int64) * ((2**40 + 3) if huge else 1)
    c = lru_curve(tr)
    for cap in range(1, c.distinct_ids + 1, max(1, c.distinct_ids // 7)):
        assert c.hits[cap] == stack_distance_hits(trace, cap)


def test_lru_curve_same_with_one_thread():
    """The chunks run one after the other on one thread: the same curve.  (With two, the
    second chunk's 20k first requests reach the join in several publications.)"""
    tr = zipf_ids(40_000, 0.9, 200_000, seed=12)
    two = lru_curve(tr)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        one = lru_curve(tr)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one.hits, two.hits)


def test_lru_curve_zipf_every_size():
    tr = zipf_ids(3000, 1.0, 30_000, seed=5)
    c = lru_curve(tr)
    for cap in (1, 2, 10, 100, 999, c.distinct_ids):
        assert c.hits[cap] == simulate(tr, cap, "lru")
    assert np.all(np.diff(c.hits) >= 0)
    assert c.hits[-1] == tr.shape[0] - c.distinct_ids  # all but cold misses


def test_opt_curve():
    tr = zipf_ids(500, 0.8, 5000, seed=2)
    sizes = [1, 5, 50, 400]
    oc = opt_curve(tr, sizes)
    assert oc.hits.tolist() == [simulate(tr, s, "belady") for s in sizes]
    lru = lru_curve(tr)
    assert np.all(oc.hits >= lru.at(sizes))
    assert oc.distinct_ids == lru.distinct_ids


def test_empty_and_single():
    c = lru_curve(np.zeros(0, dtype=np.int64))
    assert c.distinct_ids == 0 and c.hits.tolist() == [0]
    c = lru_curve(np.array([7, 7, 7]))
    assert c.hits.tolist() == [0, 2]


def test_lru_curve_dense_and_argsort_paths_agree():
    """Bounded ids take the dense last-position pass, huge ids the stable argsort; long
    reuse gaps climb the count levels, short ones stay in the popcounts: the same curve."""
    tr = zipf_ids(4000, 0.7, 60_000, seed=9)
    dense = lru_curve(tr)
    hashed = lru_curve(tr * (2**40 + 3))
    assert np.array_equal(dense.hits, hashed.hits)
    for cap in (1, 5, 64, 700, 3000):
        assert dense.hits[cap] == simulate(tr, cap, "lru", index="hash")


def test_lru_curve_raises_the_worker_error(monkeypatch):
    """An error in the thread that sweeps the second chunk is raised by ``lru_curve``,
    and the thread is gone when it returns."""
    import threading

    from tiered_emb.sim import mrc

    real = mrc._sweep_chunk

    def failing(trace, start, stop, *rest):
        if start > 0:
            raise MemoryError("no room for the second chunk")
        return real(trace, start, stop, *rest)

    monkeypatch.setattr(mrc, "_sweep_chunk", failing)
    tr = zipf_ids(1000, 0.9, 20_000, seed=3)
    with pytest.raises(MemoryError, match="second chunk"):
        lru_curve(tr)
    assert not any(t.name == "tiered_emb-mrc" for t in threading.enumerate())


def test_curves_refuse_bad_traces_and_sizes():
    neg = np.array([-1, 5, 7, -1, 5, 7, -1, 9, 9, -1])
    with pytest.raises(IdRangeError, match=">= 0"):  # -1 hit the hash index's empty buckets: 3 hits at size 1
        opt_curve(neg, [1, 2])
    with pytest.raises(IdTypeError, match="shape"):  # was a numba TypingError
        lru_curve(np.array([[1, 2], [1, 2]]))
    with pytest.raises(IdTypeError, match="float64"):
        lru_curve(np.array([1.5, 2.5]))
    tr = np.array([1, 2, 3, 1, 2, 3])
    with pytest.raises(ConfigError, match="integers"):  # 1.9 was truncated to 1
        opt_curve(tr, [1.9])
    with pytest.raises(ConfigError, match="negative"):
        opt_curve(tr, [-2, 1])
    # lru_curve takes no hash index: negative ids are fine there
    assert lru_curve(neg).hits.tolist() == lru_curve(np.where(neg == -1, 0, neg)).hits.tolist()


def test_opt_curve_far_beyond_the_trace():
    """A size of 2**40 (a MemoryError before) runs as the trace length: every re-request hits."""
    tr = zipf_ids(100, 0.9, 500, seed=2)
    oc = opt_curve(tr, [5, 2**40])
    assert oc.hits.tolist() == [simulate(tr, 5, "belady"), tr.shape[0] - oc.distinct_ids]


def test_curve_at_only_answers_its_sizes():
    tr = np.array([1, 2, 3, 1, 2, 3])
    oc = opt_curve(tr, [1, 3])
    assert oc.at([3, 1]).tolist() == [3, 0] and int(oc.at(3)) == 3
    with pytest.raises(ConfigError, match="size 2 is not in this curve"):  # answered size 3's hits before
        oc.at([2])
    with pytest.raises(ConfigError, match="integers"):
        oc.at([1.5])
    # 3 objects hold all 3 ids: any larger cache hits the same (documented)
    assert oc.at([10]).tolist() == [3]
    with pytest.raises(ConfigError, match="size 10"):  # an IndexError before
        opt_curve(tr, [1, 2]).at([10])
    lru = lru_curve(tr)
    assert lru.at([0, 3, 1000]).tolist() == [0, 3, 3]
    with pytest.raises(ConfigError, match="negative"):
        lru.at([-1])
