"""TieredStore's rows through the step API: lookups, writes, the tiers they move through,
peek and stats, and what a reopen reads back."""

import threading

import numpy as np
import pytest
from store_setup import TABLES, cpu

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.testing import faults
from tiered_emb.testing.reference import ReferenceStore


def test_lookup_duplicates_and_lazy_rows(store):
    ref = ReferenceStore(TABLES, seed=3)
    ids = np.array([5, 1, 5, 2**40, 0])
    out = store.lookup("a", ids)
    assert out.shape == (5, 8) and out.dtype == np.float32
    np.testing.assert_array_equal(out, ref.lookup("a", ids))
    assert (out != 0).all()
    # a lookup alone stores nothing in LMDB
    store.checkpoint()
    assert store.stats()["a"]["ssd"]["rows"] == 0


def test_lazy_rows_do_not_depend_on_touch_order(tmp_path):
    ids = np.arange(50)
    with (
        TieredStore.create(tmp_path / "x", TABLES, cpu(3), seed=9) as s1,
        TieredStore.create(tmp_path / "y", TABLES, cpu(64), seed=9) as s2,
    ):
        a = s1.lookup("a", ids[::-1])[::-1]
        b = s2.lookup("a", ids)
        np.testing.assert_array_equal(a, b)
    with TieredStore.create(tmp_path / "z", TABLES, cpu(64), seed=10) as s3:
        assert not np.array_equal(s3.lookup("a", ids), b)


def test_initialisers_have_the_asked_distribution(store):
    w = store.peek("a", np.arange(2000)).ravel()
    assert w.min() >= -0.05 and w.max() < 0.05 and abs(w.mean()) < 0.003
    rows = store.peek("a", np.arange(50))
    assert all(np.unique(r).shape[0] == r.shape[0] for r in rows)  # every element drawn on its own
    v = store.peek("b", np.arange(100)).ravel()
    assert abs(v.std() - 0.1) < 0.02


