"""The contract every tier keeps, in the manner of zarr's ``StoreTests``: one suite, run
against every tier through a small adapter that exposes only what the tiers share.

A *put* writes records (weights, then optimizer state: float32 (n, width)) as dirty rows;
a *read* returns the records and a found mask without changing cache state; *capacity*
is the most rows a tier holds (None: unbounded, the SSD tier); a put returns the dirty
rows it pushed out (HBM's victims, DDR's dirty evictions; never any for SSD).  Then:
rows read back bitwise, the newest put wins, ids never put are absent, residents never
exceed the capacity, no row is lost or stale (resident with its newest record, or pushed
out carrying it), the same puts give the same tier, and an SSD checkpoint survives a
reopen.  Adapters drive the tiers as :mod:`tiered_emb.step.resolve` does, through their
public methods only.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb.tiers import DdrTier, DirectHbmTier, HbmTier, SsdTier

WIDTH = 5  # 3 weights + 2 optimizer-state columns
NUM_IDS = 24  # ids 0 .. NUM_IDS - 1 (a DirectHbmTier holds exactly these)
CAP = 4
TABLE = "t"
ALL_IDS = np.arange(NUM_IDS, dtype=np.int64)


class CacheAdapter:
    """HBM (:class:`HbmTier`, :class:`DirectHbmTier`) and DDR (:class:`DdrTier`)."""

    def __init__(self, tier):
        self.tier = tier
        self.capacity = tier.capacity_rows

    def read(self, ids):
        slots = self.tier.find(ids)
        found = slots >= 0
        rows = np.zeros((ids.shape[0], WIDTH), dtype=np.float32)
        if found.any():
            rows[found] = self._rows_at(slots[found])
        return rows, found

    def resident_rows(self) -> int:
        return self.tier.resident_rows

    def resident_ids(self) -> np.ndarray:
        return np.sort(self.tier.resident()[1])

    def close(self) -> None:
        pass


class HbmAdapter(CacheAdapter):
    def put(self, ids, rows) -> dict[int, np.ndarray]:
        """Chunks of at most the unpinned capacity, as ``Resolver.chunks``; dirty victims go out."""
        out = {}
        step = self.tier.unpinned_capacity
        for start in range(0, ids.shape[0], step):
            chunk = ids[start : start + step]
            slots, _, vids, vrows, vdirty, pinned = self.tier.resolve(chunk)
            for i in np.flatnonzero(vdirty):
                out[int(vids[i])] = vrows[i].copy()
            self.tier.fill(slots, rows[start : start + step], np.ones(chunk.shape[0], dtype=np.uint8))
            if pinned:
                self.tier.release(slots)
        return out

    def _rows_at(self, slots):
        return self.tier.rows_at(slots)


class DdrAdapter(CacheAdapter):
    def put(self, ids, rows) -> dict[int, np.ndarray]:
        """Admit takes absent ids only: a resident id is taken out first (exclusive caching)."""
        self.tier.take(ids, np.empty((ids.shape[0], WIDTH), dtype=np.float32), np.empty(ids.shape[0], dtype=np.uint8))
        ev_ids, ev_rows, _ = self.tier.admit(ids, rows, np.ones(ids.shape[0], dtype=np.uint8))
        return {int(i): r.copy() for i, r in zip(ev_ids, ev_rows, strict=True)}

    def _rows_at(self, slots):
        return self.tier.records[slots]


class SsdAdapter:
    capacity = None

    def __init__(self, path, compression, background, existing=False):
        self.args = (path, compression, background)
        self.tier = SsdTier(
            path,
            {TABLE: WIDTH},
            compression,
            1 << 22,
            writeback_rows=3,  # a few puts reach p: in LMDB, the rest wait in memory
            background_writes=background,
            table_rows={TABLE: NUM_IDS},
            existing=existing,
        )
        if not existing:  # as TieredStore.create: an empty checkpoint to reopen at
            self.tier.checkpoint({}, {"epoch": 0}, None)

    def put(self, ids, rows) -> dict[int, np.ndarray]:
        self.tier.write_pending({TABLE: (ids, rows)}, durable=False)
        return {}

    def read(self, ids):
        rows = np.zeros((ids.shape[0], WIDTH), dtype=np.float32)
        found = self.tier.read(TABLE, ids, rows)
        return rows, found

    def resident_ids(self) -> np.ndarray:  # no public listing: every id it could hold, read
        return ALL_IDS[self.read(ALL_IDS)[1]]

    def resident_rows(self) -> int:
        return self.resident_ids().shape[0]

    def reopen(self) -> SsdAdapter:
        """Checkpoint, close, and open the path again as ``TieredStore.open`` does."""
        self.tier.checkpoint({}, {"epoch": 1}, None)
        self.close()
        again = SsdAdapter(*self.args, existing=True)
        assert again.tier.read_meta() == {"epoch": 1}
        again.tier.discard_pending()
        return again

    def close(self) -> None:
        self.tier.close()


_paths = itertools.count()
KINDS = {
    "hbm-lru": lambda d: HbmAdapter(HbmTier(CAP, WIDTH, "lru", np)),
    "hbm-lfu": lambda d: HbmAdapter(HbmTier(CAP, WIDTH, "lfu", np)),
    "direct-hbm": lambda d: HbmAdapter(DirectHbmTier(NUM_IDS, WIDTH, np)),
    "ddr-lru": lambda d: DdrAdapter(DdrTier(CAP, WIDTH, "lru")),
    "ddr-lfu": lambda d: DdrAdapter(DdrTier(CAP, WIDTH, "lfu")),
    "ssd": lambda d: SsdAdapter(d / f"s{next(_paths)}", None, False),
    "ssd-background": lambda d: SsdAdapter(d / f"s{next(_paths)}", None, True),
    "ssd-zstd": lambda d: SsdAdapter(d / f"s{next(_paths)}", 3, False),
    "ssd-zstd-background": lambda d: SsdAdapter(d / f"s{next(_paths)}", 3, True),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def make(request, tmp_path_factory):
    """A factory of fresh adapters of one kind, closed on leaving its ``with``."""
    where = tmp_path_factory.mktemp(request.param)

    @contextlib.contextmanager
    def fresh():
        adapter = KINDS[request.param](where)
        try:
            yield adapter
        finally:
            adapter.close()

    return fresh


def records(ids, step: int) -> np.ndarray:
    """Records distinct per (id, put): a stale or misplaced row never equals the expected one."""
    ids = np.asarray(ids, dtype=np.int64)
    out = ids[:, None] * 8.0 + step * 1000.0 + np.arange(WIDTH) * 0.125 + 0.1
    out[:, -1] *= -1  # optimizer state of either sign
    return out.astype(np.float32)


def bitwise(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def replay(adapter, batches):
    """Put each batch in turn; returns the newest record per id and the newest pushed-out copy per id."""
    newest, pushed = {}, {}
    for step, batch in enumerate(batches):
        ids = np.asarray(batch, dtype=np.int64)
        rows = records(ids, step)
        pushed.update(adapter.put(ids, rows))
        newest.update(zip(batch, rows, strict=True))
        assert adapter.capacity is None or adapter.resident_rows() <= adapter.capacity
    return newest, pushed


batch_lists = st.lists(st.lists(st.integers(0, NUM_IDS - 1), min_size=1, max_size=7, unique=True), max_size=8)
few = settings(max_examples=min(settings.default.max_examples, 10), deadline=None)


def test_a_row_put_is_read_back_bitwise(make):
    ids = np.array([3, 0, 2], dtype=np.int64)  # within every capacity: nothing is pushed out
    rows = records(ids, 1)
    rows[0, 3] = -0.0  # a bitwise compare tells -0.0 from 0.0
    with make() as tier:
        assert tier.put(ids, rows) == {}
        got, found = tier.read(ids)
        assert found.all() and bitwise(got, rows)


def test_the_newest_put_wins(make):
    with make() as tier:
        tier.put(np.array([5, 7], dtype=np.int64), records([5, 7], 0))
        tier.put(np.array([5], dtype=np.int64), records([5], 1))
        got, found = tier.read(np.array([5, 7], dtype=np.int64))
        assert found.all() and bitwise(got, np.concatenate([records([5], 1), records([7], 0)]))


def test_ids_never_put_are_absent(make):
    with make() as tier:
        _, found = tier.read(ALL_IDS)
        assert not found.any()
        tier.put(np.array([1, 4], dtype=np.int64), records([1, 4], 0))
        _, found = tier.read(ALL_IDS)
        assert ALL_IDS[found].tolist() == [1, 4]


@few
@given(batches=batch_lists)
def test_residents_never_exceed_the_capacity(make, batches):
    with make() as tier:
        replay(tier, batches)  # checks after every put
        assert tier.resident_rows() == tier.resident_ids().shape[0] == int(tier.read(ALL_IDS)[1].sum())


@few
@given(batches=batch_lists)
def test_no_row_is_lost_or_stale(make, batches):
    """Every id put is resident with its newest record, or was pushed out carrying it."""
    with make() as tier:
        newest, pushed = replay(tier, batches)
        ids = np.array(sorted(newest), dtype=np.int64)
        got, found = tier.read(ids)
        for i, row, here in zip(ids.tolist(), got, found, strict=True):
            kept = row if here else pushed.get(i)
            assert kept is not None, f"id {i} is neither resident nor pushed out"
            assert bitwise(kept, newest[i]), f"id {i} holds a stale record"
        assert set(ids[found].tolist()) == set(tier.resident_ids().tolist())


@few
@given(batches=batch_lists)
def test_the_same_puts_give_the_same_tier(make, batches):
    with make() as a, make() as b:
        pushed_a, pushed_b = replay(a, batches)[1], replay(b, batches)[1]
        assert np.array_equal(a.resident_ids(), b.resident_ids())
        assert bitwise(a.read(ALL_IDS)[0], b.read(ALL_IDS)[0])
        assert sorted(pushed_a) == sorted(pushed_b)
        assert all(bitwise(pushed_a[i], pushed_b[i]) for i in pushed_a)


@pytest.mark.parametrize("kind", [k for k in sorted(KINDS) if k.startswith("ssd")])
@few
@given(batches=batch_lists)
def test_a_checkpoint_survives_a_reopen(kind, tmp_path_factory, batches):
    tier = KINDS[kind](tmp_path_factory.mktemp(kind))
    try:
        newest, _ = replay(tier, batches)
        tier = tier.reopen()
        ids = np.array(sorted(newest), dtype=np.int64)
        got, found = tier.read(ids)
        assert found.all() and bitwise(got, np.reshape([newest[i] for i in ids.tolist()], (-1, WIDTH)))
        assert tier.resident_ids().tolist() == ids.tolist()
    finally:
        tier.close()
