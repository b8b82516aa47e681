"""The contract every eviction policy keeps, store and simulator alike, in the manner of
cachetools' ``CacheTestMixin``: one suite, run against every entry point that replays a
trace one request at a time.

Entries: the store's policies through :func:`tiered_emb.cache.slots.simulate` (the store's
own kernel) and every policy of :data:`tiered_emb.sim.SIM_POLICIES` through
:func:`tiered_emb.sim.simulate`.  Each has a *rule*: the policy it decides by (a simulator
twin of a store policy has the store policy's rule).  Then: properties every demand-paging
cache has, hand-traced sequences per rule, and each simulator twin against the store's
kernel, request by request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiered_emb.cache import slots
from tiered_emb.cache.policies import POLICIES
from tiered_emb.errors import ConfigError
from tiered_emb.sim import SIM_POLICIES, simulate, zipf_ids


def _ids(trace) -> np.ndarray:
    return np.asarray(trace, dtype=np.int64)


def _flags_by_prefix(hits_of: Callable, trace) -> list[bool]:
    """Hit flags of an entry that only returns a count: request i hits iff the first i + 1
    requests hit once more than the first i (a run is deterministic, so the prefix state is
    the same in both runs)."""
    out, before = [], 0
    for i in range(len(trace)):
        now = hits_of(_ids(trace[: i + 1]))
        assert now - before in (0, 1), (i, before, now)
        out.append(now > before)
        before = now
    return out


@dataclass(frozen=True)
class Entry:
    name: str
    rule: str  # the policy it decides by: lru, lfu, fifo, clock, ...
    hits_of: Callable  # (int64 trace, capacity) -> int
    flags_of: Callable | None  # (int64 trace, capacity) -> uint8 (n,), when it records them

    def hits(self, trace, capacity) -> int:
        return int(self.hits_of(_ids(trace), capacity))

    def flags(self, trace, capacity) -> list[bool]:
        if self.flags_of is None:
            return _flags_by_prefix(lambda t: self.hits_of(t, capacity), trace)
        return [bool(v) for v in self.flags_of(_ids(trace), capacity)]


def _store_entry(policy: str) -> Entry:
    return Entry(f"store:{policy}", policy, lambda t, c: slots.simulate(t, c, policy), None)


def _sim_entry(name: str) -> Entry:
    spec = SIM_POLICIES[name]
    hits_of = lambda t, c: simulate(t, c, name)  # noqa: E731
    # the "-store" entries run the store's kernel, which records no flags
    flags_of = None if name.endswith("-store") else (lambda t, c: simulate(t, c, name, hit_flags=True)[1])
    return Entry(f"sim:{name}", spec.twin or name, hits_of, flags_of)


STORE_POLICIES = sorted(n for n, spec in POLICIES.items() if not spec.lookahead)
ENTRIES = [_store_entry(p) for p in STORE_POLICIES] + [_sim_entry(n) for n in sorted(SIM_POLICIES)]
BY_NAME = {e.name: e for e in ENTRIES}
every_entry = pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])

traces = st.lists(st.integers(0, 9), max_size=60)
capacities = st.integers(1, 6)


def _first_requests(trace) -> list[bool]:
    seen, out = set(), []
    for x in trace:
        out.append(x not in seen)
        seen.add(x)
    return out


# --------------------------------------------------------------------------- every policy
@every_entry
@pytest.mark.parametrize("capacity", [1, 2, 5, 16])
def test_a_full_cache_hits_every_id_it_holds(entry, capacity):
    """``capacity`` distinct ids fill the cache without an eviction; replayed in another
    order, and again, every request hits."""
    ids = list(range(100, 100 + capacity))
    trace = ids + ids[::-1] + ids
    assert entry.flags(trace, capacity) == [False] * capacity + [True] * (2 * capacity)


@every_entry
@settings(max_examples=25, deadline=None)
@given(trace=traces, capacity=capacities)
def test_first_requests_miss_and_hits_are_counted(entry, trace, capacity):
    """Every id misses on its first request (hits <= requests - distinct ids), and the
    count is the number of hit flags."""
    flags = entry.flags(trace, capacity)
    assert len(flags) == len(trace)
    assert not any(f and first for f, first in zip(flags, _first_requests(trace), strict=False))
    assert entry.hits(trace, capacity) == sum(flags) <= len(trace) - len(set(trace))


@every_entry
@settings(max_examples=25, deadline=None)
@given(trace=traces, capacity=capacities)
def test_a_request_repeated_at_once_hits(entry, trace, capacity):
    """A missed id is admitted (demand paging), so the very next request of it hits,
    whatever the capacity (>= 1)."""
    doubled = [x for x in trace for _ in range(2)]
    flags = entry.flags(doubled, capacity)
    assert all(flags[1::2])


@every_entry
@pytest.mark.parametrize("capacity", [1, 3])
def test_one_id_hits_after_its_first_miss(entry, capacity):
    assert entry.flags([7] * 6, capacity) == [False] + [True] * 5


@every_entry
def test_capacity_zero_is_refused(entry):
    """No entry answers for a cache of no object (it could only say "no hit"): a typed error."""
    with pytest.raises(ConfigError):
        entry.hits([1, 1, 2], 0)


@every_entry
def test_an_empty_trace_hits_nothing(entry):
    assert entry.hits([], 3) == 0
    assert entry.flags([], 3) == []


@every_entry
@settings(max_examples=25, deadline=None)
@given(trace=traces)
def test_a_cache_holding_every_id_misses_each_once(entry, trace):
    distinct = len(set(trace))
    for capacity in (max(distinct, 1), distinct + 3):
        assert entry.hits(trace, capacity) == len(trace) - distinct


@every_entry
def test_deterministic_whatever_ran_before(entry):
    """The same trace gives the same flags, run twice and after another trace (the
    simulator reuses its arrays between runs)."""
    a = zipf_ids(40, 0.9, 300, seed=1).tolist()
    b = (zipf_ids(500, 0.7, 300, seed=2) * 3).tolist()
    first = entry.flags(a, 7)
    assert entry.flags(a, 7) == first
    entry.flags(b, 7)
    assert entry.flags(a, 7) == first


@every_entry
@settings(max_examples=25, deadline=None)
@given(trace=traces, capacity=capacities)
def test_no_policy_beats_belady(entry, trace, capacity):
    assert entry.hits(trace, capacity) <= BY_NAME["sim:belady"].hits(trace, capacity)


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.rule in ("lru", "lfu", "fifo", "clock", "sieve")], ids=lambda e: e.name
)
@pytest.mark.parametrize("capacity", [1, 2, 5])
def test_a_cycle_one_longer_than_the_cache_never_hits(entry, capacity):
    """c + 1 ids in a loop: each request's id is the one these policies evicted last (no
    hit ever sets a bit or a count apart, so CLOCK, SIEVE and LFU fall back to FIFO / LRU)."""
    trace = list(range(capacity + 1)) * 5
    assert entry.hits(trace, capacity) == 0


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.rule in ("lru", "belady")], ids=lambda e: e.name)
@settings(max_examples=25, deadline=None)
@given(trace=traces, capacity=st.integers(1, 5))
@example(trace=[1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5], capacity=3)  # FIFO's anomaly: 3 hits, 2 with 4 objects
def test_stack_policies_hit_more_with_more_room(entry, trace, capacity):
    """LRU and Belady are stack algorithms: a larger cache holds a superset, so every hit
    of a smaller cache is a hit of a larger one (FIFO would fail: Belady's anomaly)."""
    smaller = entry.flags(trace, capacity)
    larger = entry.flags(trace, capacity + 1)
    assert all(b for a, b in zip(smaller, larger, strict=False) if a)


# --------------------------------------------------------------------------- hand-traced
# Flags written as strings, one character a request: "H" hit, "." miss.  Each sequence is
# traced in the comments from the policy's own rule.
A = [1, 2, 3, 1, 4, 2, 1, 5, 3, 1]
S = [1, 2, 3, 2, 1, 4, 5, 2, 1]
HAND_TRACED = {
    "lru": [
        # 1 2 3 | 1 hit: order 2 3 1 | 4 evicts 2: 3 1 4 | 2 evicts 3: 1 4 2 | 1 hit: 4 2 1
        # 5 evicts 4: 2 1 5 | 3 evicts 2: 1 5 3 | 1 hit
        (3, A, "...H..H..H"),
        # 2 and 1 hit: order 3 2 1 | 4 evicts 3 | 5 evicts 2 | 2 evicts 1 | 1 evicts 4
        (3, S, "...HH...."),
        # 1 1 2 2 2: order 1 2 | 3 evicts 1 | 1 evicts 2 | 4 evicts 3 | 2 misses
        (2, [1, 1, 2, 2, 2, 3, 1, 4, 2], ".H.HH...."),
    ],
    "lfu": [
        # victim: lowest (count, last use); counts restart at 1 on admission
        # 1 hit (count 2) | 4: 2 and 3 count 1, 2 used last longer ago: evicts 2 | 2: 3 and 4
        # count 1: evicts 3 | 1 hit (3) | 5: 4 and 2 count 1, evicts 4 | 3 evicts 2 | 1 hit
        (3, A, "...H..H..H"),
        # 1 1: count 2 | 2 (1) | 3 evicts 2, the lower count, though 1 is the older | 1 hits
        (2, [1, 1, 2, 3, 1], ".H..H"),
        # 1 (2), 2 (3) | 3 evicts 1 | 1 evicts 3 and restarts at count 1 | 4 evicts 1 (count
        # 1 < 3; had 1 kept its count, 3 = 3 and 2's older use would lose) | 2 hits
        (2, [1, 1, 2, 2, 2, 3, 1, 4, 2], ".H.HH...H"),
        # 1 in slot 0, 2 in slot 1, both count 2; 2's last use is older: 3 evicts 2, not the
        # lower slot | 1 hit | 2 misses.  (Last uses are unique one request at a time, so the
        # final tie-break, the lowest slot, never decides here.)
        (2, [1, 2, 2, 1, 3, 1, 2], "..HH.H."),
    ],
    "fifo": [
        # 1 hit changes nothing | 4 evicts 1 | 2 hit | 1 evicts 2 | 5 evicts 3 | 3 evicts 4 | 1 hit
        (3, A, "...H.H...H"),
        # 2, 1 hit | 4 evicts 1 | 5 evicts 2 | 2 evicts 3 | 1 evicts 4
        (3, S, "...HH...."),
        # 2 and 1 hit, order stays 1 2 | 3 evicts 1 | 2 hits
        (2, [1, 2, 2, 1, 3, 2], "..HH.H"),
    ],
    "clock": [
        # ring 1 2 3, hand at 1 | 1 hit sets its bit | 4: 1's bit cleared, 2 evicted, hand to 3
        # 2 evicts 3, hand to 1 | 1 hit | 5: 1's bit cleared, 4 evicted | 3 evicts 2 | 1 hit
        (3, A, "...H..H..H"),
        # 2, 1 hit: bits set | 4: clears 1 and 2, evicts 3 | 5 evicts 1 (bit clear) | 2 hit
        # 1: clears 2, evicts 4
        (3, S, "...HH..H."),
        # LRU would evict 2 (least recent); CLOCK clears both bits and evicts 1 | 2 hits
        (2, [1, 2, 2, 1, 3, 2], "..HH.H"),
        # 4: clears 1, evicts 2 | 5 evicts 3 | 6: the hand is back at 1, bit clear: evicted
        (3, [1, 2, 3, 1, 4, 5, 6, 1], "...H...."),
    ],
    "sieve": [
        # 1 hit (visited) | 4: hand at 1, clears it, evicts 2, hand stays at 3 | 5 evicts 3
        # (not back to the oldest) | 1 hit
        (3, [1, 2, 3, 1, 4, 5, 1], "...H..H"),
        # 2, 1 visited | 4: clears 1 and 2, evicts 3, hand past the newest | 5: from the
        # oldest, 1 unvisited now: evicted, hand at 2 | 2 hit | 1: clears 2, evicts 4
        (3, S, "...HH..H."),
        # 4: clears 1, evicts 2 | 5 evicts 3 | 6 evicts 4: the hand goes on towards the
        # newest, where CLOCK's returns to 1 | 1 hits
        (3, [1, 2, 3, 1, 4, 5, 6, 1], "...H...H"),
    ],
    "s3fifo": [
        # capacity 2: small 1, main 1, ghost 1.  1 into small | 2: small full before any
        # eviction, into main | 3: small's 1 unused, evicted to the ghost | 1: a ghost, into
        # main; small's 3 evicted (ghost 3) | 2 hit (one use) | 4: main over its share: 2
        # spends its use and goes round, 1 evicted (no ghost from main) | 1: small's 4
        # evicted, ghost full: 3 forgotten | 2 hit
        (2, [1, 2, 3, 1, 2, 4, 1, 2], "....H..H"),
    ],
    "arc": [
        # capacity 2.  1 hit: T2 [1], T1 [2] | 3: |T1| = 1 > p = 0, 2 to B1 | 2: a ghost of
        # B1, p = 1, |T1| = p so T2's 1 to B2; 2 into T2 | 4: T2's 2 to B2 | 1: a ghost of
        # B2, p = 0: T1's 3 to B1; 1 into T2 | 3: a ghost of B1, p = 1: T2's 1 to B2, 3 into
        # T2 | 4 still in T1: a hit
        (2, [1, 2, 1, 3, 2, 4, 1, 3, 4], "..H.....H"),
    ],
    "belady": [
        # 4 at t4: next uses 1 t6, 2 t5, 3 t8: evicts 3 | 2, 1 hit | 5: 2 and 4 never again,
        # one goes | 3 evicts the other | 1 hit
        (3, A, "...H.HH..H"),
        # 4: 3 never again, evicted | 5: 4 never again, evicted | 2, 1 hit
        (3, S, "...HH..HH"),
    ],
}


def _hand(expected: str) -> list[bool]:
    return [c == "H" for c in expected]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.rule in HAND_TRACED], ids=lambda e: e.name)
