"""Every simulator policy against its plain-Python reference, hand-traced sequences, Belady's bound.

The twins of the store's LRU and LFU against the store's own kernel, request by request, are
in the policy contract, tests/cache/test_policy_contract.py."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_emb.errors import ConfigError, IdRangeError, IdTypeError
from tiered_emb.sim import SIM_POLICIES, simulate, zipf_ids
from tiered_emb.testing import sim_reference as ref

POLICIES = sorted(ref.REFERENCES)
traces = st.lists(st.integers(0, 12), min_size=0, max_size=120)
capacities = st.integers(1, 8)


INDEXES = ["dense", "hash"]  # the kernels' two id -> slot indexes


def flags(trace, capacity, policy, index="auto"):
    hits, f = simulate(np.array(trace, dtype=np.int64), capacity, policy, hit_flags=True, index=index)
    assert hits == int(f.sum())
    return [bool(v) for v in f]


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("policy", POLICIES)
@given(trace=traces, capacity=capacities)
def test_kernel_matches_reference(policy, index, trace, capacity):
    assert flags(trace, capacity, policy, index) == ref.REFERENCES[policy](trace, capacity)


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("policy", POLICIES)
def test_kernel_matches_reference_zipf(policy, index):
    tr = zipf_ids(60, 0.9, 1500, seed=7).tolist()
    for capacity in (1, 3, 10, 25, 59):
        assert flags(tr, capacity, policy, index) == ref.REFERENCES[policy](tr, capacity), capacity


@pytest.mark.parametrize("policy", POLICIES)
def test_dense_and_hash_indexes_agree(policy):
    """Request by request, on a trace large enough for long eviction chains; "auto" picks
    the dense index for bounded ids and the hash table for huge ones."""
    tr = zipf_ids(20_000, 0.9, 200_000, seed=11)
    for capacity in (5, 300, 4000):
        d = simulate(tr, capacity, policy, hit_flags=True, index="dense")[1]
        h = simulate(tr, capacity, policy, hit_flags=True, index="hash")[1]
        assert np.array_equal(d, h), capacity
    huge = tr * (2**40 + 7)  # ids beyond any dense array: the hash path
    assert simulate(huge, 300, policy) == simulate(tr, 300, policy)


def test_index_choice():
    from tiered_emb.sim.policies import dense_ok

    assert dense_ok(10**7, 2 * 10**7) and dense_ok(2**26 - 1, 10)
    assert not dense_ok(2**26, 10) and not dense_ok(2**40, 2**30)
    with pytest.raises(ConfigError, match="index"):
        simulate(np.array([1]), 1, "lru", index="tree")


@pytest.mark.parametrize("index", INDEXES)
@given(trace=st.lists(st.one_of(st.integers(0, 4), st.integers(0, 60)), max_size=200), capacity=st.integers(1, 16))
def test_belady_with_many_last_requests(index, trace, capacity):
    """A few hot ids and a long tail: many requests are an id's last, whose slots leave Belady's heap for
    its stack of never-again residents (hits on them, misses taking them, the heap emptied)."""
    assert flags(trace, capacity, "belady", index) == ref.belady(trace, capacity)


@given(trace=traces, capacity=capacities)
def test_no_policy_beats_belady(trace, capacity):
    tr = np.array(trace, dtype=np.int64)
    best = simulate(tr, capacity, "belady")
    for p in SIM_POLICIES:
        assert simulate(tr, capacity, p) <= best, p


def test_hand_traced():
    tr = [1, 2, 3, 1, 4, 1, 2, 5, 1, 2]
    #           1  2  3  1  4  1  2  5  1  2
    assert ref.lru(tr, 3) == [0, 0, 0, 1, 0, 1, 0, 0, 1, 1]
    assert ref.fifo(tr, 3) == [0, 0, 0, 1, 0, 0, 0, 0, 1, 1]  # 4 pushes out 1, 1 out 2, 2 out 3, 5 out 4
    assert ref.clock(tr, 3) == [0, 0, 0, 1, 0, 1, 0, 0, 1, 1]  # 1's bit saves it twice; 2, 3, 4 go
    assert ref.lfu(tr, 3) == [0, 0, 0, 1, 0, 1, 0, 0, 1, 1]  # 1 counts 2, then 3: never the victim
    assert ref.sieve(tr, 3) == [0, 0, 0, 1, 0, 1, 0, 0, 1, 1]
    assert ref.belady(tr, 3) == [0, 0, 0, 1, 0, 1, 1, 0, 1, 1]  # 4 evicts 3 (never again), 5 evicts 4
    for p in ("lru", "fifo", "clock", "lfu", "sieve", "belady"):
        assert flags(tr, 3, p) == [bool(v) for v in getattr(ref, p)(tr, 3)], p


def test_sieve_hand_stays():
    # 1 2 3 full; hit 1; 4: hand at 1 (visited, cleared) -> 2 evicted, hand to 3;
    # 5: 3 unvisited -> evicted (the hand did not go back to the oldest).
    tr = [1, 2, 3, 1, 4, 5, 1]
    assert ref.sieve(tr, 3) == [0, 0, 0, 1, 0, 0, 1]
    assert flags(tr, 3, "sieve") == [False] * 3 + [True, False, False, True]


def test_s3fifo_ghost_goes_to_main():
    # capacity 10: small 1, main 9, ghost 9; after warm-up, a ghost hit is admitted to main.
    tr = list(range(12)) + [0] + list(range(20, 30)) + [0]
    assert flags(tr, 10, "s3fifo") == ref.s3fifo(tr, 10)


def test_unknown_policy_and_bad_capacity():
    with pytest.raises(ConfigError, match="choose from"):
        simulate(np.array([1]), 1, "mru")
    with pytest.raises(ConfigError, match="capacity"):
        simulate(np.array([1]), 0, "lru")
    with pytest.raises(ConfigError, match="not an integer"):
        simulate(np.array([1, 2, 1]), 1.5, "lru")  # was truncated to 1
    with pytest.raises(IdRangeError, match="ids must be >= 0"):
        simulate(np.array([-1]), 1, "lru")


def test_deterministic():
    tr = zipf_ids(1000, 1.0, 20_000, seed=1)
    for p in SIM_POLICIES:
        assert simulate(tr, 50, p) == simulate(tr, 50, p)


def test_next_use_dense_and_argsort_agree():
    from tiered_emb.sim import next_use_of

    tr = zipf_ids(3000, 1.0, 50_000, seed=4)
    huge = tr * (2**40 + 7)  # unbounded ids: the stable-argsort path
    assert np.array_equal(next_use_of(tr), next_use_of(huge))
    assert next_use_of(np.zeros(0, dtype=np.int64)).shape == (0,)


@pytest.mark.parametrize(
    "trace,error,match",
    [
        (np.array([1.5, 1.9, 1.2]), IdTypeError, "dtype float64"),  # was truncated to [1, 1, 1]: 2 hits
        (np.array([[1, 2], [1, 2]]), IdTypeError, "shape"),  # was a numba TypingError
        ([2**64 - 1, 0], IdRangeError, "beyond int64"),  # was OverflowError
        (np.array([2**64 - 1, 3], dtype=np.uint64), IdRangeError, "beyond int64"),  # was wrapped to -1
        (np.array(["a", "b"]), IdTypeError, "dtype"),
    ],
)
def test_bad_traces_are_typed(trace, error, match):
    with pytest.raises(error, match=match):
        simulate(trace, 1, "lru")


@pytest.mark.parametrize("policy", sorted(SIM_POLICIES))
def test_cache_beyond_the_trace_runs_as_the_trace_length(policy):
    """No policy evicts before it is full, so a cache of n objects or more (here 2**40: 4 TiB of
    slots, a MemoryError before) gives the hits of the kernel run with any larger one."""
    tr = zipf_ids(50, 0.8, 300, seed=1)
    n = tr.shape[0]
    spec = SIM_POLICIES[policy]
    args = (tr, 3 * n, np.zeros(0, np.uint8)) + ((None,) if spec.offline else ())
    unclamped = spec.run(*args, index="auto", max_id=int(tr.max()))
    assert simulate(tr, 2**40, policy) == unclamped == n - np.unique(tr).shape[0]


def test_belady_next_use_is_checked():
    """A next_use that is not next_use_of(trace) is refused before the kernel trusts it (a wrong
    one made it write past its arrays: SIGSEGV); the right one changes nothing."""
    from tiered_emb.sim import next_use_of

    tr = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3, 4] * 3)
    n = tr.shape[0]
    assert simulate(tr, 2, "belady", next_use=next_use_of(tr)) == simulate(tr, 2, "belady")
    with pytest.raises(ConfigError, match="next_use"):
        simulate(tr, 2, "belady", next_use=np.full(n, n))  # every id "never again"
    with pytest.raises(ConfigError, match="shape"):
        simulate(tr, 2, "belady", next_use=np.array([1]))  # read past its end before
    # later on the same id each time, yet it skips request 1: pushed a slot twice on a 1-slot stack
    with pytest.raises(ConfigError, match=r"next_use\[0\] is 2"):
        simulate(np.array([7, 7, 7]), 1, "belady", next_use=np.array([2, 3, 3]))
    with pytest.raises(ConfigError, match="belady"):
        simulate(tr, 2, "lru", next_use=next_use_of(tr))
