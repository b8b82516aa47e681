"""A damaged store is a CorruptStoreError, never a crash or wrong rows: manifest.json, the LMDB
files and pages, compressed records, ids out of range, and reads that fail mid-step."""

import json

import numpy as np
import pytest
from store_setup import TABLES, cpu

from tiered_emb import TableConfig, TierConfig, TieredStore
from tiered_emb.errors import (
    CorruptStoreError,
)
from tiered_emb.testing import crash
from tiered_emb.testing.reference import ReferenceStore


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
        real = s.engine.ssd.read
        calls = [0]

        def flaky(table, ids, out):
            calls[0] += 1
            if calls[0] % 4 == 0:
                raise CorruptStoreError("injected read failure", "none")
            return real(table, ids, out)

        s.engine.ssd.read = flaky
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
        assert failures > 5 and int(s.engine.table("b").hbm.pins.sum()) == 0
        s.engine.ssd.read = real
        np.testing.assert_array_equal(
            s.peek("b", np.arange(100), with_state=True), ref.peek_records("b", np.arange(100))
        )


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
