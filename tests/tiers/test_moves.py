"""Rows moving between tiers: the row copies, DDR's admit as decisions then copies, the
resolve's helper thread, and the parts ``stats()`` times."""

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb._jit import kernel, move_rows, one_thread
from tiered_emb.cache.policies import BASE_POLICIES
from tiered_emb.sim.traces import zipf_ids
from tiered_emb.step.resolve import MOVE_PARTS
from tiered_emb.tiers import DdrTier


def test_move_rows_matches_numpy_indexing():
    rng = np.random.default_rng(0)
    src = rng.normal(size=(50, 7)).astype(np.float32)
    dst = np.zeros((40, 9), dtype=np.float32)  # padded: only the first 7 columns are rows
    src_at = rng.permutation(50)[:30]
    dst_at = rng.permutation(40)[:30]
    dst_at[::4] = -1  # skipped
    want = dst.copy()
    keep = dst_at >= 0
    want[dst_at[keep], :7] = src[src_at[keep]]
    move_rows(src, src_at, dst, dst_at, 7)
    assert np.array_equal(dst, want)
    # a gather (no destinations: dst[i]) and a scatter (no sources: src[i])
    out = np.empty((30, 7), dtype=np.float32)
    move_rows(src, src_at, out, None, 7)
    assert np.array_equal(out, src[src_at])
    into = np.zeros((60, 7), dtype=np.float32)
    at = rng.permutation(60)[:50]
    move_rows(src, None, into, at, 7)
    assert np.array_equal(into[at], src)


@pytest.mark.parametrize("one", [False, True])
def test_a_threaded_move_is_the_serial_one(one):
    """A move large enough to be cut over the threads copies what NumPy's indexing does,
    on one thread or on all, every skipped destination left as it was."""
    rng = np.random.default_rng(1)
    src = rng.normal(size=(30_000, 21)).astype(np.float32)
    dst = rng.normal(size=(25_000, 24)).astype(np.float32)
    src_at = rng.permutation(30_000)[:20_000]
    dst_at = rng.permutation(25_000)[:20_000]
    dst_at[::7] = -1
    assert src_at.shape[0] * 21 >= 1 << 16  # (the threaded path, not the serial one)
    want = dst.copy()
    keep = dst_at >= 0
    want[dst_at[keep], :21] = src[src_at[keep]]
    with one_thread(one):
        move_rows(src, src_at, dst, dst_at, 21)
    assert np.array_equal(dst, want)


def test_a_kernel_that_makes_an_array_does_not_compile():
    """``kernel`` compiles without reference counts; Numba must refuse what would need
    them (an array made, or a view of one returned), not run it unsafely."""

    @kernel
    def makes(n):
        return np.zeros(n)

    @kernel
    def returns_a_view(a):
        return a[1:]

    @kernel
    def writes(a, n):
        for i in range(n):
            a[i] = i
        return n

    with pytest.raises(numba.core.errors.TypingError):
        makes(3)
    with pytest.raises(numba.core.errors.TypingError):
        returns_a_view(np.zeros(3))
    a = np.zeros(4)
    assert writes(a, 4) == 4 and a.tolist() == [0.0, 1.0, 2.0, 3.0]


def _row(i: int, width: int) -> np.ndarray:
    return np.full(width, float(i), dtype=np.float32) + np.arange(width, dtype=np.float32) / 100


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(BASE_POLICIES),
    cap=st.integers(0, 6),
    history=st.lists(st.integers(0, 30), max_size=40),
    incoming=st.lists(st.integers(100, 140), min_size=1, max_size=12, unique=True),
    dirty_bits=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_admit_keeps_or_pushes_out_every_row_whole(policy, cap, history, incoming, dirty_bits):
    """Whatever the policy and its state, after an admit each row (held before or incoming)
    is either held with its own record and flag, or pushed out: a dirty one exactly once
    with its record, a clean one not at all.  Capacity smaller than the admit included:
    then an incoming row is pushed out again within the same call."""
    width = 3
    d = DdrTier(cap, width, policy)
    flags = {}
    for i in history:  # admits and takes in some order: LFU counts and LRU order differ
        if d.find(np.array([i]))[0] >= 0:
            out = np.empty((1, width), dtype=np.float32)
            d.take(np.array([i]), out, np.empty(1, dtype=np.uint8))
            flags.pop(i, None)
            continue
        f = np.array([i % 2], dtype=np.uint8)
        ev_ids, _, _ = d.admit(np.array([i]), _row(i, width)[None], f)
        for e in ev_ids.tolist():
            flags.pop(e, None)
        flags = {k: v for k, v in flags.items() if d.find(np.array([k]))[0] >= 0}
        if d.find(np.array([i]))[0] >= 0:
            flags[i] = int(f[0])
    held_before = dict(flags)
    ids = np.array(incoming, dtype=np.int64)
    rows = np.stack([_row(i, width) for i in incoming])
    dirty = np.array(dirty_bits[: len(incoming)], dtype=np.uint8)
    ev_ids, ev_rows, n_ev = d.admit(ids, rows, dirty)
    pushed = {int(i): ev_rows[j].copy() for j, i in enumerate(ev_ids.tolist())}
    assert len(pushed) == ev_ids.shape[0]  # each row at most once
    everyone = held_before | {i: int(f) for i, f in zip(incoming, dirty.tolist(), strict=True)}
    gone = 0
    for i, flag in everyone.items():
        s = d.find(np.array([i]))[0]
        if s >= 0:
            assert np.array_equal(d.records[s], _row(i, width))
            assert d.dirty[s] == flag
            assert i not in pushed
        else:
            gone += 1
            if flag:
                assert np.array_equal(pushed[i], _row(i, width))
            else:
                assert i not in pushed
    assert gone == n_ev
    assert d.resident_rows == min(cap, len(everyone))


