"""TieredStore: the step API, tiers, durability and every typed error."""

import json
import sys
import threading

import numpy as np
import pytest

from tiered_emb import SGD, Normal, RowWiseAdagrad, TableConfig, TierConfig, TieredStore, Uniform
from tiered_emb.errors import (
    ConfigError,
    CorruptStoreError,
    DeviceError,
    IdRangeError,
    IdTypeError,
    NonFiniteGradientError,
    RowDtypeError,
    RowShapeError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
    TieredEmbError,
    UnknownTableError,
)
from tiered_emb.testing import crash
from tiered_emb.testing.reference import ReferenceStore

TABLES = [
    TableConfig("a", dim=8, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=3, num_rows=100, init=Normal(std=0.1), optimizer=SGD(lr=0.5)),
]


def cpu(hbm, ddr=0, **kw):
    return TierConfig(hbm_rows=hbm, ddr_rows=ddr, device="cpu", **kw)


@pytest.fixture
def store(tmp_path):
    s = TieredStore.create(tmp_path / "s", TABLES, cpu(4, 4), seed=3)
    yield s
    s.close()


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


def _hold_writer_thread(monkeypatch) -> threading.Event:
    """Make every transaction put off the main thread wait until the returned event is set."""
    from tiered_emb.tiers.ssd.segments import SegmentLog

    go = threading.Event()
    put = SegmentLog.put

    def held_put(self, txn, segments):
        if threading.current_thread() is not threading.main_thread():
            assert go.wait(10)
        put(self, txn, segments)

    monkeypatch.setattr(SegmentLog, "put", held_put)
    return go


@pytest.mark.parametrize("background", [True, False])
def test_a_bulk_write_keeps_the_rows_given_whatever_the_caller_does_next(tmp_path, monkeypatch, background):
    """A bulk write of distinct ids (more than HBM holds: most go straight to LMDB, on the
    writer thread with background writes) keeps the values the caller passed, not what the
    caller's array holds after ``write`` returns.  With background writes, the writer
    thread's transaction is held until the caller has overwritten its array."""
    go = _hold_writer_thread(monkeypatch)
    tiers = TierConfig(hbm_rows=4, ddr_rows=2, device="cpu", background_writes=background)
    with TieredStore.create(tmp_path / "s", TABLES, tiers) as s:
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


def test_a_bulk_write_behind_one_in_flight_is_newer_than_the_write_backs_waiting(tmp_path, monkeypatch):
    """A bulk write made while the one before is still committing is cut and encoded at
    once; a write-back that waited meanwhile (an evicted row of an id the bulk write then
    sets) must still read, and reopen, older than the bulk write's row."""
    go = _hold_writer_thread(monkeypatch)
    tiers = TierConfig(hbm_rows=4, ddr_rows=0, device="cpu", background_writes=True)
    with TieredStore.create(tmp_path / "s", TABLES, tiers) as s:
        s.ssd.writeback_rows = 1 << 16  # (evicted rows wait in memory)
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


def test_checkpoint_is_the_restore_point_and_latest_keeps_flushes(tmp_path):
    path = tmp_path / "c"
    s = TieredStore.create(path, TABLES, cpu(2))
    s.write("a", np.array([1]), np.full((1, 8), 1, np.float32))
    s.checkpoint(extra=b"step=1")
    s.write("a", np.array([1, 2, 3]), np.full((3, 8), 2, np.float32))
    s.flush()
    crash(s)
    with TieredStore.open(path) as r:
        assert r.peek("a", np.array([1]))[0, 0] == 1 and r.extra == b"step=1"
        assert r.epoch == 1
        crash(r)
    # the checkpoint discarded what came after; 'latest' now finds the same point
    with TieredStore.open(path, restore="latest") as r:
        assert r.peek("a", np.array([1]))[0, 0] == 1


def test_restore_latest_keeps_flushed_rows(tmp_path):
    path = tmp_path / "l"
    s = TieredStore.create(path, TABLES, cpu(2))
    s.write("a", np.array([1]), np.full((1, 8), 5, np.float32))
    s.flush()
    crash(s)
    with TieredStore.open(path, restore="latest") as r:
        assert r.peek("a", np.array([1]))[0, 0] == 5


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "ids, err",
    [
        (np.array([1.0, 2.0]), IdTypeError),
        (np.array([[1, 2]]), IdTypeError),
        (np.array([-1]), IdRangeError),
        (np.array([100]), IdRangeError),
        (np.array([2**64 - 1], dtype=np.uint64), IdRangeError),
        (["x"], IdTypeError),
    ],
)
def test_bad_ids_raise_typed_errors_and_change_nothing(store, ids, err):
    before = store.stats()
    with pytest.raises(err) as e:
        store.lookup("b", ids)
    assert "Hint:" in str(e.value) and isinstance(e.value, TieredEmbError)
    with pytest.raises(err):
        store.apply_gradients("b", ids, np.zeros((len(ids), 3), np.float32))
    assert store.stats() == before


