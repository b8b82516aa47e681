"""The rows written since the last checkpoint, as segments in ``p:``: the index, compaction,
damaged segments and stores written in the format before segments."""

import json
from pathlib import Path

import lmdb
import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb._jit import split_parts
from tiered_emb.errors import CorruptStoreError, StoreFormatError
from tiered_emb.testing import crash, faults, random_updates
from tiered_emb.testing.reference import ReferenceStore
from tiered_emb.tiers.ssd import codec
from tiered_emb.tiers.ssd.compaction import Compactor
from tiered_emb.tiers.ssd.index import FIND_SPLIT_FROM, POS_BITS, SegmentIndex
from tiered_emb.tiers.ssd.segments import SegmentLog
from tiered_emb.tiers.ssd.writer_client import WriterProcess

TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=300, optimizer=SGD(lr=0.5)),
]


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2**62), max_size=40, unique=True), max_size=12),
    st.lists(st.integers(0, 2**62), max_size=20),
    st.integers(1, 50),
    st.booleans(),
    st.sampled_from([None, 2**32, 2**40, 1000]),
    st.integers(1, 4),
)
def test_the_index_answers_as_a_dict(segments, probes, delta_rows, small_ids, num_rows, bucket_rows):
    """Sorted arrays found through a directory, a hash of new ids and their merges
    (``delta_rows`` small: many merges, in place from the back; ids drawn small: many of them
    again, changed in the arrays), ids kept as uint32 for tables of at most 2**32 rows."""
    ix, model = SegmentIndex(delta_rows, num_rows), {}
    ix.DIR_MIN_ROWS, ix.BUCKET_ROWS = 0, bucket_rows  # (a directory even for a few rows)
    assert ix.ids.dtype == (np.uint32 if num_rows in (2**32, 1000) else np.int64)
    for seq, ids in enumerate(segments):
        ids = [x % 64 for x in ids] if small_ids else [x % (num_rows or 2**63) for x in ids]
        ids = list(dict.fromkeys(ids))
        old = ix.add(seq, np.array(ids, dtype=np.int64))
        assert old.tolist() == [model.get(x, -1) for x in ids]
        model.update({x: (seq << POS_BITS) + i for i, x in enumerate(ids)})
        assert len(ix) == len(model)
        held = sorted(model)
        assert ix.find(np.array(held, dtype=np.int64)).tolist() == [model[x] for x in held]
    ask = sorted(model)[:20] + probes + sorted(probes)
    assert ix.find(np.array(ask, dtype=np.int64)).tolist() == [model.get(x, -1) for x in ask]
    ids, locs = ix.items()
    assert ids.dtype == np.int64 and ids.tolist() == sorted(model)
    assert locs.tolist() == [model[x] for x in sorted(model)]
    if num_rows is not None:
        with pytest.raises(ValueError, match="cannot be indexed"):
            ix.add(len(segments), np.array([num_rows], dtype=np.int64))
    ix.clear()
    assert len(ix) == 0 and ix.find(np.array([1])).tolist() == [-1]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2**20), max_size=40), max_size=14),
    st.lists(st.integers(0, 2**20), max_size=30),
    st.integers(1, 20),
    st.integers(1, 9),
    st.sampled_from([None, 1 << 21]),
    st.integers(0, 3),
    st.sampled_from(["here", "begun", "stale"]),
)
def test_a_merge_in_slices_answers_as_a_dict_between_its_steps(
    segments, probes, delta_rows, rows, num_rows, pace, start
):
    """The writer merges the hash of new ids into the arrays ``rows`` moves at a time, letting
    the tier's lock go between steps, while the next write-back's segments are added (``pace``
    steps of the merge between two segments; 0: the merge runs whole first): every find
    between two steps answers as a dict, the segments added meanwhile included, and so does
    the index after the merge.  ``start``: the merge takes the hash's entries itself; or is
    begun (the hash frozen) and given them after a segment was added meanwhile; or is given
    entries taken before the last segment changed the hash (stale: it must take them again)."""
    ix, model = SegmentIndex(delta_rows, num_rows), {}
    ix.DIR_MIN_ROWS, ix.BUCKET_ROWS = 0, 2
    steps = None

    def check(extra=()):
        ask = np.array(sorted(model) + probes + list(extra), dtype=np.int64)
        assert ix.find(ask).tolist() == [model.get(int(x), -1) for x in ask]
        assert len(ix) == len(model)

    items = None
    for seq, raw in enumerate(segments):
        ids = np.array(sorted({x % 200 if seq % 2 else x for x in raw}), dtype=np.int64)
        if steps is None and ix.merge_due:
            if start == "begun":
                held = ix.begin_merge()
                check(ids)
                assert ix.add(seq, ids).tolist() == [model.get(int(x), -1) for x in ids]
                model.update({int(x): (seq << POS_BITS) + i for i, x in enumerate(ids)})
                check()
                steps = ix.merge_slices(rows, (*ix.delta_items(held), held[3]))
                continue
            steps = ix.merge_slices(rows, items if start == "stale" else None)
        for _ in range(pace if steps is not None and pace else 0):
            if next(steps, False) is not None:
                steps = None
                break
            check(ids)
        if steps is not None and pace == 0:
            for _ in steps:
                check(ids)
            steps = None
        items = (*ix.delta_items(), ix.delta_version)  # (before the add: stale if it changes the hash)
        assert ix.add(seq, ids).tolist() == [model.get(int(x), -1) for x in ids]
        model.update({int(x): (seq << POS_BITS) + i for i, x in enumerate(ids)})
        check()
    for _ in steps or ():
        check()
    assert not ix.merge_due or ix.n_delta >= ix.delta_rows
    held = sorted(model)
    assert ix.find(np.array(held, dtype=np.int64)).tolist() == [model[x] for x in held]
    got_ids, got_locs = ix.items()
    assert got_ids.tolist() == held and got_locs.tolist() == [model[x] for x in held]