def test_write_then_read_across_tiers_and_reopen(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "s"
    ref = ReferenceStore(TABLES, seed=0)
    with TieredStore.create(path, TABLES, cpu(3, 2)) as s:
        for _ in range(20):
            ids = rng.integers(0, 30, size=7)
            rows = rng.standard_normal((7, 8)).astype(np.float32)
            s.write("a", ids, rows)
            ref.write("a", ids, rows)
            q = rng.integers(0, 30, size=9)
            np.testing.assert_array_equal(s.lookup("a", q), ref.lookup("a", q))
    with TieredStore.open(path, tiers=cpu(50, 0, policy="lfu")) as s:
        np.testing.assert_array_equal(s.lookup("a", np.arange(30)), ref.lookup("a", np.arange(30)))


def test_write_duplicates_last_wins(store):
    store.write("a", np.array([4, 4]), np.stack([np.zeros(8), np.ones(8)]).astype(np.float32))
    np.testing.assert_array_equal(store.peek("a", np.array([4])), np.ones((1, 8), np.float32))


@pytest.mark.parametrize("background", [True, False])
def test_a_bulk_write_keeps_the_rows_given_whatever_the_caller_does_next(tmp_path, background):
    """A bulk write of distinct ids (more than HBM holds: most go straight to LMDB, on the
    writer thread with background writes) keeps the values the caller passed, not what the
    caller's array holds after ``write`` returns.  With background writes, the writer
    thread's transaction is held until the caller has overwritten its array."""
    tiers = TierConfig(hbm_rows=4, ddr_rows=2, device="cpu", background_writes=background)
    with TieredStore.create(tmp_path / "s", TABLES, tiers) as s:
        go = faults.hold_background_puts(s)
        for table, dim in (("a", 8), ("b", 3)):  # (with optimizer state, and rows alone)
            given = np.arange(64 * dim, dtype=np.float32).reshape(64, dim)
            s.write(table, np.arange(64), given)
            given[:] = -1.0  # (the write is still in flight on the writer thread)
            want = np.arange(64 * dim, dtype=np.float32).reshape(64, dim)
            np.testing.assert_array_equal(s.peek(table, np.arange(64)), want)
            go.set()
            s.flush()
            go.clear()
            np.testing.assert_array_equal(s.peek(table, np.arange(64)), want)
    with TieredStore.open(tmp_path / "s", tiers=tiers) as s:
        for table, dim in (("a", 8), ("b", 3)):
            want = np.arange(64 * dim, dtype=np.float32).reshape(64, dim)
            np.testing.assert_array_equal(s.peek(table, np.arange(64)), want)


def test_a_bulk_write_behind_one_in_flight_is_newer_than_the_write_backs_waiting(tmp_path):
    """A bulk write made while the one before is still committing is cut and encoded at
    once; a write-back that waited meanwhile (an evicted row of an id the bulk write then
    sets) must still read, and reopen, older than the bulk write's row."""
    tiers = TierConfig(hbm_rows=4, ddr_rows=0, device="cpu", background_writes=True)
    with TieredStore.create(tmp_path / "s", TABLES, tiers) as s:
        go = faults.hold_background_puts(s)
        s.engine.ssd.writeback_rows = 1 << 16  # (evicted rows wait in memory)
        s.write("b", np.arange(16), np.full((16, 3), 1.0, np.float32))  # in flight, held
        s.write("b", np.array([50, 51]), np.full((2, 3), 2.0, np.float32))
        s.write("b", np.array([60, 61, 62, 63]), np.full((4, 3), 3.0, np.float32))  # 50, 51 evicted: waiting
        assert s.stats()["b"]["ssd"]["writeback_rows"] >= 16 + 2  # (the bulk write in flight, and 50, 51)
        threading.Timer(0.3, go.set).start()
        s.write("b", np.arange(40, 56), np.full((16, 3), 4.0, np.float32))  # newer than the 2.0s
        np.testing.assert_array_equal(s.peek("b", np.array([50, 51, 0])), [[4.0] * 3, [4.0] * 3, [1.0] * 3])
        s.flush()
    with TieredStore.open(tmp_path / "s", tiers=tiers) as s:
        np.testing.assert_array_equal(s.peek("b", np.array([50, 51, 0, 60])), [[4.0] * 3] * 2 + [[1.0] * 3, [3.0] * 3])


def test_spill_path_batch_larger_than_hbm_is_exact(tmp_path):
    ref = ReferenceStore(TABLES, seed=1)
    with TieredStore.create(tmp_path / "s", TABLES, cpu(4, 3), seed=1) as s:
        ids = np.array([9, 3, 7, 3, 11, 12, 13, 14, 15, 9, 1, 2])
        g = np.linspace(-1, 1, ids.shape[0] * 8, dtype=np.float32).reshape(-1, 8)
        s.apply_gradients("a", ids, g)
        ref.apply_gradients("a", ids, g)
        out = s.lookup("a", ids)
        np.testing.assert_array_equal(out, ref.lookup("a", ids))
        np.testing.assert_array_equal(s.peek("a", ids, with_state=True), ref.peek_records("a", ids))
        assert s.stats()["a"]["hbm"]["rows"] == 4


def test_peek_leaves_cache_state_alone(store):
    store.lookup("a", np.array([1, 2, 3]))
    before = store.stats()
    store.peek("a", np.array([1, 50, 60]))
    assert store.stats() == before


def test_stats_count_tiers(store):
    store.lookup("a", np.arange(10))  # 10 misses into HBM(4) -> DDR(4) -> 2 dropped (clean)
    s = store.stats()["a"]
    assert s["hbm"]["lookups"] == 10 and s["hbm"]["misses"] == 10 and s["hbm"]["rows"] == 4
    assert s["ddr"]["rows"] == 4 and s["ssd"]["lazy_inits"] == 10
    store.lookup("a", np.array([9]))
    assert store.stats()["a"]["hbm"]["hits"] == 1


def test_table_ten_times_larger_than_hbm_plus_ddr_lives_in_lmdb(tmp_path):
    path = tmp_path / "big"
    cfg = [TableConfig("t", dim=16, optimizer=RowWiseAdagrad(lr=0.05))]
    n = 10 * (32 + 64) + 40
    ids = np.arange(n)
    with TieredStore.create(path, cfg, cpu(32, 64)) as s:
        for start in range(0, n, 100):
            b = ids[start : start + 100]
            s.apply_gradients("t", b, np.full((b.shape[0], 16), 0.5, np.float32))
        s.checkpoint()
        st = s.stats()["t"]
        assert st["ssd"]["rows"] >= n - 32 - 64
        assert st["ssd"]["writebacks"] >= n - 32 - 64
        expected = s.peek("t", ids, with_state=True)
    data = (path / "lmdb" / "data.mdb").stat().st_size
    assert data >= (n - 96) * 17 * 4
    with TieredStore.open(path, tiers=cpu(8, 8)) as s:
        np.testing.assert_array_equal(s.peek("t", ids, with_state=True), expected)
        assert s.stats()["t"]["hbm"]["rows"] == 0
        np.testing.assert_array_equal(s.lookup("t", ids), expected[:, :16])


def test_compression_round_trips_and_can_change_on_open(tmp_path):
    path = tmp_path / "z"
    with TieredStore.create(path, TABLES, cpu(2, 0, ssd_compression=3)) as s:
        s.write("a", np.arange(10), np.tile(np.arange(8, dtype=np.float32), (10, 1)))
    with TieredStore.open(path, tiers=cpu(2, 0)) as s:
        np.testing.assert_array_equal(s.peek("a", np.arange(10)), np.tile(np.arange(8, dtype=np.float32), (10, 1)))
        s.write("a", np.array([11]), np.ones((1, 8), np.float32))
    with TieredStore.open(path, tiers=cpu(2, 0, ssd_compression=9)) as s:
        assert s.peek("a", np.array([11, 3]))[1, 7] == 7


def test_lmdb_map_grows_by_itself(tmp_path):
    cfg = [TableConfig("t", dim=256)]
    with TieredStore.create(tmp_path / "m", cfg, cpu(1, 0, map_size_bytes=1 << 20)) as s:
        s.write("t", np.arange(3000), np.ones((3000, 256), np.float32))  # ~3 MB > 1 MiB map
        s.checkpoint()
        assert s.peek("t", np.array([2999]))[0, 0] == 1


@pytest.mark.parametrize("hbm", [3, 40, 64])  # evicting; holding the batch; holding the table (direct)
def test_padded_hbm_rows_are_invisible(tmp_path, hbm):
    """Widths whose HBM rows are padded to whole 64-byte lines (129 -> 144, 120 -> 128
    floats) and one that is not (Adam, 22): every row and state against the reference,
    across evictions, checkpoint and reopen."""
    from tiered_emb import Adam

    tables = [
        TableConfig("r", dim=128, num_rows=64, optimizer=RowWiseAdagrad(lr=0.1)),
        TableConfig("s", dim=120, num_rows=64, optimizer=SGD(lr=0.5)),
        TableConfig("a", dim=7, num_rows=64, optimizer=Adam(lr=0.05)),
    ]
    ref = ReferenceStore(tables, seed=3)
    rng = np.random.default_rng(0)
    path = tmp_path / "s"
    s = TieredStore.create(path, tables, cpu(hbm, 4), seed=3)
    assert [s.engine.table(n).hbm.records.shape[1] for n in "rsa"] == [144, 128, 22]
    for step in range(6):
        for t in tables:
            ids = rng.integers(0, 64, 30)
            np.testing.assert_array_equal(s.lookup(t.name, ids), ref.lookup(t.name, ids))
            g = rng.standard_normal((30, t.dim)).astype(np.float32)
            s.apply_gradients(t.name, ids, g)
            ref.apply_gradients(t.name, ids, g)
        if step == 3:
            s.checkpoint()
            s.close()
            s = TieredStore.open(path, tiers=cpu(67 - hbm, 4))
    for t in tables:
        assert s.peek(t.name, np.arange(64), with_state=True).tobytes() == ref.peek_records(t.name, range(64)).tobytes()
    s.close()


def test_rows_never_written_are_not_looked_up(tmp_path):
    """Table "b" (num_rows) keeps a bitmap of the ids written below DDR: the rest go
    straight to the initialiser, before and after a reopen, with the reference's values."""
    rng = np.random.default_rng(1)
    ref = ReferenceStore(TABLES, seed=0)
    path = tmp_path / "s"
    written = set()
    with TieredStore.create(path, TABLES, cpu(2, 2)) as s:
        asked = faults.lmdb_reads(s)
        for _ in range(30):
            ids = rng.integers(0, 100, size=5)
            rows = rng.standard_normal((5, 3)).astype(np.float32)
            s.write("b", ids, rows)
            ref.write("b", ids, rows)
            written |= set(ids.tolist())
            q = rng.integers(0, 100, size=6)
            np.testing.assert_array_equal(s.lookup("b", q), ref.lookup("b", q))
            if rng.integers(0, 7) == 0:
                s.flush()
        assert asked and {i for t, i in asked if t == "b"} <= written
        s.checkpoint()
    with TieredStore.open(path, tiers=cpu(3, 1)) as s:
        asked = faults.lmdb_reads(s)
        np.testing.assert_array_equal(s.lookup("b", np.arange(100)), ref.lookup("b", np.arange(100)))
        assert {i for _, i in asked} <= written and len(asked) > 0
        # a table without num_rows has no bitmap: every id it misses is looked for
        s.lookup("a", np.array([5, 6, 7]))
        assert {("a", 5), ("a", 6), ("a", 7)} <= set(asked)


def test_peek_of_a_repeated_id_held_only_in_lmdb(tmp_path):
    with TieredStore.create(tmp_path / "s", TABLES, cpu(4, 4), seed=3) as s:
        s.write("a", np.array([0]), np.full((1, 8), 2.0, np.float32))
    with TieredStore.open(tmp_path / "s") as s:
        got = s.peek("a", np.array([0, 7, 0]), with_state=True)
        np.testing.assert_array_equal(got[0], got[2])
        assert (got[0, :8] == 2.0).all()


def test_lazy_rows_depend_on_the_table_name(tmp_path):
    tables = [TableConfig("x", dim=8), TableConfig("y", dim=8)]
    with TieredStore.create(tmp_path / "s", tables, cpu(4), seed=3) as s:
        x, y = s.peek("x", np.arange(20)), s.peek("y", np.arange(20))
    assert not (x == y).all(axis=1).any()