def test_bad_rows_and_gradients(store):
    ids = np.array([1, 2])
    with pytest.raises(RowShapeError):
        store.write("a", ids, np.zeros((2, 7), np.float32))
    with pytest.raises(RowDtypeError):
        store.write("a", ids, np.zeros((2, 8), np.float64))
    before = store.peek("a", ids, with_state=True)
    g = np.ones((2, 8), np.float32)
    g[1, 3] = np.nan
    with pytest.raises(NonFiniteGradientError):
        store.apply_gradients("a", ids, g)
    np.testing.assert_array_equal(store.peek("a", ids, with_state=True), before)
    store.apply_gradients("a", ids, g, nonfinite="skip")
    after = store.peek("a", ids, with_state=True)
    np.testing.assert_array_equal(after[1], before[1])
    assert not np.array_equal(after[0], before[0])
    before = store.peek("a", ids, with_state=True)
    store.apply_gradients("a", ids, g, nonfinite="zero")
    after = store.peek("a", ids, with_state=True)
    assert np.isfinite(after).all() and not np.array_equal(after[1], before[1])  # updated, NaN as 0
    zeroed = np.nan_to_num(g, nan=0.0)
    ref = ReferenceStore(TABLES, seed=3)
    for i, r in zip(ids, before, strict=False):  # the same weights and optimizer state
        ref.record("a", int(i))[:] = r
    ref.apply_gradients("a", ids, zeroed)
    assert after.tobytes() == ref.peek_records("a", ids).tobytes()
    with pytest.raises(UnknownTableError, match="use one of"):
        store.lookup("nope", ids)


def test_config_errors_name_field_and_value():
    with pytest.raises(ConfigError, match="hbm_rows=0"):
        TierConfig(hbm_rows=0)
    with pytest.raises(ConfigError, match="background_writes=1"):
        TierConfig(hbm_rows=1, background_writes=1)
    with pytest.raises(ConfigError, match="policy='mru'"):
        TierConfig(hbm_rows=1, policy="mru")
    with pytest.raises(ConfigError, match="dim=0"):
        TableConfig("t", dim=0)
    with pytest.raises(ConfigError, match="name"):
        TableConfig("a b", dim=1)
    with pytest.raises(ConfigError, match="dtype"):
        TableConfig("t", dim=1, dtype="float16")
    with pytest.raises(ConfigError, match="Uniform"):
        Uniform(1, 0)
    with pytest.raises(ConfigError, match="lr"):
        SGD(lr=-1)
    with pytest.raises(ConfigError, match="ssd_compression"):
        TierConfig(hbm_rows=1, ssd_compression=30)


def test_store_path_errors(tmp_path):
    with pytest.raises(StoreNotFoundError):
        TieredStore.open(tmp_path / "missing")
    TieredStore.create(tmp_path / "s", TABLES, cpu(2)).close()
    with pytest.raises(StoreExistsError):
        TieredStore.create(tmp_path / "s", TABLES, cpu(2))
    with pytest.raises(ConfigError, match="duplicate"):
        TieredStore.create(tmp_path / "d", [TABLES[0], TABLES[0]], cpu(2))


def test_second_writer_is_refused(tmp_path):
    with TieredStore.create(tmp_path / "s", TABLES, cpu(2)):
        with pytest.raises(StoreLockedError, match="another writer"):
            TieredStore.open(tmp_path / "s")
    TieredStore.open(tmp_path / "s").close()


def test_closed_store_refuses_calls(tmp_path):
    s = TieredStore.create(tmp_path / "s", TABLES, cpu(2))
    s.close()
    s.close()
    with pytest.raises(StoreClosedError):
        s.lookup("a", np.array([1]))


def test_corrupt_manifest(tmp_path):
    TieredStore.create(tmp_path / "s", TABLES, cpu(2)).close()
    (tmp_path / "s" / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptStoreError, match="manifest"):
        TieredStore.open(tmp_path / "s")
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CorruptStoreError):
        TieredStore.open(tmp_path / "s")


def test_corrupt_lmdb_file(tmp_path):
    with TieredStore.create(tmp_path / "s", TABLES, cpu(2)) as s:
        s.write("a", np.arange(5), np.ones((5, 8), np.float32))
    data = tmp_path / "s" / "lmdb" / "data.mdb"
    data.write_bytes(b"\x00garbage" * 512)
    with pytest.raises(CorruptStoreError):
        TieredStore.open(tmp_path / "s")
    # the lock was released: the error left nothing held
    with pytest.raises(CorruptStoreError):
        TieredStore.open(tmp_path / "s")


def test_cuda_without_gpu_is_a_clear_error(tmp_path, monkeypatch):
    import tiered_emb._backend as be

    monkeypatch.setattr(be, "_cupy_or_reason", lambda: (None, "CuPy is not importable (test)"))
    with pytest.raises(DeviceError, match="device='cuda'"):
        TieredStore.create(tmp_path / "g", TABLES, TierConfig(hbm_rows=2, device="cuda"))
    assert not (tmp_path / "g").exists()


def test_auto_device_falls_back_with_one_warning(monkeypatch):
    import tiered_emb._backend as be

    monkeypatch.setattr(be, "_cupy_or_reason", lambda: (None, "no GPU (test)"))
    monkeypatch.setattr(be, "_warned", False)
    monkeypatch.delenv("TIERED_EMB_DEVICE", raising=False)
    with pytest.warns(be.DeviceFallbackWarning):
        assert be.resolve_xp("auto") is np
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert be.resolve_xp("auto") is np


def test_importing_does_not_import_torch_or_cupy():
    import subprocess
    import sys

    code = "import sys, tiered_emb; print('torch' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


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
    assert [s.tiers_of(n).hbm.records.shape[1] for n in "rsa"] == [144, 128, 22]
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