def test_a_merge_whose_allocation_fails_leaves_the_index_whole(monkeypatch):
    """A merge that cannot allocate (before any row moves) raises, and the index answers as
    before with the changes taken meanwhile in; the next merge runs."""
    ix, model = SegmentIndex(4, 1 << 20), {}
    ix.DIR_MIN_ROWS = 0

    def add(seq, ids):
        assert ix.add(seq, np.array(ids)).tolist() == [model.get(x, -1) for x in ids]
        model.update({x: (seq << POS_BITS) + i for i, x in enumerate(ids)})

    add(0, list(range(0, 200, 2)))
    add(1, [1, 3, 5, 7, 9])  # (the hash: a merge is due)
    assert ix.merge_due
    held = ix.begin_merge()
    add(2, [3, 4, 11])  # (taken aside while the merge is under way)

    def no_room(*args):
        raise MemoryError("no room")

    monkeypatch.setattr(SegmentIndex, "_new_dir", no_room)
    with pytest.raises(MemoryError):
        next(ix.merge_slices(items=(*ix.delta_items(held), held[3])))
    ask = np.array(sorted(model) + [6, 13], dtype=np.int64)
    assert ix.find(ask).tolist() == [model.get(int(x), -1) for x in ask] and len(ix) == len(model)
    monkeypatch.undo()
    assert ix.merge_due
    for _ in ix.merge_slices():
        pass
    got_ids, got_locs = ix.items()
    assert got_ids.tolist() == sorted(model) and got_locs.tolist() == [model[x] for x in sorted(model)]
    assert ix.n_delta == 0 and ix.ids.shape[0] == len(model)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**20), max_size=40), max_size=12), st.integers(1, 20), st.booleans())
def test_positions_found_before_the_last_change_are_searched_again(segments, delta_rows, grow):
    """A writer finds where a segment's ids lie with the tier's lock let go (``positions`` of a
    ``view``), here a view taken before the segment added last: after a merge or an append
    moved the arrays, ``add`` must search again; else it uses them.  Answers as a dict."""
    ix, model = SegmentIndex(delta_rows, 1 << 21), {}
    ix.DIR_MIN_ROWS = 0
    view = ix.view()
    for seq, raw in enumerate(segments):
        top = max(model, default=0) + 1
        ids = np.array(sorted({top + x % 1000 if grow and seq % 3 == 0 else x % 64 for x in raw}), dtype=np.int64)
        found = SegmentIndex.positions(view, ids)
        view = ix.view()
        assert ix.add(seq, ids, found).tolist() == [model.get(int(x), -1) for x in ids]
        model.update({int(x): (seq << POS_BITS) + i for i, x in enumerate(ids)})
        held = sorted(model)
        assert ix.find(np.array(held, dtype=np.int64)).tolist() == [model[x] for x in held]


