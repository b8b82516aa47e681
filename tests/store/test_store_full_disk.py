"""A full disk under TieredStore: StoreFullError, every row still held, and the next call
with room writes what failed (close, checkpoint, manifest, write-backs, an update in chunks)."""

import json

import numpy as np
import pytest
from store_setup import TABLES, cpu

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TieredStore
from tiered_emb.errors import (
    CorruptStoreError,
)
from tiered_emb.testing import faults
from tiered_emb.testing.reference import ReferenceStore


def test_close_that_cannot_checkpoint_keeps_the_store_open_and_loses_nothing(tmp_path):
    """A full disk at close(): StoreFullError, the store stays open with its rows; once there
    is room, close() again writes them."""
    from tiered_emb.errors import StoreFullError

    path = tmp_path / "s"
    s = TieredStore.create(path, TABLES, cpu(4, 4), seed=3)
    g = np.full((2, 8), 0.5, np.float32)
    s.apply_gradients("a", np.array([3, 9]), g)  # dirty in HBM only
    fault = faults.fail_lmdb_writes(s, lambda n: n == 1)
    with pytest.raises(StoreFullError):
        s.close()
    assert not s.engine.closed
    s.close()
    assert s.engine.closed and len(fault.calls) == 3  # the failed write, then the rows' and the checkpoint's own
    ref = ReferenceStore(TABLES, seed=3)
    ref.apply_gradients("a", np.array([3, 9]), g)
    with TieredStore.open(path) as s2:
        np.testing.assert_array_equal(
            s2.peek("a", np.array([3, 9]), with_state=True), ref.peek_records("a", np.array([3, 9]))
        )


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


def test_two_failed_write_backs_of_one_id_read_the_newer(tmp_path):
    """Row 0 evicted dirty twice while every LMDB write fails (a full disk): both write-backs
    wait in memory, and reads must find the newer one; once there is room, it is the one kept."""
    from tiered_emb.errors import StoreFullError

    tables = [TableConfig("t", dim=2, optimizer=SGD(lr=1.0))]
    s = TieredStore.create(tmp_path / "s", tables, cpu(1, 0, background_writes=False), seed=5)
    s.engine.ssd.writeback_rows = 1
    full = [True]
    faults.fail_segment_puts(s, lambda n: full[0])
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
    assert faults.snapshots_waiting(s) == 2  # both write-backs of row 0 wait in memory
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
    s.engine.ssd.writeback_rows = 2
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
        faults.in_lmdb_write(s, fail)
    s.close()


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_checkpoint_failing_midway_loses_nothing_and_retries(tmp_path, fail_at):
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
    fault = faults.fail_lmdb_writes(s, lambda n: n == fail_at)
    with pytest.raises(StoreFullError):
        s.checkpoint()
    assert s.epoch == epoch
    every = np.arange(40_000)
    want = ref.peek_records("a", every)
    np.testing.assert_array_equal(s.peek("a", every, with_state=True), want)
    assert s.checkpoint() == epoch + 1 and len(fault.calls) > fail_at + 1
    s.close()
    with TieredStore.open(path) as s2:
        np.testing.assert_array_equal(s2.peek("a", every, with_state=True), want)
