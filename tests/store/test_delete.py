"""Deleting rows: ``store.delete`` and ``tiered-emb delete``.

- a deleted row reads as its initial record, weights and optimizer state, from every tier
  and through every reader, and stays deleted across checkpoints and reopening;
- equal bitwise to the reference store whatever the tier sizes and policy (property test);
- what a checkpoint from before the delete reads, it still reads (``open(snapshot=n)``);
- export and ``stored_ids`` skip deleted rows, ``verify`` finds nothing wrong;
- ``--purge`` leaves no byte of a deleted row in the store's files;
- bad input is a typed error with nothing changed.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb import (
    Adam,
    ConfigError,
    IdRangeError,
    RowWiseAdagrad,
    TableConfig,
    TierConfig,
    TieredStore,
    UnknownTableError,
)
from tiered_emb.apps.portable import export_store
from tiered_emb.errors import ReadOnlyError
from tiered_emb.init import init_rows
from tiered_emb.testing.reference import ReferenceStore
from tiered_emb.tiers.ssd.codec import TOMBSTONE_WORD

REPO = Path(__file__).resolve().parents[2]
ROWS, DIM = 200, 4
TABLES = [
    TableConfig("a", DIM, ROWS, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", 3, None, optimizer=Adam(lr=0.01)),
]


def _store(path, hbm=8, ddr=8, policy="lru", keep=1):
    tiers = TierConfig(hbm_rows=hbm, ddr_rows=ddr, policy=policy, device="cpu", keep_checkpoints=keep)
    s = TieredStore.create(path, TABLES, tiers, seed=7)
    s.engine.ssd.writeback_rows = 16  # (write-backs reach LMDB often)
    return s


def _train(stores, step: int) -> None:
    rng = np.random.default_rng(step)
    for t in TABLES:
        ids = rng.integers(0, ROWS, 40)
        g = rng.normal(0.0, 1.0, (40, t.dim)).astype(np.float32)
        for s in stores:
            s.apply_gradients(t.name, ids, g)


def _records(s, table="a", ids=None):
    ids = np.arange(ROWS) if ids is None else ids
    return s.peek(table, ids, with_state=True) if isinstance(s, TieredStore) else s.peek_records(table, ids)


def test_a_deleted_row_reads_as_its_initial_record_from_every_tier(tmp_path):
    s = _store(tmp_path / "s")
    for step in range(6):
        _train([s], step)
    s.checkpoint()
    for step in range(6, 8):  # rows in HBM, DDR, the write-back buffer and LMDB
        _train([s], step)
    ids = np.arange(0, ROWS, 3)
    before = _records(s)
    s.delete("a", ids)
    after = _records(s)
    first = init_rows(TABLES[0], ids, 7)
    assert after[ids].tobytes() == first.tobytes()
    kept = np.setdiff1d(np.arange(ROWS), ids)
    assert after[kept].tobytes() == before[kept].tobytes()
    assert not np.array_equal(before[ids], first)  # (they had been trained)
    looked = s.lookup("a", ids)
    assert np.asarray(looked).tobytes() == first[:, :DIM].tobytes()
    s.close()


@settings(max_examples=25, deadline=None)
@given(
    hbm=st.sampled_from([4, 8, 300]),
    ddr=st.sampled_from([0, 8, 64]),
    policy=st.sampled_from(["lru", "lfu", "lookahead+lru", "sieve", "lookahead+clock"]),
    ops=st.lists(
        st.tuples(st.sampled_from(["train", "delete", "checkpoint", "reopen"]), st.integers(0, 10**6)), max_size=12
    ),
)
def test_deletion_is_the_reference_whatever_the_tiers(tmp_path_factory, hbm, ddr, policy, ops):
    path = tmp_path_factory.mktemp("d") / "s"
    s = _store(path, hbm, ddr, policy)
    ref = ReferenceStore(TABLES, seed=7)
    for op, seed in ops:
        if op == "train":
            _train([s, ref], seed)
        elif op == "delete":
            rng = np.random.default_rng(seed)
            for t in TABLES:
                ids = rng.integers(0, ROWS, 30)
                s.delete(t.name, ids)
                ref.delete(t.name, ids)
        elif op == "checkpoint":
            s.checkpoint()
        else:
            s.close()
            s = TieredStore.open(path)
    for t in TABLES:
        assert _records(s, t.name).tobytes() == _records(ref, t.name).tobytes()
    s.close()
    with TieredStore.open(path, mode="r") as r:
        for t in TABLES:
            assert r.peek(t.name, np.arange(ROWS), with_state=True).tobytes() == _records(ref, t.name).tobytes()


def test_a_delete_is_durable_at_the_next_checkpoint(tmp_path):
    s = _store(tmp_path / "s")
    _train([s], 0)
    s.checkpoint()
    trained = _records(s)
    s.delete("a", [1, 2, 3])
    s.close(checkpoint=False)  # (a crash: the delete is given up with the rest since the checkpoint)
    s = TieredStore.open(tmp_path / "s")
    assert _records(s).tobytes() == trained.tobytes()
    s.delete("a", [1, 2, 3])
    s.checkpoint()
    s.close(checkpoint=False)
    s = TieredStore.open(tmp_path / "s")
    assert _records(s, ids=np.array([1, 2, 3])).tobytes() == init_rows(TABLES[0], np.array([1, 2, 3]), 7).tobytes()
    s.close()


def test_a_checkpoint_from_before_the_delete_brings_the_row_back(tmp_path):
    s = _store(tmp_path / "s", keep=3)
    _train([s], 0)
    before = s.checkpoint()
    trained = _records(s)
    s.delete("a", np.arange(ROWS))
    with s.engine.lock:
        s.engine.ssd.purge(["a"])  # (what the kept checkpoint reads is kept)
    s.checkpoint()
    s.close()
    with TieredStore.open(tmp_path / "s", mode="r", snapshot=before) as r:
        assert r.peek("a", np.arange(ROWS), with_state=True).tobytes() == trained.tobytes()
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        assert (
            r.peek("a", np.arange(ROWS), with_state=True).tobytes()
            == init_rows(TABLES[0], np.arange(ROWS), 7).tobytes()
        )
    with TieredStore.open(tmp_path / "s", snapshot=before) as s:
        assert _records(s).tobytes() == trained.tobytes()


_READER = r"""
import sys
import numpy as np
from tiered_emb import TieredStore
with TieredStore.open(sys.argv[1], mode="r") as r:
    print(r.peek("a", [5]).tobytes().hex(), flush=True)
    sys.stdin.readline()
    print(r.peek("a", [5]).tobytes().hex(), flush=True)
    r.refresh()
    print(r.peek("a", [5]).tobytes().hex(), flush=True)