@pytest.mark.parametrize(("num_rows", "per_row"), [(1 << 30, 12.5), (None, 16.5)])
def test_the_index_takes_its_bytes_a_row(num_rows, per_row):
    """2**18 random ids of a table of 2**30 ids (kept as uint32) or of an unbounded one,
    merged and looked up once (the directory built): 12 or 16 bytes a row of arrays, and
    at most half a byte a row of directory."""
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(0, 1 << 30, 300_000))[: 1 << 18]
    rng.shuffle(ids)
    ix = SegmentIndex(1 << 16, num_rows)
    for seq, a in enumerate(range(0, ids.shape[0], 1 << 14)):
        ix.add(seq, np.sort(ids[a : a + (1 << 14)]))
    ix.merge()
    probe = np.sort(ids[:1000])
    assert (ix.find(probe) >= 0).all()
    assert len(ix) == 1 << 18 and ix.covered == 1 << 18
    assert ix.nbytes <= per_row * (1 << 18) + 16 * 16 + 64, ix.nbytes / (1 << 18)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 200), max_size=40, unique=True), max_size=14),
    st.integers(1, 60),
    st.sampled_from([None, 1000]),
    st.integers(1, 300),
)
def test_an_opening_load_indexes_as_adding_one_by_one(segments, delta_rows, num_rows, cut_rows):
    """Opening a store takes every segment's ids in a range of ids at a time (each range's
    copies sorted together, the newest of each id kept): the same index as adding the
    segments one at a time, and as many rows named in each segment, whatever the ranges."""
    one, loaded = SegmentIndex(delta_rows, num_rows), SegmentIndex(delta_rows, num_rows)
    loaded.DIR_MIN_ROWS = 0
    runs = []
    for seq, ids in enumerate(segments):
        ids = np.array(sorted(ids), dtype=np.int64)
        one.add(seq, ids)
        runs.append((seq, ids))
    live = loaded.load_runs(runs, cut_rows)
    for a, b in zip(one.items(), loaded.items(), strict=True):
        assert a.tolist() == b.tolist()
    probe = np.arange(0, 202, dtype=np.int64)
    assert loaded.find(probe).tolist() == one.find(probe).tolist()
    named = one.items()[1] >> POS_BITS
    assert live.tolist() == np.bincount(named, minlength=len(segments)).tolist()[: live.shape[0]]
    assert live.sum() == len(one)


def test_an_opening_load_cuts_ranges_of_about_the_rows_asked():
    """Many runs over a wide range of ids, cut into ranges of about 1,000 copies: the same
    index as one range, and no range sorted more than 1,000 + 64 a run copies (counted
    where they are merged)."""
    from tiered_emb.tiers.ssd import index as index_module

    rng = np.random.default_rng(3)
    runs = [(q, np.unique(rng.integers(0, 1 << 20, 500))) for q in range(40)]
    whole = SegmentIndex(1 << 10, 1 << 20)
    whole.load_runs(runs, 1 << 30)
    sizes = []
    real = index_module.merge_runs

    def counting(cat, *args):
        sizes.append(cat.shape[0])
        return real(cat, *args)

    index_module.merge_runs = counting
    try:
        cut = SegmentIndex(1 << 10, 1 << 20)
        cut.load_runs(runs, 1000)
    finally:
        index_module.merge_runs = real
    for a, b in zip(whole.items(), cut.items(), strict=True):
        assert a.tolist() == b.tolist()
    assert len(sizes) >= 15 and max(sizes) <= 1000 + 64 * len(runs)
    with pytest.raises(ValueError, match="empty index"):
        cut.load_runs(runs, 1000)


def test_the_index_appends_past_its_directory():
    """Rows appended above every id held are searched as one run after the directory's
    buckets until it is built again; merges drop it."""
    ix = SegmentIndex(1 << 20, 1 << 30)
    ix.DIR_MIN_ROWS = 0
    ids = np.arange(0, 3000, 3, dtype=np.int64)
    ix.add(0, ids)
    assert ix.find(ids).tolist() == list(range(ids.shape[0]))  # (builds the directory)
    covered = ix.covered
    ix.add(1, np.array([3001, 3003, 5000], dtype=np.int64))  # appended: too few to build again
    assert ix.covered == covered
    q = np.array([2997, 2998, 3001, 3002, 3003, 4999, 5000, 5001], dtype=np.int64)
    one = 1 << POS_BITS
    assert ix.find(q).tolist() == [ids.shape[0] - 1, -1, one, -1, one + 1, -1, one + 2, -1]
    ix.add(2, np.array([1, 2], dtype=np.int64))  # below: to the hash
    ix.merge()
    assert ix.covered == 0
    assert ix.find(np.array([0, 1, 2, 3, 5000])).tolist() == [0, 2 * one, 2 * one + 1, 1, one + 2]


def _train(s, ref, steps, seed=0, n=64):
    random_updates((s, ref), TABLES, steps, seed, n, ids_below=300)