def test_hand_traced(entry):
    for capacity, trace, expected in HAND_TRACED[entry.rule]:
        assert len(expected) == len(trace)
        assert entry.flags(trace, capacity) == _hand(expected), (capacity, trace, expected)


def test_hand_traces_tell_the_policies_apart():
    """Each rule's traces, run through the other rules, give other flags somewhere: the
    hand traces test the rule, not only what every cache does."""
    for rule, cases in HAND_TRACED.items():
        for other in HAND_TRACED:
            if other != rule:
                entry = BY_NAME[f"sim:{other}"]
                assert any(entry.flags(t, c) != _hand(e) for c, t, e in cases), (rule, other)


# --------------------------------------------------------------------------- twins
TWINS = [n for n, spec in SIM_POLICIES.items() if spec.twin and not n.endswith("-store")]


def test_every_store_policy_has_a_simulator_twin():
    assert sorted(SIM_POLICIES[n].twin for n in TWINS) == STORE_POLICIES


@pytest.mark.parametrize("name", TWINS)
@settings(max_examples=40, deadline=None)
@given(trace=st.lists(st.integers(0, 12), max_size=120), capacity=st.integers(1, 8))
def test_twin_makes_the_store_decisions(name, trace, capacity):
    twin, store = BY_NAME[f"sim:{name}"], BY_NAME[f"store:{SIM_POLICIES[name].twin}"]
    assert twin.flags(trace, capacity) == store.flags(trace, capacity)


@pytest.mark.parametrize("name", TWINS)
def test_twin_equals_the_store_on_zipf(name):
    twin, store = BY_NAME[f"sim:{name}"], BY_NAME[f"store:{SIM_POLICIES[name].twin}"]
    short = zipf_ids(300, 1.0, 400, seed=5).tolist()
    assert twin.flags(short, 20) == store.flags(short, 20)
    for seed, alpha in ((3, 1.0), (4, 0.8)):
        trace = zipf_ids(5000, alpha, 50_000, seed=seed)
        for capacity in (1, 7, 100, 1000):
            assert twin.hits(trace, capacity) == store.hits(trace, capacity), (seed, capacity)