"""


def test_a_reader_beside_the_writer_sees_the_delete_after_its_refresh(tmp_path):
    s = _store(tmp_path / "s")
    _train([s], 0)
    s.checkpoint()
    trained = s.peek("a", [5]).tobytes().hex()
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(tmp_path / "s")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert reader.stdout.readline().strip() == trained
    s.delete("a", [5])
    s.checkpoint()
    out, _ = reader.communicate("go\n", timeout=120)
    assert out.split() == [trained, init_rows(TABLES[0], np.array([5]), 7)[:, :DIM].tobytes().hex()]
    s.close()
    with TieredStore.open(tmp_path / "s", mode="r") as r, pytest.raises(ReadOnlyError):
        r.delete("a", [5])


def test_export_and_stored_ids_skip_deleted_rows_and_verify_accepts_them(tmp_path):
    s = _store(tmp_path / "s")
    s.write("a", np.arange(ROWS), np.ones((ROWS, DIM), np.float32))
    s.checkpoint()
    s.delete("a", np.arange(0, ROWS, 2))
    s.checkpoint()
    n, chunks = s.engine.ssd.stored_ids("a", 7)
    assert n >= ROWS // 2
    assert np.concatenate(list(chunks)).tolist() == list(range(1, ROWS, 2))
    assert s.verify()["damaged"] == []
    s.close()
    counts = export_store(tmp_path / "s", tmp_path / "x")
    assert counts["a"] == ROWS // 2
    assert np.load(tmp_path / "x" / "a.ids.npy").tolist() == list(range(1, ROWS, 2))
    rows = np.load(tmp_path / "x" / "a.rows.npy")
    assert rows.shape == (ROWS // 2, DIM + 1) and np.all(rows[:, :DIM] == 1.0)


def test_bad_deletes_are_typed_errors_that_change_nothing(tmp_path):
    s = _store(tmp_path / "s", hbm=64)
    _train([s], 0)
    before = _records(s)
    with pytest.raises(UnknownTableError):
        s.delete("nope", [1])
    with pytest.raises(IdRangeError):
        s.delete("a", [1, ROWS])
    ticket = s.prefetch({"a": np.array([1, 2])})
    s.engine.drain_prefetch()
    with pytest.raises(ConfigError, match="pinned"):
        s.delete("a", [0, 1])
    s.release(ticket)
    assert _records(s).tobytes() == before.tobytes()
    s.delete("a", [0, 1])  # (released: now it deletes)
    assert _records(s, ids=np.array([1])).tobytes() == init_rows(TABLES[0], np.array([1]), 7).tobytes()
    s.close()


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tiered_emb.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


@pytest.mark.parametrize("purge", [False, True])
def test_the_delete_command_and_a_purge_leave_no_byte_of_the_rows(tmp_path, purge):
    """Without --purge the old copies stay in the file (nothing reads them); with it, no byte
    of a deleted row is left in any file of the store, and every other row is."""
    rng = np.random.default_rng(0)
    rows = rng.normal(0.0, 1.0, (ROWS, DIM)).astype(np.float32)
    with _store(tmp_path / "s") as s:
        s.write("a", np.arange(ROWS), rows)
    np.save(tmp_path / "ids.npy", np.arange(0, ROWS, 2))
    done = _cli("delete", tmp_path / "s", "a", tmp_path / "ids.npy", *(["--purge"] if purge else []))
    assert done.returncode == 0, done.stderr
    files = b"".join(p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file())
    assert all(rows[i].tobytes() in files for i in range(1, ROWS, 2))
    assert any(rows[i].tobytes() in files for i in range(0, ROWS, 2)) != purge
    # the purge dropped the tombstones too: nothing needs them once no older copy is left
    tomb = np.uint32(TOMBSTONE_WORD).tobytes() * 4
    assert (tomb in files) != purge
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        got = r.peek("a", np.arange(ROWS))
        assert r.stats()["a"]["ssd"]["rows"] == (ROWS // 2 if purge else ROWS)  # (tombstones are ids held)
    assert got[1::2].tobytes() == rows[1::2].tobytes()
    assert got[0::2].tobytes() == init_rows(TABLES[0], np.arange(0, ROWS, 2), 7)[:, :DIM].tobytes()


def test_the_delete_command_refuses_bad_input(tmp_path):
    with _store(tmp_path / "s") as s:
        _train([s], 0)
    np.save(tmp_path / "floats.npy", np.ones(3))
    (tmp_path / "junk.npy").write_text("not numpy")
    np.save(tmp_path / "ok.npy", np.arange(3))
    for args, words in (
        (["a", tmp_path / "floats.npy"], "integer ids"),
        (["a", tmp_path / "junk.npy"], "cannot be read"),
        (["nope", tmp_path / "ok.npy"], "nope"),
    ):
        done = _cli("delete", tmp_path / "s", *args)
        assert done.returncode == 2 and words in done.stderr, done.stderr
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        assert r.epoch == 1  # (no checkpoint was taken)
        done = _cli("delete", tmp_path / "s", "a", tmp_path / "ok.npy", "--purge")
        assert done.returncode == 2 and "readers open" in done.stderr, done.stderr


_DELETE_MEMORY = r"""
import json, sys
from pathlib import Path
from tiered_emb.apps.lifecycle import IdsFile, delete_rows
from tiered_emb.testing import AnonPeak