def _same_rows(s, ref):
    for t in TABLES:
        ids = np.arange(300)
        np.testing.assert_array_equal(s.peek(t.name, ids, with_state=True), ref.peek_records(t.name, ids))


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("compression", [None, 3])
def test_compaction_bounds_p_and_keeps_every_row(tmp_path, monkeypatch, background, compression):
    """Rows evicted again and again leave stale copies in ``p:``; compaction rewrites the live
    ones, and reads, reopening at the latest write and checkpoints find the same rows."""
    monkeypatch.setattr(Compactor, "COMPACT_MIN_ROWS", 200)
    s = TieredStore.create(
        tmp_path / "s",
        TABLES,
        TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", background_writes=background, ssd_compression=compression),
        seed=4,
    )
    s.engine.ssd.writeback_rows = 32
    ref = ReferenceStore(TABLES, seed=4)
    compactions = faults.compactions(s)
    _train(s, ref, 60)
    s.engine.ssd.wait_writes()
    assert compactions and s.engine.ssd.failed_write is None
    for t in TABLES:  # bounded: at most the ratio times the live rows, and one write-back's worth past it
        rows = s.engine.ssd.table_stats(t.name)
        assert rows["stored_rows"] <= Compactor.COMPACT_RATIO * rows["rows"] + 2 * 32 + 200
    _same_rows(s, ref)
    s.flush()
    crash(s)
    with TieredStore.open(tmp_path / "s", restore="latest") as r:
        _same_rows(r, ref)
        _train(r, ref, 10, seed=1)
    with TieredStore.open(tmp_path / "s") as r:
        _same_rows(r, ref)


def test_copies_a_kept_checkpoint_reads_leave_compaction_due_no_longer(tmp_path, monkeypatch):
    """Three kept checkpoints each read their own copy of every row: copies no run can free
    before the marks move.  Once a run has found a segment so, it counts on neither side of
    the bound, so the store stops compacting where the rest is within it (counted, the
    stale copies kept it past the bound for good, and every write-back waited for the
    writer to compact ever harder); every row and checkpoint reads back."""
    monkeypatch.setattr(Compactor, "COMPACT_MIN_ROWS", 200)
    tiers = TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", background_writes=False, keep_checkpoints=3)
    s = TieredStore.create(tmp_path / "s", TABLES, tiers, seed=4)
    s.engine.ssd.writeback_rows = 32
    ref = ReferenceStore(TABLES, seed=4)
    ids = np.arange(300)
    for k in range(3):  # every row of "a" written out, then kept by a checkpoint
        _train(s, ref, 10, seed=k)
        s.write("a", ids, s.peek("a", ids) + np.float32(0.5))
        ref.write("a", ids, ref.lookup("a", ids) + np.float32(0.5))
        s.checkpoint()
    _train(s, ref, 40, seed=3)
    ssd = s.engine.ssd
    with s.engine.lock:
        ssd.compact()
    runs = ssd.compactor.runs
    rows = ssd.table_stats("a")
    assert rows["stored_rows"] > Compactor.COMPACT_RATIO * rows["rows"]  # (past the bound, counted whole)
    assert ssd.compactor.due() == []
    with s.engine.lock:
        ssd.compactor.step()
    assert ssd.compactor.runs == runs
    _same_rows(s, ref)
    s.close()
    with TieredStore.open(tmp_path / "s") as r:
        assert len(r.snapshots()) == 3
        _same_rows(r, ref)


def test_a_write_back_compacts_the_run_from_the_stalest_segment(tmp_path, monkeypatch):
    """The run a write-back compacts begins at the segment with the smallest share of live
    rows among those at least half stale (the fewest rows copied for the rows freed),
    wherever the cursor of the runs in number order stands; the rows read back."""
    monkeypatch.setattr(Compactor, "COMPACT_MIN_ROWS", 1 << 40)  # (none until asked)
    s = TieredStore.create(
        tmp_path / "s", TABLES, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", background_writes=False), seed=4
    )
    s.engine.ssd.writeback_rows = 32
    ref = ReferenceStore(TABLES, seed=4)
    _train(s, ref, 60)
    seg = s.engine.ssd.segments
    with seg.lmdb.reading() as txn, txn.cursor(db=seg.lmdb.pending["a"]) as cur:
        seqs = [int.from_bytes(k, "big") for k in cur.iternext(keys=True, values=False)]
    share = {q: seg.live[q] / seg.nrows[q] for q in seqs if seg.nrows[q] > 0 and 2 * seg.live[q] <= seg.nrows[q]}
    stalest = min(share, key=lambda q: (share[q], q))
    compactor = s.engine.ssd.compactor
    compactor.cursor["a"] = max(seqs) + 1  # (in number order from the cursor, no run is left)
    with s.engine.lock:
        assert compactor.compact_run("a", stalest=True)
    assert seg.nrows[stalest] == seg.live[stalest]  # (rewritten: its live rows alone, or gone)
    assert compactor.cursor["a"] == max(seqs) + 1
    _same_rows(s, ref)
    s.close()


