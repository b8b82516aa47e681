"""The simulator's lookahead: the store's own decisions, and windowed Belady against a plain reference."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_emb import TableConfig, TierConfig, TieredStore
from tiered_emb.errors import ConfigError, IdRangeError
from tiered_emb.sim.engine import simulate
from tiered_emb.sim.lookahead import batch_uniques, store_hits, window_belady_hits
from tiered_emb.sim.traces import zipf_ids

POLICIES = ["lru", "lfu", "sieve", "clock", "lookahead+lru", "lookahead+lfu", "lookahead+sieve"]


def drive_store(tmp_path, trace, batch, hbm, ddr, policy, window, load):
    """A real store stepped as lookahead() steps it, the worker finishing each ticket before the step."""
    store = TieredStore.create(
        tmp_path / f"s_{policy}_{window}_{load}",
        [TableConfig("t", dim=2)],
        TierConfig(hbm_rows=hbm, ddr_rows=ddr, policy=policy, device="cpu"),
    )
    batches = [trace[i : i + batch] for i in range(0, trace.shape[0], batch)]
    tickets = {}
    for t in range(-window, len(batches)):
        if window and t + window < len(batches):
            tickets[t + window] = store.prefetch({"t": batches[t + window]}, bring_up=False)
            tickets[t + window].wait_entered()  # as lookahead() does without load-ahead
        if load and 0 <= t + load < len(batches):
            store.engine.bring_up(tickets[t + load])
            tickets[t + load].wait()
        if t >= 0:
            store.lookup("t", batches[t])
            if window:
                store.release(tickets.pop(t))
    s = store.stats()["t"]
    store.close()
    misses = s["hbm"]["lookups"] - s["hbm"]["hits"] + s["prefetch"]["hbm"]["lookups"] - s["prefetch"]["hbm"]["hits"]
    return misses, s["ddr"]["hits"] + s["prefetch"]["ddr"]["hits"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("window,load", [(0, 0), (1, 1), (3, 0), (3, 1), (3, 3)])
def test_store_hits_are_the_stores_decisions(tmp_path, policy, window, load):
    trace = zipf_ids(300, 1.0, 1500, seed=window + 7)
    u, off = batch_uniques(trace, 25)
    sim = store_hits(u, off, 64, policy, window, ddr_rows=40, load_ahead=load)
    misses, ddr_hits = drive_store(tmp_path, trace, 25, 64, 40, policy, window, load)
    assert sim.lookups - sim.hbm_hits == misses
    assert sim.ddr_hits == ddr_hits
    assert 0 < sim.hbm_hits < sim.lookups


def test_batch_uniques_dedupes_each_batch():
    trace = np.array([4, 4, 1, 2, 2, 2, 9])
    u, off = batch_uniques(trace, 3)
    assert off.tolist() == [0, 2, 3, 4]
    assert u.tolist() == [4, 1, 2, 9]


def reference_window_belady(trace, batch, capacity, window, ties="lru"):
    """Plain Python: batches of unique ids; victims by next use within the window, else by ``ties``."""
    batches = []
    for i in range(0, len(trace), batch):
        seen = []
        for x in trace[i : i + batch]:
            if x not in seen:
                seen.append(x)
        batches.append(seen)
    stream = [(b, x) for b, bat in enumerate(batches) for x in bat]
    resident, last, count, hits = set(), {}, {}, 0
    for pos, (b, x) in enumerate(stream):
        if x in resident:
            hits += 1
            count[x] += 1
        else:
            if len(resident) == capacity:
                held = set(batches[b])
                horizon = b + window

                def order(y, pos=pos, horizon=horizon):
                    nxt = next(
                        (q for q in range(pos, len(stream)) if stream[q][1] == y and stream[q][0] <= horizon), None
                    )
                    if nxt is not None:
                        return (0, 0, nxt)
                    return (1, -count[y], -last[y]) if ties == "lfu" else (1, 0, -last[y])

                victim = max((y for y in resident if y not in held), key=order)
                resident.remove(victim)
            resident.add(x)
            count[x] = 1
        last[x] = pos
    return hits


@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=60),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(0, 4),
    st.sampled_from(["lru", "lfu"]),
)
def test_window_belady_matches_reference(trace, batch, window, extra, ties):
    capacity = batch + extra  # a batch always fits
    t = np.array(trace, dtype=np.int64)
    u, off = batch_uniques(t, batch)
    assert window_belady_hits(u, off, capacity, window, ties) == reference_window_belady(
        trace, batch, capacity, window, ties
    )


@pytest.mark.parametrize("ties", ["lru", "lfu"])
def test_window_belady_matches_reference_on_a_longer_trace(ties):
    trace = zipf_ids(300, 0.9, 1500, seed=3)
    u, off = batch_uniques(trace, 20)
    for window in (0, 1, 4):
        assert window_belady_hits(u, off, 60, window, ties) == reference_window_belady(
            trace.tolist(), 20, 60, window, ties
        )


@given(st.lists(st.integers(0, 20), min_size=1, max_size=80), st.integers(1, 5), st.integers(0, 4), st.integers(0, 6))
def test_no_policy_beats_full_belady(trace, batch, window, extra):
    capacity = max(2, batch + extra)
    u, off = batch_uniques(np.array(trace, dtype=np.int64), batch)
    best = simulate(u, capacity, "belady")
    assert window_belady_hits(u, off, capacity, window) <= best
    for policy in POLICIES:
        assert store_hits(u, off, capacity, policy, window).hbm_hits <= best


def test_windowed_belady_gains_with_the_window():
    u, off = batch_uniques(zipf_ids(2000, 0.9, 20000, seed=3), 50)
    hits = [window_belady_hits(u, off, 200, w) for w in (0, 2, 8)]
    assert hits[0] < hits[1] < hits[2] <= simulate(u, 200, "belady")


def test_bad_arguments_are_typed_errors():
    u, off = batch_uniques(np.arange(10), 5)
    with pytest.raises(ConfigError):
        store_hits(u, off, 4, "nope")
    with pytest.raises(ConfigError):
        window_belady_hits(u, off, 3, 1)  # a batch of 5 unique ids in 3 rows
    with pytest.raises(ConfigError):
        batch_uniques(np.arange(4), 0)


def test_bench_lookahead_cli(tmp_path, capsys):
    import json

    from tiered_emb.cli import main

    out = tmp_path / "la.json"
    assert (
        main(
            [
                "bench",
                "lookahead",
                "--trace",
                "zipf:0.9",
                "--ids",
                "20k",
                "--requests",
                "40k",
                "--cache",
                "5%",
                "--step-requests",
                "64",
                "--window",
                "3",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["results"]
    rate = {r["policy"]: r["hit_ratio"] for r in rows}
    assert rate["belady (full)"] >= max(rate.values())  # nothing beats full Belady
    assert rate["lookahead+lru k=3 L=0"] >= rate["lru"]
    assert "window belady k=3 (lfu ties)" in capsys.readouterr().out


def test_negative_ids_and_bad_batches_are_refused():
    """-1 is the empty key of the dedupe table and of the tiers' index: it was dropped from its
    batch, or hit an empty bucket, silently."""
    with pytest.raises(IdRangeError, match=">= 0"):
        batch_uniques(np.array([-1, 5, 7, -1]), 1)
    u, off = np.array([-1, 5, 7, -1]), np.array([0, 1, 2, 3, 4])
    with pytest.raises(IdRangeError, match=">= 0"):
        window_belady_hits(u, off, 2, 1)
    with pytest.raises(IdRangeError, match=">= 0"):
        store_hits(u, off, 2, "lookahead+lru", 1)
    u = np.array([1, 2, 3, 4])
    with pytest.raises(ConfigError, match="does not cut"):
        store_hits(u, np.array([0, 3, 2, 4]), 2, "lru")
    with pytest.raises(ConfigError, match="does not cut"):
        window_belady_hits(u, np.array([0, 2]), 2, 1)
    with pytest.raises(ConfigError, match="batch 1 repeats an id"):
        store_hits(np.array([1, 2, 3, 3]), np.array([0, 2, 4]), 2, "lru")
    with pytest.raises(ConfigError, match="not an integer"):
        window_belady_hits(u, np.array([0, 2, 4]), 2.5, 1)


def test_huge_tiers_run_as_tiers_that_hold_everything(tmp_path):
    """2**40 rows were a MemoryError (16 TiB); a tier that holds every id of the run makes the
    same decisions whatever its size, so the counts are those of the kernels at any large size."""
    from tiered_emb.cache.policies import POLICIES
    from tiered_emb.cache.slots import CacheTier
    from tiered_emb.sim import lookahead as la

    trace = zipf_ids(300, 1.0, 1500, seed=4)
    u, off = batch_uniques(trace, 25)
    assert window_belady_hits(u, off, 2**40, 2) == window_belady_hits(u, off, u.shape[0], 2)
    for policy in ("lru", "lookahead+lfu"):
        big = 5 * u.shape[0] + 40  # above the size store_hits allocates
        counts = np.zeros((off.shape[0] - 1, 3), dtype=np.int64)
        hbm, ddr = CacheTier(big, policy), CacheTier(big, policy)
        assert (
            la._store_lookahead(
                hbm.tag,
                hbm.state,
                ddr.state,
                np.full(big, -1, dtype=np.int32),
                POLICIES[policy].lookahead,
                3,
                1,
                u,
                off,
                counts,
            )
            == 0
        )
        got = store_hits(u, off, 2**40, policy, 3, ddr_rows=2**40, load_ahead=1)
        assert (got.lookups, got.lookups - got.hbm_hits, got.ddr_hits) == tuple(counts.sum(axis=0))