def _train(path, hbm_rows, ddr_rows, policy, steps=4):
    cfg = TableConfig("t", dim=16, num_rows=60_000, optimizer=RowWiseAdagrad(lr=0.1))
    with TieredStore.create(path, [cfg], TierConfig(hbm_rows, ddr_rows, policy, "cpu"), seed=5) as s:
        for step in range(steps):
            ids = zipf_ids(60_000, 0.8, 30_000, seed=step)
            rows = s.lookup("t", ids)
            s.apply_gradients("t", ids, np.cos(rows) + np.float32(0.1 * step))
        stats = s.stats()["t"]
        return s.peek("t", np.arange(60_000), with_state=True), stats


@pytest.mark.parametrize("policy", BASE_POLICIES)
def test_large_moves_on_the_helper_thread_equal_a_resident_table(tmp_path, policy):
    """Thousands of rows a chunk move up and down (the take and the admit decided on the
    resolve's helper thread): every row and state byte for byte as with the table resident."""
    want, _ = _train(tmp_path / "resident", 60_000, 0, policy)
    got, stats = _train(tmp_path / "tiered", 12_000, 20_000, policy)
    assert stats["moves"]["ddr_up"]["rows"] >= 4096 and stats["moves"]["write_back"]["rows"] > 0
    assert got.tobytes() == want.tobytes()


def test_moves_count_the_rows_the_tiers_count(tmp_path):
    _, s = _train(tmp_path / "s", 12_000, 20_000, "lru")
    m = s["moves"]
    assert set(m) == set(MOVE_PARTS)
    assert m["ddr_up"]["rows"] == s["ddr"]["hits"]
    assert m["hbm_victims"]["rows"] == s["hbm"]["evictions"] == m["ddr_down"]["rows"]
    assert m["ssd_read"]["rows"] + m["init"]["rows"] == m["below_up"]["rows"] == s["ddr"]["misses"]
    assert m["write_back"]["rows"] == s["ddr"]["writebacks"]
    width_bytes = 4 * 17
    assert m["ddr_up"]["bytes"] == width_bytes * m["ddr_up"]["rows"]
    assert all(p["seconds"] >= 0 for p in m.values()) and m["ddr_up"]["seconds"] > 0


def _tiers_state(s: TieredStore, ids: np.ndarray) -> tuple:
    """Where each of ``ids`` is held (HBM, DDR) and every counter but the lookups' own."""
    with s.engine.lock:
        t = s.engine.table("t")
        held = (t.hbm.find(ids).tobytes(), t.ddr.find(ids).tobytes())
    stats = s.stats()["t"]
    return held, {
        tier: (stats[tier]["rows"], stats[tier]["evictions"], stats[tier]["writebacks"]) for tier in ("hbm", "ddr")
    }