def _lmdb_asks(s):
    """Record every id the store's SSD tier looks up in LMDB (wraps its batched read)."""
    asked = []
    inner = s.ssd.reader.read_lmdb

    def spy(table, ids, *rest):
        asked.extend((table, int(i)) for i in ids)
        return inner(table, ids, *rest)

    s.ssd.reader.read_lmdb = spy
    return asked


def test_rows_never_written_are_not_looked_up(tmp_path):
    """Table "b" (num_rows) keeps a bitmap of the ids written below DDR: the rest go
    straight to the initialiser, before and after a reopen, with the reference's values."""
    rng = np.random.default_rng(1)
    ref = ReferenceStore(TABLES, seed=0)
    path = tmp_path / "s"
    written = set()
    with TieredStore.create(path, TABLES, cpu(2, 2)) as s:
        asked = _lmdb_asks(s)
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
        asked = _lmdb_asks(s)
        np.testing.assert_array_equal(s.lookup("b", np.arange(100)), ref.lookup("b", np.arange(100)))
        assert {i for _, i in asked} <= written and len(asked) > 0
        # a table without num_rows has no bitmap: every id it misses is looked for
        s.lookup("a", np.array([5, 6, 7]))
        assert {("a", 5), ("a", 6), ("a", 7)} <= set(asked)


def test_stored_id_outside_num_rows_is_corrupt(tmp_path):
    import lmdb

    TieredStore.create(tmp_path / "s", TABLES, cpu(2)).close()
    env = lmdb.open(str(tmp_path / "s" / "lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put((100).to_bytes(8, "big"), b"\x00" + bytes(4 * 4), db=env.open_db(b"t:b", txn=txn))
    env.close()
    with pytest.raises(CorruptStoreError, match="outside"):
        TieredStore.open(tmp_path / "s")
    with pytest.raises(CorruptStoreError, match="outside"):  # the lock was released
        TieredStore.open(tmp_path / "s")


def test_failed_lmdb_read_changes_nothing_and_loses_nothing(tmp_path):
    """A read from LMDB that fails mid-step (here: a CorruptStoreError on some calls) raises
    before any tier changes: retrying the step ends as if the failure never happened.
    (Batches fit HBM in one chunk: a spill-path update that fails in a later chunk has
    applied the earlier ones.)"""
    rng = np.random.default_rng(5)
    ref = ReferenceStore(TABLES, seed=2)
    with TieredStore.create(tmp_path / "s", TABLES, cpu(8, 4), seed=2) as s:
        real = s.ssd.read
        calls = [0]

        def flaky(table, ids, out):
            calls[0] += 1
            if calls[0] % 4 == 0:
                raise CorruptStoreError("injected read failure", "none")
            return real(table, ids, out)

        s.ssd.read = flaky
        failures = 0
        for _ in range(40):
            ids = rng.integers(0, 60, size=6)
            grads = rng.standard_normal((6, 3)).astype(np.float32)
            while True:
                try:
                    got = s.lookup("b", ids)
                    s.apply_gradients("b", ids, grads)
                    break
                except CorruptStoreError:
                    failures += 1  # the tiers are as before the call: retry it
            np.testing.assert_array_equal(got, ref.lookup("b", ids))
            ref.apply_gradients("b", ids, grads)
        assert failures > 5 and int(s.tiers_of("b").hbm.pins.sum()) == 0
        s.ssd.read = real
        np.testing.assert_array_equal(
            s.peek("b", np.arange(100), with_state=True), ref.peek_records("b", np.arange(100))
        )


def test_close_that_cannot_checkpoint_keeps_the_store_open_and_loses_nothing(tmp_path, monkeypatch):
    """A full disk at close(): StoreFullError, the store stays open with its rows; once there
    is room, close() again writes them."""
    from tiered_emb.errors import StoreFullError

    path = tmp_path / "s"
    s = TieredStore.create(path, TABLES, cpu(4, 4), seed=3)
    g = np.full((2, 8), 0.5, np.float32)
    s.apply_gradients("a", np.array([3, 9]), g)  # dirty in HBM only
    real, calls = s.ssd.lmdb.write, []

    def full_once(fn):
        calls.append(1)
        if len(calls) == 1:
            raise StoreFullError("no space left on device", "free disk space")
        real(fn)

    monkeypatch.setattr(s.ssd.lmdb, "write", full_once)
    with pytest.raises(StoreFullError):
        s.close()
    assert not s.closed
    s.close()
    assert s.closed and len(calls) == 3  # the failed write, then the rows' and the checkpoint's own
    ref = ReferenceStore(TABLES, seed=3)
    ref.apply_gradients("a", np.array([3, 9]), g)
    with TieredStore.open(path) as s2:
        np.testing.assert_array_equal(
            s2.peek("a", np.array([3, 9]), with_state=True), ref.peek_records("a", np.array([3, 9]))
        )


def test_fused_backward_checks_its_gradient_and_ids(tmp_path):
    """apply_pooled_gradients is held to apply_gradients' checks: a gradient of the wrong
    shape or dtype, or ids beyond num_rows, raise and change nothing."""
    from tiered_emb.step.plan import plan_bags

    with TieredStore.create(tmp_path / "s", TABLES, cpu(4, 4), seed=3) as s:
        plan = plan_bags(np.array([1, 2]), np.array([0, 1, 2]))
        s.lookup_pooled("a", plan)
        before = s.peek("a", np.array([1, 2]), with_state=True)
        with pytest.raises(RowShapeError):
            s.apply_pooled_gradients("a", plan, np.ones((2, 4), np.float32))
        with pytest.raises(RowShapeError):
            s.apply_pooled_gradients("a", plan, np.ones((3, 8), np.float32))
        with pytest.raises(RowDtypeError):
            s.apply_pooled_gradients("a", plan, np.ones((2, 8), np.float64))
        np.testing.assert_array_equal(s.peek("a", np.array([1, 2]), with_state=True), before)
        bad = plan_bags(np.array([5, 100]), np.array([0, 2]))  # b has num_rows=100, never looked up
        with pytest.raises(IdRangeError):
            s.apply_pooled_gradients("b", bad, np.ones((1, 3), np.float32))
        with pytest.raises(IdRangeError):  # checked against the table it is applied to
            s.apply_pooled_gradients("b", plan_bags(np.array([100]), np.array([0, 1])), np.ones((1, 3), np.float32))
        assert s.stats()["b"]["hbm"]["lookups"] == 0
    with TieredStore.open(tmp_path / "s") as s:  # nothing out of range reached LMDB
        assert s.peek("b", np.array([5])).shape == (1, 3)


def test_manifest_write_on_a_full_disk_is_a_typed_error_and_retried(tmp_path, monkeypatch):
    """The checkpoint's rows are committed before manifest.json is rewritten; a full disk
    there is StoreFullError (not a bare OSError), and the next checkpoint writes it."""
    import errno

    from tiered_emb.errors import StoreFullError

    s = TieredStore.create(tmp_path / "s", TABLES, cpu(4, 4), seed=3)
    s.apply_gradients("a", np.array([3]), np.full((1, 8), 0.5, np.float32))
    real_fsync, calls = __import__("os").fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr("tiered_emb.store.os.fsync", fsync)
    with pytest.raises(StoreFullError, match="manifest"):
        s.checkpoint()
    s.close()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    ref = ReferenceStore(TABLES, seed=3)
    ref.apply_gradients("a", np.array([3]), np.full((1, 8), 0.5, np.float32))
    with TieredStore.open(tmp_path / "s") as s2:
        assert manifest["epoch"] == s2.epoch == 2
        np.testing.assert_array_equal(
            s2.peek("a", np.array([3]), with_state=True), ref.peek_records("a", np.array([3]))
        )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_manifest_rename_and_new_store_directory_are_fsynced(tmp_path, monkeypatch):
    """A rename is durable only once its directory is fsynced: without it a power loss can
    bring back the old manifest.json beside a newer checkpoint (or lose a new store's entry)."""
    import os

    real_fsync, real_replace, events = os.fsync, os.replace, []

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(b)))
        real_replace(a, b)

    monkeypatch.setattr("tiered_emb.store.os.fsync", fsync)
    monkeypatch.setattr("tiered_emb.store.os.replace", replace)
    path = tmp_path / "deep" / "s"
    s = TieredStore.create(path, TABLES, cpu(4, 4), seed=3)
    assert ("fsync", str(path.parent.resolve())) in events  # the new directory's entry
    assert ("fsync", str(tmp_path.resolve())) in events  # and the new directory above it
    assert ("fsync", str((path / "lmdb").resolve())) in events  # data.mdb's
    events.clear()
    s.apply_gradients("a", np.array([3]), np.full((1, 8), 0.5, np.float32))
    s.checkpoint()
    s.close()
    renamed = [i for i, e in enumerate(events) if e == ("replace", str(path / "manifest.json"))]
    assert len(renamed) == 2  # the checkpoint's and close()'s
    for i in renamed:  # each rename is followed by an fsync of the store directory
        assert ("fsync", str(path.resolve())) in events[i + 1 : i + 2]


