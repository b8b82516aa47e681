"""Every row the SSD tier holds carries a checksum: damaged bytes are a typed error naming
the table, the ids and the file, never wrong rows; ``verify`` lists every damaged record."""

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb import SGD, TableConfig, TierConfig, TieredStore
from tiered_emb._jit import split_parts, take_rows
from tiered_emb.errors import CorruptStoreError
from tiered_emb.testing import flip_bit
from tiered_emb.tiers.ssd import codec
from tiered_emb.tiers.ssd.mapped import pack_rows, row_sum, take_checked
from tiered_emb.tiers.ssd.segments import GATHER_SPLIT_FROM

TABLES = [TableConfig("a", dim=8, optimizer=SGD(lr=0.1)), TableConfig("b", dim=4, optimizer=SGD(lr=0.1))]
ROWS = 3000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=20), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_the_gather_sums_rows_as_the_writer_does(ids, width, fill):
    """The Numba twin equals the column-wise NumPy sum for any ids and words."""
    ids = np.array(ids, dtype=np.int64)
    words = (np.arange(ids.shape[0] * width, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(fill)).astype(
        np.uint32
    )
    sums = codec.row_sums(ids, words.reshape(-1, width))
    weights = codec.sum_weights(width)
    twin = [int(row_sum(words, k * width, width, int(ids[k]), weights)) for k in range(ids.shape[0])]
    assert sums.tolist() == twin


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**40), st.integers(1, 64), st.data())
def test_any_change_to_one_word_or_the_id_changes_the_sum(row_id, width, data):
    words = np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=width, max_size=width)), np.uint32)
    at = data.draw(st.integers(0, width - 1))
    flip = data.draw(st.integers(1, 2**32 - 1))
    base = codec.row_sums(np.array([row_id]), words[None])[0]
    changed = words.copy()
    changed[at] ^= np.uint32(flip)
    assert codec.row_sums(np.array([row_id]), changed[None])[0] != base
    assert codec.row_sums(np.array([row_id + flip]), words[None])[0] != base


def test_sign_flips_of_two_words_or_a_negated_row_change_the_sum():
    """A weighted sum alone misses two flips of bit 31 (2**31 twice is 0 mod 2**32); the
    shift of each term carries them down."""
    words = np.arange(1, 65, dtype=np.float32).view(np.uint32)
    base = codec.row_sums(np.array([500]), words[None])[0]
    for a, b in ((0, 1), (3, 40), (62, 63)):
        changed = words.copy()
        changed[[a, b]] ^= np.uint32(1 << 31)
        assert codec.row_sums(np.array([500]), changed[None])[0] != base, (a, b)
    assert codec.row_sums(np.array([500]), (-words.view(np.float32)).view(np.uint32)[None])[0] != base


def _store(path, compression=None):
    tiers = TierConfig(hbm_rows=64, ddr_rows=64, device="cpu", ssd_compression=compression)
    with TieredStore.create(path, TABLES, tiers, seed=3) as s:
        for t in TABLES:
            ids = np.arange(ROWS, dtype=np.int64)
            s.write(t.name, ids, np.random.default_rng(7).standard_normal((ROWS, t.dim)).astype(np.float32))
    with TieredStore.open(path) as s:
        return {t.name: s.peek(t.name, np.arange(ROWS)) for t in TABLES}


def test_a_flipped_bit_in_a_row_is_named_never_read(tmp_path):
    rows = _store(tmp_path / "s")
    at = flip_bit(tmp_path / "s", "a", 1234)
    with TieredStore.open(tmp_path / "s") as s:
        with pytest.raises(CorruptStoreError, match=r"id 1234 .*table 'a'.*data\.mdb fails its checksum") as err:
            s.lookup("a", np.array([5, 1234]))
        assert "verify" in err.value.hint
        others = np.setdiff1d(np.arange(ROWS), [1234])
        np.testing.assert_array_equal(s.peek("a", others), rows["a"][others])  # the rest reads back
        np.testing.assert_array_equal(s.peek("b", np.arange(ROWS)), rows["b"])
        report = s.verify()
    assert report["segments"] >= 2 and report["rows"] > 0
    [found] = report["damaged"]
    assert found["table"] == "a" and found["bad_ids"] == [1234] and found["bad_rows"] == 1
    assert found["ids"][0] <= 1234 <= found["ids"][1] and found["offset"] < at


