"""LRU and LFU: hand-traced sequences, and the Numba kernels against the plain-Python reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb.cache.policies import BASE_POLICIES, POLICIES
from tiered_emb.cache.slots import CacheTier, Resolved, cache_release, cache_resolve, simulate
from tiered_emb.step.plan import dedupe
from tiered_emb.testing.reference import ReferencePolicy


class KernelPolicy:
    """Drive a CacheTier's resolve/release kernels the way the store does, without rows."""

    def __init__(self, capacity, policy, force_pin=False):
        self.t = CacheTier(capacity, policy)
        self.force_pin = force_pin

    def access_batch(self, ids):
        t = self.t
        uids, _ = dedupe(np.asarray(ids, dtype=np.int64))
        hits, evicted = [], []
        for s in range(0, uids.shape[0], t.capacity_rows):
            chunk = uids[s : s + t.capacity_rows]
            k = chunk.shape[0]
            slots = np.empty(k, np.int64)
            miss = np.empty(k, np.int64)
            vs, vi = np.empty(k, np.int64), np.empty(k, np.int64)
            vd, vt = np.empty(k, np.uint8), np.empty(k, np.int32)
            out = Resolved(slots, miss, vs, vi, vd, vt)
            nm, nv, pinned = cache_resolve(t.tag, t.state, chunk, self.force_pin, out, False, 0)
            missed = set(miss[:nm].tolist())
            hits += [i not in missed for i in range(k)]
            evicted += vi[:nv].tolist()
            assert pinned == (self.force_pin or nm > 0)
            if pinned:
                cache_release(t.tag, t.state, slots)
            assert t.pinned_rows == np.count_nonzero(t.pins) == 0
        return hits, evicted

    def resident(self):
        return {int(i): int(s) for s, i in enumerate(self.t.slot_ids) if i >= 0}


def run_both(policy, capacity, batches, force_pin=False):
    ref, ker = ReferencePolicy(capacity, policy), KernelPolicy(capacity, policy, force_pin)
    for b in batches:
        assert ker.access_batch(b) == ref.access_batch(b), f"batch {b}"
        assert ker.resident() == ref.slot_of
    return ref


def test_registry_names():
    assert set(POLICIES) >= {"lru", "lfu"}


def test_lru_hand_traced():
    p = ReferencePolicy(3, "lru")
    assert p.access_batch([1, 2, 3]) == ([False] * 3, [])
    assert p.access_batch([1]) == ([True], [])  # order now 2, 3, 1
    assert p.access_batch([4]) == ([False], [2])  # least recent: 2
    assert p.access_batch([3, 5]) == ([True, False], [1])  # 3 pinned; victim among {1, 4}: 1
    run_both("lru", 3, [[1, 2, 3], [1], [4], [3, 5]])


def test_lfu_hand_traced():
    p = ReferencePolicy(3, "lfu")
    p.access_batch([1, 2, 3])
    p.access_batch([1, 1, 2])  # counts 1:2, 2:2, 3:1 (a batch counts an id once)
    assert p.access_batch([4]) == ([False], [3])  # lowest count
    assert p.access_batch([5]) == ([False], [4])  # 4 has count 1, newest, but lowest count wins
    p.access_batch([5, 5])  # counts 1:2, 2:2, 5:2; last uses 1<2<5
    assert p.access_batch([6]) == ([False], [1])  # tie on count: least recently used
    run_both("lfu", 3, [[1, 2, 3], [1, 1, 2], [4], [5], [5, 5], [6]])


def test_batch_larger_than_capacity_is_chunked_and_pinned():
    # 5 distinct ids, capacity 2: chunks [1,2], [3,4], [5]; within a chunk no id evicts another.
    ref = run_both("lfu", 2, [[1, 2, 3, 4, 5, 1], [5, 4]])
    assert len(ref.slot_of) == 2


@pytest.mark.parametrize("force_pin", [False, True])
@pytest.mark.parametrize("policy", BASE_POLICIES)
@given(capacity=st.integers(1, 6), batches=st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=10), max_size=25))
def test_kernel_decisions_equal_reference(policy, force_pin, capacity, batches):
    """Both resolve paths (all-hit without pins, and pinned) make the reference's decisions."""
    run_both(policy, capacity, batches, force_pin)


@pytest.mark.parametrize("policy", BASE_POLICIES)
@pytest.mark.parametrize(
    "capacity, trace",
    [
        (2, [1, 2] * 31 + [3, 1, 2, 3]),  # more hits in a row than LRU's ring holds (2 * cap + 16): compaction
        (16, [i % 23 for i in range(0, 400, 3)] + [5, 5, 5, 7, 7, 30, 31, 32, 5, 7, 33] * 4),  # LFU detach mid-heap
    ],
)
def test_simulate_equals_reference_hand_traced_long_runs(policy, capacity, trace):
    ref = ReferencePolicy(capacity, policy)
    hits = sum(ref.access_batch([i])[0][0] for i in trace)
    assert simulate(np.array(trace, dtype=np.int64), capacity, policy) == hits


@pytest.mark.parametrize("policy", BASE_POLICIES)
@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(4, 16),
    batches=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=40),
)
def test_kernel_decisions_equal_reference_deeper_heaps(policy, capacity, batches):
    """Larger capacities than the test above: a pin detaches slots from the middle of LFU's heap."""
    run_both(policy, capacity, batches, True)


@pytest.mark.parametrize("policy", BASE_POLICIES)
@given(capacity=st.integers(1, 8), trace=st.lists(st.integers(0, 20), max_size=300))
def test_simulate_equals_reference_one_request_at_a_time(policy, capacity, trace):
    ref = ReferencePolicy(capacity, policy)
    hits = sum(ref.access_batch([i])[0][0] for i in trace)
    assert simulate(np.array(trace, dtype=np.int64), capacity, policy) == hits


def test_simulate_lru_hand_traced():
    assert simulate(np.array([1, 2, 1, 3, 1, 2]), 2, "lru") == 2
    assert simulate(np.array([1, 2, 1, 3, 1, 2]), 2, "lfu") == 2