memory = AnonPeak()
start = memory.restart()
delete_rows(sys.argv[1], "t", IdsFile(Path(sys.argv[2])))
print(json.dumps({"grew": memory.peak() - start}))
"""


def test_deleting_many_ids_takes_memory_of_a_slice_not_of_the_ids(tmp_path):
    """The ids file is read a slice at a time: deleting 2M or 8M ids (16 or 64 MiB of them)
    grows the process's own memory by about the same (opening the store and loading its
    kernels included)."""
    import json

    n = 8_000_000
    cfg = TableConfig("t", 4, n, optimizer=RowWiseAdagrad(lr=0.1))
    tiers = TierConfig(hbm_rows=4096, ddr_rows=4096, device="cpu", budget_bytes=16 << 20)
    with TieredStore.create(tmp_path / "s", [cfg], tiers) as s:
        s.write("t", np.arange(0, n, 1000), np.ones((n // 1000, 4), np.float32))
    grew = {}
    for m in (2_000_000, n):
        np.save(tmp_path / "ids.npy", np.arange(m, dtype=np.int64))
        done = subprocess.run(
            [sys.executable, "-c", _DELETE_MEMORY, str(tmp_path / "s"), str(tmp_path / "ids.npy")],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        grew[m] = json.loads(done.stdout.strip().splitlines()[-1])["grew"]
    assert grew[n] < grew[2_000_000] + (16 << 20), grew  # (not the 48 MiB more ids of the second)
    assert grew[n] < 128 << 20, grew