def test_a_staged_read_across_a_compaction_is_discarded(tmp_path, monkeypatch):
    s = TieredStore.create(
        tmp_path / "s", TABLES, TierConfig(hbm_rows=8, device="cpu", background_writes=False), seed=4
    )
    ref = ReferenceStore(TABLES, seed=4)
    for seed in range(4):  # each flush writes the rows the step changed: copies of the first go stale
        _train(s, ref, 5, seed=seed)
        s.flush()
    ssd = s.engine.ssd
    ids = np.arange(300)
    real = ssd.reader.read_lmdb

    def read_after_compaction(*args):
        runs = ssd.compactor.runs
        with s.engine.lock:
            ssd.compact(["a"])
        assert ssd.compactor.runs > runs
        return real(*args)

    monkeypatch.setattr(ssd.reader, "read_lmdb", read_after_compaction)
    before = dict(ssd.staging)
    assert ssd.stage(7, {"a": ids}) is False
    assert ssd.staging["discarded"] == before["discarded"] + 1 and 7 not in ssd.held.staged
    monkeypatch.undo()
    _same_rows(s, ref)
    s.close()


def _segments_of(path, table):
    env = lmdb.open(str(path / "lmdb"), max_dbs=16)
    with env.begin() as txn:
        got = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=env.open_db(b"p:" + table.encode(), txn=txn))]
    return env, got


@pytest.mark.parametrize("damage", ["magic", "width", "short", "order", "key"])
def test_a_damaged_segment_is_a_corrupt_store(tmp_path, damage):
    s = TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, device="cpu"), seed=4)
    _train(s, ReferenceStore(TABLES, seed=4), 5)
    s.flush()
    crash(s)
    env, got = _segments_of(tmp_path / "s", "b")
    key, value = got[0]
    head = codec.SEGMENT_HEADER
    n = head.unpack_from(value)[3]
    if damage == "magic":
        value = b"XSEG" + value[4:]
    elif damage == "width":
        value = head.pack(b"TSEG", 2, 0, n, 5, 0) + value[head.size :]
    elif damage == "short":
        value = value[:-4]
    elif damage == "order":
        ids = np.frombuffer(value, "<i8", n, head.size)[::-1].copy()
        value = value[: head.size] + ids.tobytes() + value[head.size + 8 * n :]
    with env.begin(write=True) as txn:
        db = env.open_db(b"p:b", txn=txn)
        if damage == "key":
            txn.delete(key, db=db)
            txn.put(b"\x01" + key, value, db=db)
        else:
            txn.put(key, value, db=db)
    env.close()
    with pytest.raises(CorruptStoreError, match="segment"):
        TieredStore.open(tmp_path / "s", restore="latest")
    with TieredStore.open(tmp_path / "s") as r:  # at its checkpoint it opens: p: is dropped unread
        _same_rows(r, ReferenceStore(TABLES, seed=4))
    env, got = _segments_of(tmp_path / "s", "b")
    env.close()
    assert got == []


def _records(path, rows):
    """Make the closed store at ``path`` one of format tiered_emb/2: ``rows`` ({table: (ids,
    records)}: its checkpoint) as one record per id in ``t:``, no segment, no mark."""
    env = lmdb.open(str(path / "lmdb"), max_dbs=16)
    with env.begin(write=True) as txn:
        for t, (ids, recs) in rows.items():
            txn.drop(env.open_db(b"p:" + t.encode(), txn=txn), delete=False)
            codec.put_rows(txn, env.open_db(b"t:" + t.encode(), txn=txn), ids, recs, None)
        txn.delete(b"mark", db=env.open_db(b"meta", txn=txn))
    env.close()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = "tiered_emb/2"
    (path / "manifest.json").write_text(json.dumps(manifest))


def _closed_as_records(s, path):
    """Close ``s`` (at ``path``) and rewrite it as a store of format tiered_emb/2."""
    rows = {t.name: (np.arange(300), s.peek(t.name, np.arange(300), with_state=True)) for t in TABLES}
    s.close()
    _records(path, rows)