def test_a_filesystem_that_refuses_to_fsync_directories_still_works(tmp_path, monkeypatch):
    """Directory fsync is best effort where the filesystem refuses it (EINVAL) or the
    directory cannot be opened (a parent one may write but not list: EACCES): create()
    and checkpoint() work as before; an I/O error is still raised, typed, and a create()
    that failed leaves no directory behind to block its retry."""
    import errno
    import os

    real_fsync, real_open = os.fsync, os.open

    def fsync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")) if sys.platform.startswith("linux") else False:
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    def open_(p, flags, *a):
        if flags & getattr(os, "O_DIRECTORY", 0):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(p, flags, *a)

    for name, patch in (("fsync", fsync), ("open", open_)):
        monkeypatch.setattr(f"tiered_emb.store.os.{name}", patch)
        s = TieredStore.create(tmp_path / name, TABLES, cpu(4, 4), seed=3)
        s.apply_gradients("a", np.array([3]), np.full((1, 8), 0.5, np.float32))
        s.checkpoint()
        s.close()
        monkeypatch.undo()
        with TieredStore.open(tmp_path / name) as s:
            assert s.epoch == 2

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("tiered_emb.store.os.fsync", eio)
    with pytest.raises(CorruptStoreError, match="fsync"):
        TieredStore.create(tmp_path / "eio", TABLES, cpu(4, 4), seed=3)
    assert not (tmp_path / "eio").exists()
    monkeypatch.undo()
    TieredStore.create(tmp_path / "eio", TABLES, cpu(4, 4), seed=3).close()


