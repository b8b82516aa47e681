"""TieredStore's life on disk: create (durable, started over when killed half way), checkpoint
and restore, close with or without a checkpoint."""

import sys

import numpy as np
import pytest
from store_setup import TABLES, cpu

from tiered_emb import SGD, TableConfig, TieredStore
from tiered_emb.errors import (
    ConfigError,
    CorruptStoreError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
)
from tiered_emb.testing import crash
from tiered_emb.testing.reference import ReferenceStore


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
    assert s.engine.closed
    with TieredStore.open(path) as s2:
        assert s2.epoch == 1
        np.testing.assert_array_equal(s2.peek("a", np.arange(10), with_state=True), kept)


def test_create_that_fails_leaves_no_directory(tmp_path, monkeypatch):
    import tiered_emb._opening as store_mod

    def broken(*a, **k):
        raise OSError("cannot map")

    monkeypatch.setattr(store_mod, "SsdTier", broken)
    with pytest.raises(OSError, match="cannot map"):
        TieredStore.create(tmp_path / "s", TABLES, cpu(2))
    assert not (tmp_path / "s").exists()


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
    assert s.engine.last_checkpoint_rows > 0
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