@pytest.mark.parametrize("device_rows", [(50, 80), (0, 0), (400, 0)])
def test_a_lookup_that_does_not_admit_reads_rows_where_they_are(tmp_path, device_rows):
    """``lookup(admit=False)``: the rows ``lookup`` gives, byte for byte (from HBM, DDR, LMDB
    and the initialiser, duplicates too), with no row moved and the caches as they were; it
    counts its lookups and hits per tier."""
    hbm_rows, ddr_rows = device_rows
    cfg = TableConfig("t", dim=6, num_rows=400, optimizer=RowWiseAdagrad(lr=0.1))
    rng = np.random.default_rng(1)
    with TieredStore.create(
        tmp_path / "s", [cfg], TierConfig(hbm_rows=max(hbm_rows, 1), ddr_rows=ddr_rows, device="cpu"), seed=5
    ) as s:
        for step in range(12):
            ids = rng.integers(0, 300, 60)
            s.lookup("t", ids)
            s.apply_gradients("t", ids, rng.normal(size=(60, 6)).astype(np.float32))
            if step == 5:
                s.checkpoint()
        ids = np.concatenate([rng.integers(0, 400, 200), [399, 399, 0]])  # never written ones too
        before = _tiers_state(s, np.arange(400))
        stats0 = s.stats()["t"]
        got = s.lookup("t", ids, admit=False)
        stats1 = s.stats()["t"]
        assert _tiers_state(s, np.arange(400)) == before
        n = np.unique(ids).shape[0]
        assert stats1["hbm"]["lookups"] - stats0["hbm"]["lookups"] == n
        asked = {tier: stats1[tier]["lookups"] - stats0[tier]["lookups"] for tier in ("hbm", "ddr", "ssd")}
        hits = {tier: stats1[tier]["hits"] - stats0[tier]["hits"] for tier in ("hbm", "ddr", "ssd")}
        assert asked["ddr"] == n - hits["hbm"] and asked["ssd"] == asked["ddr"] - hits["ddr"]
        assert got.dtype == np.float32 and got.shape == (ids.shape[0], 6) and got.flags.c_contiguous
        assert got.tobytes() == s.peek("t", ids).tobytes() == s.lookup("t", ids).tobytes()
        assert s.lookup("t", ids[:0], admit=False).shape == (0, 6)


def test_the_write_back_buffer_does_not_grow_again_each_cycle():
    """Each write-back buffer starts as large as the last one grew to: a cycle of the same
    puts (the last crossing the write-back threshold) grows it once, the next not at all,
    and every row reads back as put."""
    import threading

    from tiered_emb.tiers.ssd.held import HeldRows

    held = HeldRows({"t": 3}, threading.Lock())
    rng = np.random.default_rng(4)
    caps = []
    for _cycle in range(3):
        before = held.writeback["t"].capacity
        for _ in range(3):
            ids = rng.choice(1 << 40, 3000, replace=False)
            rows = rng.normal(size=(3000, 3)).astype(np.float32)
            held.put("t", ids, rows)
            out, state = np.zeros_like(rows), np.zeros(3000, dtype=np.uint8)
            held.get("t", ids, out, state)
            assert state.all() and out.tobytes() == rows.tobytes()
        caps.append((before, held.writeback["t"].capacity))
        held.waiting()
        held.committed()
    assert caps[0][1] > caps[0][0]  # the first cycle grew from the default
    assert caps[1][0] == caps[0][1] and caps[2] == (caps[1][1], caps[1][1])  # then never again


def test_a_committed_write_back_buffer_is_used_again_empty():
    """The buffer of a snapshot that reached LMDB becomes its table's next buffer, emptied
    (its memory in use already); a snapshot still being written is never reused, and its
    rows read as put until it commits."""
    import threading

    from tiered_emb.tiers.ssd.held import HeldRows

    held = HeldRows({"t": 3}, threading.Lock())
    rng = np.random.default_rng(5)

    def put():
        ids = rng.choice(1 << 40, 3000, replace=False)
        rows = rng.normal(size=(3000, 3)).astype(np.float32)
        held.put("t", ids, rows)
        return ids, rows

    def reads(ids):
        out, state = np.zeros((ids.shape[0], 3), np.float32), np.zeros(ids.shape[0], dtype=np.uint8)
        held.get("t", ids, out, state)
        return out, state

    old_ids, _ = put()
    first = held.writeback["t"]
    first_snap = held.waiting()[-1]
    second = held.writeback["t"]
    new_ids, new_rows = put()
    held.waiting()
    assert held.writeback["t"] is not first and held.writeback["t"] is not second  # both being written
    held.committed([first_snap])
    third_ids, third_rows = put()
    held.waiting()
    assert held.writeback["t"] is first and len(first) == 0
    assert not reads(old_ids)[1].any()  # committed: no longer on the read path, nor in the reused buffer
    for ids, rows in ((new_ids, new_rows), (third_ids, third_rows)):  # those still waiting read as put
        out, state = reads(ids)
        assert state.all() and out.tobytes() == rows.tobytes()
    again_ids, again_rows = put()
    out, state = reads(again_ids)
    assert state.all() and out.tobytes() == again_rows.tobytes() and len(first) == 3000