def test_a_flipped_bit_in_the_ids_stops_the_open(tmp_path):
    _store(tmp_path / "s")
    flip_bit(tmp_path / "s", "b", 700, region="ids")
    with pytest.raises(CorruptStoreError, match=r"table 'b'.*CRC-32"):
        TieredStore.open(tmp_path / "s")


def test_a_damaged_compressed_segment_is_an_error(tmp_path):
    _store(tmp_path / "s", compression=3)
    flip_bit(tmp_path / "s", "a", region="compressed")  # (compressed segments are small: the first one)
    with TieredStore.open(tmp_path / "s") as s:
        with pytest.raises(CorruptStoreError, match="table 'a'"):
            s.peek("a", np.arange(ROWS))
        report = s.verify()
    assert [f["table"] for f in report["damaged"]] == ["a"]
    assert report["damaged"][0]["segment"] >= 0


def test_verify_of_a_whole_store_finds_nothing(tmp_path):
    rows = _store(tmp_path / "s")
    with TieredStore.open(tmp_path / "s") as s:
        report = s.verify()
        np.testing.assert_array_equal(s.peek("a", np.arange(ROWS)), rows["a"])
    assert report["damaged"] == [] and report["rows"] == 2 * ROWS and report["records"] == 0


@pytest.mark.parametrize("move", ["above the mark", "swapped"])
def test_a_segment_under_another_number_stops_the_open(tmp_path, move):
    """A damaged key (a B-tree page has no checksum) would reorder the copies of its rows,
    or, above the checkpoint's mark, have the open delete the checkpoint's own rows: the
    header's CRC covers the segment's number too, and nothing is deleted."""
    import lmdb

    _store(tmp_path / "s")
    with TieredStore.open(tmp_path / "s") as s:  # (a second segment)
        s.write("a", np.arange(ROWS, 2 * ROWS), np.ones((ROWS, 8), np.float32))
    env = lmdb.open(str(tmp_path / "s" / "lmdb"), max_dbs=16)
    db = env.open_db(b"p:a")
    with env.begin(write=True) as txn:
        (k0, v0), (k1, v1) = [(bytes(k), bytes(v)) for k, v in list(txn.cursor(db=db))[:2]]
        if move == "swapped":
            txn.put(k0, v1, db=db)
            txn.put(k1, v0, db=db)
        else:
            txn.delete(k0, db=db)
            txn.put(codec.segment_key(int.from_bytes(k0, "big") + 1000), v0, db=db)
    env.close()
    before = (tmp_path / "s" / "lmdb" / "data.mdb").read_bytes()
    want = "under another number" if move != "swapped" else "its number or its ids"
    with pytest.raises(CorruptStoreError, match=rf"table 'a'.*{want}"):
        TieredStore.open(tmp_path / "s")
    assert (tmp_path / "s" / "lmdb" / "data.mdb").read_bytes() == before  # nothing deleted