def test_a_store_of_records_opens_and_its_rows_move_to_segments(tmp_path):
    """A store of format tiered_emb/2 (rows of its checkpoint one record per id in ``t:``, rows
    since in segments) opens either way; its records are read below the segments."""
    s = TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, device="cpu"), seed=4)
    ref = ReferenceStore(TABLES, seed=4)
    _train(s, ref, 5)
    _closed_as_records(s, tmp_path / "s")
    with TieredStore.open(tmp_path / "s") as r:
        assert r.engine.ssd.lmdb.records["a"] and r.engine.ssd.pending_rows("a")["live"] == 0
        _same_rows(r, ref)
        _train(r, ref, 5, seed=1)
        r.flush()
        crash(r)
    with TieredStore.open(tmp_path / "s", restore="latest") as r:
        assert json.loads((tmp_path / "s" / "manifest.json").read_text())["format"] == "tiered_emb/3"
        _same_rows(r, ref)
    with TieredStore.open(tmp_path / "s") as r:
        _same_rows(r, ref)


def test_a_store_of_the_first_format_is_refused_naming_it(tmp_path):
    """A store of format tiered_emb/1 (rows after its checkpoint one record per id) is
    refused by the writer and by readers, with the version named, and nothing of it changes."""
    TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, device="cpu"), seed=4).close()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["format"] = "tiered_emb/1"
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in sorted((tmp_path / "s").rglob("*")) if p.is_file()}
    for open_it in (lambda: TieredStore.open(tmp_path / "s"), lambda: TieredStore.open(tmp_path / "s", mode="r")):
        with pytest.raises(StoreFormatError, match="tiered_emb/1") as err:
            open_it()
        assert err.value.hint
    assert {p.name: p.read_bytes() for p in sorted((tmp_path / "s").rglob("*")) if p.is_file()} == before


def test_a_write_committed_but_not_answered_is_written_again_above_it(tmp_path, monkeypatch):
    """The writer process commits, then dies before its reply: the rows still wait in memory
    and their next write must append above the segments it left (not fail on their numbers)."""
    s = TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"), seed=4)
    s.engine.ssd.writeback_rows = 32
    ref = ReferenceStore(TABLES, seed=4)
    real, lost = WriterProcess.write, []

    def write(self, segments, map_size):
        reply = real(self, segments, map_size)
        if not lost:
            lost.append(reply)
            raise CorruptStoreError("the LMDB writer process ended before its reply", "try again")
        return reply

    monkeypatch.setattr(WriterProcess, "write", write)
    with pytest.raises(CorruptStoreError):
        _train(s, ref, 30)
        s.engine.ssd.wait_writes()
        s.engine.ssd.raise_failed_write()
    _train(s, ref, 30, seed=1)  # (the failed step above was not applied: the reference has it too)
    s.engine.ssd.wait_writes()
    assert lost == [{"ok": True}] and s.engine.ssd.failed_write is None
    _same_rows(s, ref)
    s.flush()
    crash(s)
    with TieredStore.open(tmp_path / "s", restore="latest") as r:
        _same_rows(r, ref)


def test_a_staged_read_across_a_checkpoint_and_new_writes_is_discarded(tmp_path, monkeypatch):
    s = TieredStore.create(
        tmp_path / "s", TABLES, TierConfig(hbm_rows=8, device="cpu", background_writes=False), seed=4
    )
    rng = np.random.default_rng(0)
    for _ in range(5):
        for t in TABLES:
            ids = rng.integers(0, 300, 64)
            s.apply_gradients(t.name, ids, rng.standard_normal((64, t.dim)).astype(np.float32))
    s.flush()  # p:a now holds segments whose positions go up to ~300
    ssd = s.engine.ssd
    assert ssd.pending_rows("a")["live"] > 50
    real = ssd.reader.read_lmdb
    width = ssd.widths["a"]

    def checkpoint_and_write_between(*args):
        with s.engine.lock:  # what another thread does meanwhile: a checkpoint, then write-backs
            ssd.checkpoint({}, ssd.read_meta(), None)
            for i in range(10):  # segments 0..9 of p:a, one row each
                ssd.write_pending({"a": (np.array([1000 + i]), np.ones((1, width), np.float32))})
        return real(*args)

    monkeypatch.setattr(ssd.reader, "read_lmdb", checkpoint_and_write_between)
    assert ssd.stage(7, {"a": np.arange(300)}) is False  # (raised CorruptStoreError while the numbers restarted)
    monkeypatch.undo()
    s.close()


