"""The scratch arrays the simulator keeps between runs (dense index, next uses, last positions):
whatever ran before, in this thread or another, a run gives the hits of a fresh process."""

import threading

import numpy as np
import pytest

from tiered_emb.sim import policies as P
from tiered_emb.sim import release_scratch, simulate, zipf_ids
from tiered_emb.sim.policies import buffers
from tiered_emb.testing import sim_reference as ref

POLICIES = sorted(ref.REFERENCES)


def _expected(trace, capacity, policy):
    return int(np.sum(ref.REFERENCES[policy](trace.tolist(), capacity)))


@pytest.mark.parametrize("policy", POLICIES)
def test_runs_in_any_order_give_the_reference_hits(policy):
    """A run reuses the previous run's arrays, larger (a smaller id space after a larger one)
    or smaller (then a new one): each run still starts from an empty index."""
    release_scratch()
    small = zipf_ids(40, 0.9, 600, seed=1)
    large = zipf_ids(5000, 0.9, 600, seed=2) * 3
    for trace in (small, large, small, large, large[:37], small):
        for capacity in (1, 7, 30):
            assert simulate(trace, capacity, policy) == _expected(trace, capacity, policy), (trace.max(), capacity)


def test_one_role_taken_twice_gives_two_arrays():
    release_scratch()
    with P.scratch("x", 10, np.int32) as a, P.scratch("x", 10, np.int32) as b:
        assert not np.shares_memory(a, b)
    with P.scratch("x", 5, np.int32) as c:  # one of them, kept: a view of it
        assert np.shares_memory(c, a) or np.shares_memory(c, b)
    with P.scratch("x", 5, np.int64) as d:  # another dtype: a new one
        assert d.dtype == np.int64 and not (np.shares_memory(d, a) or np.shares_memory(d, b))


def test_an_error_in_a_run_gives_the_array_back_and_the_next_run_is_right():
    release_scratch()
    trace = zipf_ids(300, 1.0, 2000, seed=3)
    with pytest.raises(RuntimeError), P.scratch("index", 300, np.int32) as ix:
        ix[:] = 7  # left dirty, as a run that failed half way would
        raise RuntimeError("boom")
    assert "index" in P.scratch_roles()
    assert simulate(trace, 20, "lru") == _expected(trace, 20, "lru")


def test_large_arrays_are_not_kept(monkeypatch):
    release_scratch()
    monkeypatch.setattr(buffers, "SCRATCH_KEEP_BYTES", 1000)  # read where scratch() lives
    with P.scratch("big", 1000, np.int32):
        pass
    with P.scratch("small", 100, np.int32):
        pass
    assert P.scratch_roles() == ["small"]
    release_scratch()
    assert P.scratch_roles() == []


def test_threads_keep_their_own():
    """Two threads simulating at once on different traces: each gets the reference's hits."""
    traces = [zipf_ids(2000, 0.8, 20_000, seed=s) for s in (4, 5)]
    want = [[_expected(t, c, "fifo") for c in (5, 50, 500)] for t in traces]
    got = [None, None]

    def run(k):
        got[k] = [simulate(traces[k], c, "fifo") for c in (5, 50, 500) for _ in range(3)][::3]

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