@pytest.mark.parametrize("damaged", [[2500], [500, 2500]])
def test_a_read_cut_into_slices_names_the_first_damaged_row(tmp_path, damaged):
    """A read of thousands of rows gathers them in slices on Numba's threads
    (segments.py ``GATHER_SPLIT_FROM``): the error names the first damaged row in read order,
    whichever slice found it, as a read in one slice does."""
    if numba.get_num_threads() < 2:
        pytest.skip("one Numba thread: a read is not cut into slices")
    _store(tmp_path / "s")
    for row in damaged:
        flip_bit(tmp_path / "s", "a", row)
    with TieredStore.open(tmp_path / "s") as s:
        assert split_parts(ROWS, GATHER_SPLIT_FROM) >= 2
        with pytest.raises(CorruptStoreError, match=rf"id {damaged[0]} "):
            s.peek("a", np.arange(ROWS))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=400), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_the_main_process_encodes_a_segment_as_the_writer_process_does(ids, width, fill):
    """``encode_segment`` with the Numba twins (``pack_rows``; ``last_rows`` with ``take_rows``)
    gives the writer process's NumPy bytes, repeated ids included (each id's last row kept)."""
    ids = np.array(ids, dtype=np.int64)
    words = (np.arange(ids.shape[0] * width, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(fill)).astype(
        np.uint32
    )
    rows = words.reshape(-1, width).view(np.float32)
    numpy_ids, numpy_rows = codec.last_rows(ids, rows)
    twin_ids, twin_rows = codec.last_rows(ids, rows, take_rows)
    assert np.array_equal(twin_ids, numpy_ids) and twin_rows.tobytes() == numpy_rows.tobytes()
    want = codec.encode_segment(ids, rows, None, 9)
    assert codec.encode_segment(ids, rows, None, 9, pack_rows).tobytes() == want.tobytes()


@pytest.mark.parametrize("summed", [True, False])
def test_take_checked_copies_as_numpy_and_names_the_first_bad_row(summed):
    """The compaction's take: each row copied as NumPy's fancy indexing would, and the first
    position (in order, whatever the threads) whose row fails its checksum; a version 1
    segment (no checksum word) is copied unchecked."""
    rng = np.random.default_rng(5)
    n, width = 5000, 13
    ids = np.sort(rng.choice(1 << 40, n, replace=False)).astype(np.int64)
    words = rng.integers(0, 2**32, (n, width), dtype=np.uint32)
    records = np.empty((n, width + 1), np.uint32)
    pack_rows(ids, words, records)
    if not summed:
        records = np.ascontiguousarray(records[:, :width])
    src = rng.choice(n, 3000, replace=False)
    dst = rng.permutation(3000)
    out = np.zeros((3000, width), np.uint32)
    assert take_checked(records, src, ids, out, dst) == -1
    want = np.zeros_like(out)
    want[dst] = words[src]
    np.testing.assert_array_equal(out, want)
    records[src[[2500, 700, 1900]], [0, width - 1, 3]] ^= np.uint32(1 << 31)  # three rows damaged
    assert take_checked(records, src, ids, out, dst) == (700 if summed else -1)


def _twice_written(path):
    """Table a, rows 0..ROWS written, then rows 0..ROWS/2 written again: the first copies of
    those are stale, the rest of the first segment's rows live."""
    tiers = TierConfig(hbm_rows=64, ddr_rows=64, device="cpu", background_writes=False)
    rng = np.random.default_rng(9)
    with TieredStore.create(path, TABLES[:1], tiers, seed=3) as s:
        s.write("a", np.arange(ROWS), rng.standard_normal((ROWS, 8)).astype(np.float32))
        s.write("a", np.arange(ROWS // 2), rng.standard_normal((ROWS // 2, 8)).astype(np.float32))
        return s.peek("a", np.arange(ROWS))


def test_compaction_checks_the_rows_it_keeps(tmp_path):
    _twice_written(tmp_path / "s")
    flip_bit(tmp_path / "s", "a", 2000)  # (its one copy: the compaction keeps it)
    with TieredStore.open(tmp_path / "s") as s:
        with pytest.raises(CorruptStoreError, match=r"table 'a'.*checksums: first the row of id 2000"):
            s.engine.ssd.compact(["a"])
        assert [f["bad_ids"] for f in s.verify()["damaged"]] == [[2000]]  # nothing rewritten


def test_compaction_drops_a_damaged_stale_copy_unread(tmp_path):
    rows = _twice_written(tmp_path / "s")
    flip_bit(tmp_path / "s", "a", 10)  # (its first copy: stale, the second one is read)
    with TieredStore.open(tmp_path / "s") as s:
        assert [f["bad_ids"] for f in s.verify()["damaged"]] == [[10]]
        s.engine.ssd.compact(["a"])
        assert s.verify()["damaged"] == []  # (the segment that held it is rewritten)
        np.testing.assert_array_equal(s.peek("a", np.arange(ROWS)), rows)