def test_rows_cut_into_segments_of_the_cap(tmp_path, monkeypatch):
    """A write or a compaction of more rows than a segment holds makes several segments (LMDB
    refuses a value of 4 GiB or more); reads, compaction and reopening follow them."""
    monkeypatch.setattr(SegmentLog, "rows_per_segment", lambda self, table: 7)
    monkeypatch.setattr(Compactor, "COMPACT_MIN_ROWS", 100)
    s = TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"), seed=4)
    s.engine.ssd.writeback_rows = 32
    ref = ReferenceStore(TABLES, seed=4)
    _train(s, ref, 40)
    s.flush()
    _same_rows(s, ref)
    crash(s)
    env, got = _segments_of(tmp_path / "s", "a")
    env.close()
    sizes = [codec.SEGMENT_HEADER.unpack_from(v)[3] for _, v in got]
    assert max(sizes) == 7 and len(sizes) > 10
    with TieredStore.open(tmp_path / "s", restore="latest") as r:
        _same_rows(r, ref)


def test_a_disk_full_in_a_compaction_is_raised_typed_and_loses_nothing(tmp_path, monkeypatch):
    """A compaction whose transaction fails (a full disk) rolls back: the error is raised as
    StoreFullError by the next operation, before it changes anything; every row is intact,
    and the next write-back compacts after all."""
    from tiered_emb.errors import StoreFullError

    monkeypatch.setattr(Compactor, "COMPACT_MIN_ROWS", 100)
    s = TieredStore.create(
        tmp_path / "s", TABLES, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", background_writes=False), seed=4
    )
    s.engine.ssd.writeback_rows = 32
    ref = ReferenceStore(TABLES, seed=4)
    real, fail = Compactor.needed, [True]

    def needed(self, *args):
        if fail[0]:
            fail[0] = False
            raise StoreFullError("no space left on device", "free some")
        return real(self, *args)

    monkeypatch.setattr(Compactor, "needed", needed)
    raised = 0
    for seed in range(40):
        try:
            _train(s, ref, 1, seed=seed)
        except StoreFullError:
            raised += 1  # (the step that raised it changed nothing: the reference skips it too)
    assert raised == 1 and not fail[0] and s.engine.ssd.compactor.runs > 0
    _same_rows(s, ref)
    s.close()
    with TieredStore.open(tmp_path / "s") as r:
        _same_rows(r, ref)


def test_a_large_batch_of_finds_cut_into_slices_answers_as_a_dict():
    """Finds of thousands of ids run in slices on Numba's threads (index.py ``FIND_SPLIT_FROM``):
    the same answers as a dict, ids held in the sorted arrays and in the hash of new ids alike."""
    if numba.get_num_threads() < 2:
        pytest.skip("one Numba thread: finds are not cut into slices")
    rng = np.random.default_rng(4)
    ids = rng.choice(10**9, 60_000, replace=False).astype(np.int64)
    ix = SegmentIndex(num_rows=10**9)
    model = {}
    for seq, part in enumerate(np.array_split(ids, 6)):
        ix.add(seq, part)
        model.update({int(x): (seq << POS_BITS) | p for p, x in enumerate(part)})
    probe = np.concatenate([ids[::3], rng.integers(0, 10**9, 9_000)])
    rng.shuffle(probe)
    assert split_parts(probe.shape[0], FIND_SPLIT_FROM) >= 2
    assert ix.find(probe).tolist() == [model.get(int(x), -1) for x in probe]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5000), max_size=60, unique=True), min_size=1, max_size=12),
    st.integers(0, 14),
)
def test_merge_runs_sorts_runs_together_keeping_the_newest_copy(runs, shift):
    """The kernel an opening store merges a range with: whatever the buckets' width (one
    id each, up to all in one bucket, sorted by insertion or by merge sort), the ids in
    order, one copy each, the one from the latest run, at its place in that run."""
    from tiered_emb.tiers.ssd.sorted_index import merge_runs

    runs = [np.array(sorted(r), dtype=np.int64) for r in runs]
    cat = np.concatenate(runs)
    starts = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum([r.shape[0] for r in runs], out=starts[1:])
    bases = np.array([(q << POS_BITS) + 7 for q in range(len(runs))], dtype=np.int64)
    want: dict[int, int] = {}
    for q, r in enumerate(runs):
        want.update({int(x): int(bases[q]) + i for i, x in enumerate(r)})
    lo = int(cat.min()) if cat.shape[0] else 0
    span = (int(cat.max()) - lo + 1) if cat.shape[0] else 1
    ids, locs = np.empty_like(cat), np.empty_like(cat)
    counts = np.empty(((span - 1) >> shift) + 2, dtype=np.int64)
    m = merge_runs(cat, starts, bases, lo, shift, ids, locs, counts)
    assert ids[:m].tolist() == sorted(want)
    assert locs[:m].tolist() == [want[x] for x in sorted(want)]