def test_close_without_checkpoint_gives_up_what_came_after_the_last_one(tmp_path):
    path = tmp_path / "s"
    s = TieredStore.create(path, TABLES, cpu(4, 4), seed=3)
    s.apply_gradients("a", np.arange(10), np.full((10, 8), 0.5, np.float32))
    s.checkpoint()
    kept = s.peek("a", np.arange(10), with_state=True)
    s.apply_gradients("a", np.arange(10), np.full((10, 8), 0.25, np.float32))  # spills to DDR and LMDB
    s.flush()
    assert not np.array_equal(s.peek("a", np.arange(10), with_state=True), kept)
    s.close(checkpoint=False)
    assert s.closed
    with TieredStore.open(path) as s2:
        assert s2.epoch == 1
        np.testing.assert_array_equal(s2.peek("a", np.arange(10), with_state=True), kept)


@pytest.mark.parametrize("content", ["[]", "null", '"x"', "3"])
def test_manifest_that_is_not_an_object_is_corrupt(tmp_path, content):
    TieredStore.create(tmp_path / "s", TABLES, cpu(2)).close()
    (tmp_path / "s" / "manifest.json").write_text(content)
    with pytest.raises(CorruptStoreError, match="manifest"):
        TieredStore.open(tmp_path / "s")


@pytest.mark.parametrize("seed", [-1, 1.5, 2**70, True, "3"])
def test_manifest_seed_out_of_range_is_corrupt(tmp_path, seed):
    TieredStore.create(tmp_path / "s", TABLES, cpu(2)).close()
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    m["seed"] = seed
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptStoreError, match="seed"):
        TieredStore.open(tmp_path / "s")


def test_truncated_lmdb_file_is_corrupt_not_a_crash(tmp_path):
    """LMDB maps data.mdb: a page past a truncated end would kill the process (SIGBUS) on
    first read, so open() compares the file with its last committed page."""
    import os

    with TieredStore.create(tmp_path / "s", TABLES, cpu(2)) as s:
        s.write("a", np.arange(20000), np.ones((20000, 8), np.float32))
    data = tmp_path / "s" / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CorruptStoreError, match="truncated"):
        TieredStore.open(tmp_path / "s")
    with pytest.raises(CorruptStoreError, match="truncated"):  # and the lock was released
        TieredStore.open(tmp_path / "s")


def test_missing_lmdb_files_are_corrupt_and_nothing_is_created(tmp_path):
    import shutil

    TieredStore.create(tmp_path / "s", TABLES, cpu(2)).close()
    shutil.rmtree(tmp_path / "s" / "lmdb")
    with pytest.raises(CorruptStoreError, match=r"data\.mdb"):
        TieredStore.open(tmp_path / "s")
    assert not (tmp_path / "s" / "lmdb").exists()


def test_corrupt_compressed_record_is_corrupt(tmp_path):
    import lmdb

    from tiered_emb.tiers.ssd.codec import SEGMENT_HEADER

    with TieredStore.create(tmp_path / "s", TABLES, cpu(2, ssd_compression=3)) as s:
        s.write("a", np.arange(10), np.ones((10, 8), np.float32))
    env = lmdb.open(str(tmp_path / "s" / "lmdb"), max_dbs=10, subdir=True)
    db = env.open_db(b"p:a")  # (not inside the write transaction: it takes one of its own)
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(db=db)))
        n = SEGMENT_HEADER.unpack_from(value)[3]
        at = SEGMENT_HEADER.size + 8 * n
        txn.put(key, value[:at] + b"not zstd at all", db=db)  # header and ids intact, rows damaged
    env.close()
    with TieredStore.open(tmp_path / "s") as s, pytest.raises(CorruptStoreError, match="decompress"):
        s.lookup("a", np.arange(10))


def test_create_that_fails_leaves_no_directory(tmp_path, monkeypatch):
    import tiered_emb._opening as store_mod

    def broken(*a, **k):
        raise OSError("cannot map")

    monkeypatch.setattr(store_mod, "SsdTier", broken)
    with pytest.raises(OSError, match="cannot map"):
        TieredStore.create(tmp_path / "s", TABLES, cpu(2))
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("name", [["a"], 3, None])
def test_table_name_of_another_type_is_unknown_table(store, name):
    with pytest.raises(UnknownTableError):
        store.lookup(name, np.array([1]))


def test_peek_of_a_repeated_id_held_only_in_lmdb(tmp_path):
    with TieredStore.create(tmp_path / "s", TABLES, cpu(4, 4), seed=3) as s:
        s.write("a", np.array([0]), np.full((1, 8), 2.0, np.float32))
    with TieredStore.open(tmp_path / "s") as s:
        got = s.peek("a", np.array([0, 7, 0]), with_state=True)
        np.testing.assert_array_equal(got[0], got[2])
        assert (got[0, :8] == 2.0).all()


def test_bag_plans_take_integer_ids_only(tmp_path):
    from tiered_emb.step.plan import plan_bags

    with pytest.raises(IdTypeError):
        plan_bags(np.array([1.7, 2.0]), np.array([0, 2]))
    with pytest.raises(IdTypeError):
        plan_bags(np.array([True, False]), np.array([0, 2]))
    with pytest.raises(IdTypeError):
        plan_bags(np.array([1, 2]), np.array([0.0, 2.0]))
    with pytest.raises(IdRangeError, match="beyond int64"):
        plan_bags(np.array([2**64 - 1], dtype=np.uint64), np.array([0, 1]))
    assert plan_bags(np.array([3, 1], dtype=np.uint32), np.array([0, 2])).uids.tolist() == [3, 1]


def test_lazy_rows_depend_on_the_table_name(tmp_path):
    tables = [TableConfig("x", dim=8), TableConfig("y", dim=8)]
    with TieredStore.create(tmp_path / "s", tables, cpu(4), seed=3) as s:
        x, y = s.peek("x", np.arange(20)), s.peek("y", np.arange(20))
    assert not (x == y).all(axis=1).any()


def test_two_failed_write_backs_of_one_id_read_the_newer(tmp_path, monkeypatch):
    """Row 0 evicted dirty twice while every LMDB write fails (a full disk): both write-backs
    wait in memory, and reads must find the newer one; once there is room, it is the one kept."""
    from tiered_emb.errors import StoreFullError

    tables = [TableConfig("t", dim=2, optimizer=SGD(lr=1.0))]
    s = TieredStore.create(tmp_path / "s", tables, cpu(1, 0, background_writes=False), seed=5)
    s.ssd.writeback_rows = 1
    real, full = s.ssd.segments.put, [True]

    def put(txn, segments):
        if full[0]:
            raise StoreFullError("no space left on device", "free some")
        real(txn, segments)

    monkeypatch.setattr(s.ssd.segments, "put", put)
    ref = ReferenceStore(tables, seed=5)
    for step, other in ((1.0, 1), (2.0, 2)):
        g = np.full((1, 2), step, np.float32)
        if step > 1:  # the operation after a failed write-back raises it before changing anything
            with pytest.raises(StoreFullError):
                s.apply_gradients("t", np.array([0]), g)
            assert (
                s.peek("t", np.array([0]), with_state=True).tobytes() == ref.peek_records("t", np.array([0])).tobytes()
            )
        s.apply_gradients("t", np.array([0]), g)
        ref.apply_gradients("t", np.array([0]), g)
        s.lookup("t", np.array([other]))  # evicts row 0: its write-back cannot be written (kept for the next call)
        assert s.peek("t", np.array([0]), with_state=True).tobytes() == ref.peek_records("t", np.array([0])).tobytes()
    assert len(s.ssd.held.flushing) == 2  # both write-backs of row 0 wait in memory
    with pytest.raises(StoreFullError):
        s.lookup("t", np.array([3]))
    full[0] = False
    s.close()
    with TieredStore.open(tmp_path / "s") as s:
        assert s.peek("t", np.array([0]), with_state=True).tobytes() == ref.peek_records("t", np.array([0])).tobytes()


def test_a_full_disk_under_an_update_spread_over_chunks_applies_it_whole(tmp_path):
    """More unique ids than HBM holds: the update goes chunk by chunk, and a failed
    write-back met half way used to raise after the first chunks were updated (a retry
    applied them twice).  A failure is now raised by the next operation, before it changes
    anything: each call is applied whole or not at all."""
    from tiered_emb.errors import StoreFullError
    from tiered_emb.testing import full_disk_for

    tables = [TableConfig("u", dim=2, optimizer=RowWiseAdagrad(lr=0.5))]
    ref = ReferenceStore(tables, seed=4)
    s = TieredStore.create(tmp_path / "f", tables, cpu(2), seed=4)
    s.ssd.writeback_rows = 2
    full_disk_for(s)
    ids, g = np.arange(8), np.ones((8, 2), np.float32)
    changed_on_error = []
    for _ in range(6):
        before = s.peek("u", ids, with_state=True)
        try:
            s.apply_gradients("u", ids, g)
        except StoreFullError:
            changed_on_error.append(int((s.peek("u", ids, with_state=True) != before).any(axis=1).sum()))
            s.apply_gradients("u", ids, g)  # the step that failed, retried
        ref.apply_gradients("u", ids, g)
    s.close()
    assert changed_on_error == [0]
    with TieredStore.open(tmp_path / "f") as s:
        np.testing.assert_array_equal(s.peek("u", ids, with_state=True), ref.peek_records("u", ids))


@pytest.mark.parametrize(
    "message, free, full",
    [
        ("mdb_txn_commit: Input/output error", 1 << 20, True),
        ("mdb_txn_commit: Input/output error", 1 << 40, False),
        ("mdb_put: No space left on device", 1 << 40, True),
        ("mdb_txn_commit: Bad file descriptor", 0, False),
    ],
)
def test_a_short_write_on_a_full_disk_is_store_full(tmp_path, monkeypatch, message, free, full):
    """LMDB reports its short page writes as EIO: on a filling disk that is the usual first
    failure, and it was reported as a corrupt store."""
    import collections
    import shutil

    import lmdb

    from tiered_emb.errors import StoreFullError

    s = TieredStore.create(tmp_path / "s", [TableConfig("t", dim=2, optimizer=SGD(lr=1.0))], cpu(4), seed=1)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 41, (1 << 41) - free, free))

    def fail(txn):
        raise lmdb.Error(message)

    with pytest.raises(StoreFullError if full else CorruptStoreError):
        s.ssd.lmdb.write(fail)
    s.close()


_KILLED_CREATE = r"""
import os, signal, sys
from tiered_emb import TableConfig, TierConfig, TieredStore
from tiered_emb import _directory
from tiered_emb.tiers.ssd.checkpoint import Checkpointer
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "manifest":  # the LMDB meta committed, the manifest not yet written
    _directory.write_manifest = die
else:                          # inside the first LMDB transaction
    Checkpointer.put_meta = die
TieredStore.create(sys.argv[1], [TableConfig("t", dim=4)], TierConfig(hbm_rows=4, device="cpu"))
"""