def test_an_opening_load_takes_ids_up_to_the_top_of_int64():
    """A table without ``num_rows`` may hold any id below 2**63: the load's buckets over
    the ranges' spans stay within int64, and the index is the one of adding one by one."""
    rng = np.random.default_rng(9)
    top = np.iinfo(np.int64).max
    runs = [(q, np.unique(rng.integers(top - (1 << (10 * q + 10)), top, 300, dtype=np.int64))) for q in range(6)]
    one, loaded = SegmentIndex(1 << 10), SegmentIndex(1 << 10)
    for q, ids in runs:
        one.add(q, ids)
    loaded.load_runs(runs + [(6, runs[0][1][::3])], 200)
    one.add(6, runs[0][1][::3])
    for a, b in zip(one.items(), loaded.items(), strict=True):
        assert a.tolist() == b.tolist()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_the_row_map_asks_for_no_readahead(tmp_path):
    """Rows are gathered from this process's own map of data.mdb at random; the map is
    advised so (MADV_RANDOM, ``rr`` in smaps): a fault must not read the device's readahead
    around it, which under a memory limit evicts pages still in use."""
    cfg = TableConfig("a", dim=64, optimizer=RowWiseAdagrad(lr=0.1))
    with TieredStore.create(tmp_path / "s", [cfg], TierConfig(hbm_rows=64, ddr_rows=0, device="cpu"), seed=0) as s:
        ids = np.arange(5000)
        s.write("a", ids, np.ones((5000, 64), dtype=np.float32))
        s.flush()
        s.lookup("a", ids[:64])  # read from the segments through the map
        maps, flags = [], {}
        current = None
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                current = line if line.endswith("data.mdb") and str(tmp_path) in line else None
                if current:
                    maps.append(current)
            elif current and line.startswith("VmFlags:"):
                flags[current] = line.split()[1:]
        read_only = [m for m in maps if m.split()[1].startswith("r--")]
        assert read_only, maps
        assert all("rr" in flags[m] for m in read_only), flags


def test_a_segment_names_its_rows_dtype_and_a_read_checks_it(tmp_path):
    """Version 3 headers carry the rows' dtype: a manifest edited to read float16 rows of
    dim 4 (two words) as float32 rows of dim 2 (as many words) is damage, not a silent misread."""
    from tiered_emb.errors import CorruptStoreError

    cfg = TableConfig("t", dim=4, dtype="float16", optimizer=SGD(lr=0.1))
    with TieredStore.create(tmp_path / "s", [cfg], TierConfig(8, 0, "lru", "cpu"), seed=1) as s:
        s.write("t", np.arange(100), np.ones((100, 4), np.float32))
        s.checkpoint()
        assert s.verify()["damaged"] == []
    manifest = tmp_path / "s" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["tables"][0].update(dim=2, dtype="float32")
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match="dtype code 1, the table's 0"):
        with TieredStore.open(tmp_path / "s") as s:
            s.peek("t", np.arange(100))


@pytest.mark.parametrize("compression", [None, 3])
def test_a_read_across_mapped_and_unmapped_segments_gives_the_rows_written(tmp_path, compression):
    """One read of ids from a large segment (its rows on overflow pages of their own, read
    through the map of data.mdb) and from a small one (inside a leaf page, read by a get),
    in a mixed order, after a reopen: every row as written.  Compressed segments are read
    by gets only."""
    cfg = TableConfig("a", dim=8, num_rows=100_000, optimizer=RowWiseAdagrad(lr=0.1))
    tiers = TierConfig(hbm_rows=16, ddr_rows=0, device="cpu", ssd_compression=compression)
    rng = np.random.default_rng(3)
    big, small = np.arange(20_000), np.array([60_001, 60_002, 60_003])
    rows_big = rng.standard_normal((big.shape[0], 8)).astype(np.float32)
    rows_small = rng.standard_normal((3, 8)).astype(np.float32)
    with TieredStore.create(tmp_path / "s", [cfg], tiers, seed=0) as s:
        s.write("a", big, rows_big)
        s.checkpoint()
        s.write("a", small, rows_small)
        s.checkpoint()
    ids = np.array([5, 60_002, 19_999, 60_001, 17, 60_003, 12_345])
    want = np.stack([rows_big[i] if i < big.shape[0] else rows_small[i - small[0]] for i in ids])
    with TieredStore.open(tmp_path / "s") as s:
        assert np.array_equal(np.asarray(s.lookup("a", ids, admit=False)), want)
        assert np.array_equal(s.peek("a", ids)[:, :8], want)
        assert np.array_equal(np.asarray(s.lookup("a", ids)), want)