@pytest.mark.parametrize("point", ["manifest", "first_txn"])
def test_a_create_killed_half_way_is_started_over_by_the_next_create(tmp_path, point):
    """Killed between its mkdir and its manifest, create() left a directory that create()
    refused (it exists) and open() refused (no manifest), so only a manual delete helped."""
    import subprocess
    import sys

    path = tmp_path / "s"
    p = subprocess.run(
        [sys.executable, "-c", _KILLED_CREATE, str(path), point], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == -9, p.stderr
    with pytest.raises(StoreNotFoundError, match="did not finish"):
        TieredStore.open(path)
    tables = [TableConfig("t", dim=4, optimizer=SGD(lr=1.0))]
    with TieredStore.create(path, tables, cpu(4), seed=2) as s:
        s.apply_gradients("t", np.array([1, 2]), np.ones((2, 4), np.float32))
        want = s.peek("t", np.arange(4), with_state=True)
    with TieredStore.open(path) as s:
        assert s.peek("t", np.arange(4), with_state=True).tobytes() == want.tobytes()


def test_only_a_half_made_store_is_started_over(tmp_path):
    tables = [TableConfig("t", dim=4)]
    with TieredStore.create(tmp_path / "whole", tables, cpu(4)):
        pass
    with pytest.raises(StoreExistsError):  # a finished store is never replaced
        TieredStore.create(tmp_path / "whole", tables, cpu(4))
    other = tmp_path / "other"
    (other / "lmdb").mkdir(parents=True)
    (other / "LOCK").touch()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(StoreExistsError):  # a file that is not the store's: not a half-made store
        TieredStore.create(other, tables, cpu(4))
    assert (other / "notes.txt").read_text() == "mine"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "LOCK").touch()
    import fcntl
    import os

    fd = os.open(busy / "LOCK", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a create still running there
    try:
        with pytest.raises(StoreLockedError):
            TieredStore.create(busy, tables, cpu(4))
    finally:
        os.close(fd)


_OPEN_AND_READ = r"""
import sys, numpy as np
from tiered_emb import TieredStore
from tiered_emb.errors import CorruptStoreError
try:
    s = TieredStore.open(sys.argv[1])
    for name in s.tables:
        s.peek(name, np.arange(400), with_state=True)
    s.close(checkpoint=False)
    print("RESULT ok")
except CorruptStoreError:
    print("RESULT CorruptStoreError")
except BaseException as e:
    print("RESULT", type(e).__module__ + "." + type(e).__name__, str(e)[:100])
"""


def test_a_damaged_lmdb_page_is_a_corrupt_store_error(tmp_path):
    """Pages of the tables' B-trees overwritten with (seeded) junk: opening and reading the
    store gives CorruptStoreError or the rows, never a raw lmdb error (the key walk at open
    and the meta read raised lmdb.CorruptedError / BadTxnError).  LMDB pages carry no
    checksums, so some junk makes LMDB itself abort: those cases are counted, not failed."""
    import shutil
    import subprocess
    import sys

    path = tmp_path / "s"
    tables = [TableConfig("a", dim=8), TableConfig("b", dim=4, num_rows=400)]
    s = TieredStore.create(path, tables, TierConfig(hbm_rows=8, ddr_rows=0, device="cpu", map_size_bytes=1 << 20))
    rng = np.random.default_rng(0)
    for name, dim in (("a", 8), ("b", 4)):
        s.write(name, np.arange(400), rng.standard_normal((400, dim)).astype(np.float32))
    s.checkpoint()
    for name, dim in (("a", 8), ("b", 4)):
        s.write(name, np.arange(0, 400, 3), rng.standard_normal((134, dim)).astype(np.float32))
    s.flush()
    crash(s)
    psize = 4096
    npages = (path / "lmdb" / "data.mdb").stat().st_size // psize
    junk = np.random.default_rng(1)
    raw = []
    for pg in range(12, min(npages, 22)):
        cp = tmp_path / "c"
        shutil.rmtree(cp, ignore_errors=True)
        shutil.copytree(path, cp)
        with open(cp / "lmdb" / "data.mdb", "r+b") as f:
            f.seek(pg * psize)
            f.write(junk.integers(0, 256, psize, dtype=np.uint8).tobytes())
        p = subprocess.run([sys.executable, "-c", _OPEN_AND_READ, str(cp)], capture_output=True, text=True, timeout=120)
        res = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if res and res[0] not in ("ok", "CorruptStoreError"):
            raw.append(f"page {pg}: {res[0]}")
    assert not raw, "\n".join(raw)


def test_a_store_with_checkpoints_that_lost_its_manifest_is_never_started_over(tmp_path):
    """Only a store holding nothing (no row, no checkpoint past the first) counts as a
    create() killed half way: a finished one whose manifest.json was lost keeps its LMDB."""
    path = tmp_path / "s"
    tables = [TableConfig("t", dim=4, optimizer=SGD(lr=1.0))]
    with TieredStore.create(path, tables, cpu(4), seed=2) as s:
        s.write("t", np.arange(10), np.arange(40, dtype=np.float32).reshape(10, 4))
        s.checkpoint()
    data = (path / "lmdb" / "data.mdb").read_bytes()
    (path / "manifest.json").unlink()
    with pytest.raises(StoreNotFoundError, match=r"no manifest\.json"):
        TieredStore.open(path)
    with pytest.raises(StoreExistsError, match="without its manifest"):
        TieredStore.create(path, tables, cpu(4), seed=2)
    assert (path / "lmdb" / "data.mdb").read_bytes() == data


def test_close_saves_extra_with_its_checkpoint(tmp_path):
    """close(extra=...) saves the trainer's state with the rows of the last checkpoint; a
    plain close keeps the older bytes (documented), and extra without a checkpoint is refused."""
    tables = [TableConfig("t", dim=2, optimizer=SGD(lr=1.0))]
    s = TieredStore.create(tmp_path / "s", tables, cpu(4), seed=1)
    s.checkpoint(extra=b"step 1")
    s.apply_gradients("t", np.array([1]), np.ones((1, 2), np.float32))
    with pytest.raises(ConfigError, match="would not save"):
        s.close(checkpoint=False, extra=b"step 2")
    with pytest.raises(ConfigError, match="invalid"):
        s.close(extra="step 2")
    want = s.peek("t", np.arange(4), with_state=True)
    s.close(extra=b"step 2")
    with TieredStore.open(tmp_path / "s") as s:
        assert s.extra == b"step 2" and s.peek("t", np.arange(4), with_state=True).tobytes() == want.tobytes()
        s.apply_gradients("t", np.array([2]), np.ones((1, 2), np.float32))
    with TieredStore.open(tmp_path / "s") as s:  # a plain close: the rows move on, extra stays
        assert s.extra == b"step 2" and s.peek("t", np.arange(4), with_state=True).tobytes() != want.tobytes()


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_checkpoint_failing_midway_loses_nothing_and_retries(tmp_path, monkeypatch, fail_at):
    """A checkpoint of many transactions (a small budget: small chunks, one committing while
    the next is encoded) whose ``fail_at``-th write finds the disk full: StoreFullError,
    every row still read as trained, the last checkpoint still the one on disk; the next
    checkpoint writes everything."""
    from tiered_emb.errors import StoreFullError

    path = tmp_path / "s"
    s = TieredStore.create(path, TABLES, cpu(64, 1 << 16, budget_bytes=1 << 20), seed=3)
    ref = ReferenceStore(TABLES, seed=3)
    rng = np.random.default_rng(7)
    for _ in range(6):
        ids = rng.choice(40_000, 8192, replace=False)
        g = rng.standard_normal((8192, 8)).astype(np.float32)
        for x in (s, ref):
            x.apply_gradients("a", ids, g)
    epoch = s.epoch
    real, calls = s.ssd.lmdb.write, []

    def full_at(fn):
        calls.append(1)
        if len(calls) == fail_at:
            raise StoreFullError("no space left on device", "free disk space")
        real(fn)

    monkeypatch.setattr(s.ssd.lmdb, "write", full_at)
    with pytest.raises(StoreFullError):
        s.checkpoint()
    assert s.epoch == epoch
    every = np.arange(40_000)
    want = ref.peek_records("a", every)
    np.testing.assert_array_equal(s.peek("a", every, with_state=True), want)
    assert s.checkpoint() == epoch + 1 and len(calls) > fail_at + 1
    s.close()
    with TieredStore.open(path) as s2:
        np.testing.assert_array_equal(s2.peek("a", every, with_state=True), want)


@pytest.mark.parametrize("budget", [1 << 20, 3 << 19, 1 << 24])
def test_a_checkpoint_of_dirty_rows_of_two_widths_reopens_bitwise(tmp_path, budget):
    """Dirty rows of two tables of different record widths, in HBM and DDR, written in
    chunks gathered one after another into the same buffer: small pieces of both tables
    share a chunk, larger ones go alone; every row reopens as trained."""
    path = tmp_path / "s"
    s = TieredStore.create(path, TABLES, cpu(48, 8192, budget_bytes=budget), seed=3)
    ref = ReferenceStore(TABLES, seed=3)
    rng = np.random.default_rng(11)
    for _ in range(12):
        for name, dim, n, k in (("a", 8, 20_000, 1000), ("b", 3, 100, 40)):
            ids = rng.choice(n, k, replace=False)
            g = rng.standard_normal((k, dim)).astype(np.float32)
            for x in (s, ref):
                x.apply_gradients(name, ids, g)
    s.checkpoint()
    assert s.last_checkpoint_rows > 0
    s.close()
    with TieredStore.open(path) as s2:
        for name, n in (("a", 20_000), ("b", 100)):
            every = np.arange(n)
            np.testing.assert_array_equal(s2.peek(name, every, with_state=True), ref.peek_records(name, every))


def test_a_checkpoint_whose_pieces_overflow_a_chunk_starts_the_next_one(tmp_path):
    """Three tables whose dirty DDR rows are each just under half a chunk: the third does
    not fit beside the first two and begins the next chunk; every row reopens as trained."""
    tables = [TableConfig(n, dim=8, num_rows=8192, optimizer=SGD(lr=0.5)) for n in "abc"]
    path = tmp_path / "s"
    s = TieredStore.create(path, tables, cpu(16, 8192, budget_bytes=1 << 20), seed=3)
    ref = ReferenceStore(tables, seed=3)
    rng = np.random.default_rng(5)
    for t in tables:  # (3,500 rows of 32 bytes: 0.43 of the 256 KiB chunks after the first)
        ids = rng.choice(8192, 3500, replace=False)
        g = rng.standard_normal((3500, 8)).astype(np.float32)
        for x in (s, ref):
            x.apply_gradients(t.name, ids, g)
    s.checkpoint()
    s.close()
    with TieredStore.open(path) as s2:
        every = np.arange(8192)
        for t in tables:
            np.testing.assert_array_equal(s2.peek(t.name, every), ref.lookup(t.name, every))
