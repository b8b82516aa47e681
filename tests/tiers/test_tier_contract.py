"""The contract every tier keeps, in the manner of zarr's ``StoreTests``: one suite, run
against every tier directly, through what the tiers share: :class:`tiered_emb.tiers.Tier`.

A *put* writes records (weights, then optimizer state: float32 (n, width)) as dirty rows
and returns the dirty rows it pushed out (HBM's victims, DDR's dirty evictions; never any
for SSD); a *read* returns the records and a found mask without changing cache state;
``capacity_rows`` is the most rows a tier holds (None: unbounded, the SSD tier).  Then:
rows read back bitwise, the newest put wins, ids never put are absent, residents never
exceed the capacity, no row is lost or stale (resident with its newest record, or pushed
out carrying it), the same puts give the same tier, and an SSD checkpoint survives a
reopen.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb.tiers import DdrTier, DirectHbmTier, HbmTier, SsdSettings, SsdTier, Tier

WIDTH = 5  # 3 weights + 2 optimizer-state columns
NUM_IDS = 24  # ids 0 .. NUM_IDS - 1 (a DirectHbmTier holds exactly these)
CAP = 4
TABLE = "t"
ALL_IDS = np.arange(NUM_IDS, dtype=np.int64)


def open_ssd(path, compression, background, existing=False) -> SsdTier:
    """An SSD tier of one table at ``path``, as ``TieredStore.create`` / ``open`` make it."""
    settings = SsdSettings(
        widths={TABLE: WIDTH},
        rows={TABLE: NUM_IDS},
        compression=compression,
        map_size_bytes=1 << 22,
        writeback_rows=3,  # a few puts reach p: in LMDB, the rest wait in memory
        background_writes=background,
    )
    tier = SsdTier(path, settings, existing=existing)
    if not existing:  # as TieredStore.create: an empty checkpoint to reopen at
        tier.checkpoint({}, {"epoch": 0}, None)
    return tier


_paths = itertools.count()
SSD = {  # kind -> (compression, background writes)
    "ssd": (None, False),
    "ssd-background": (None, True),
    "ssd-zstd": (3, False),
    "ssd-zstd-background": (3, True),
}
CACHES = {
    "hbm-lru": lambda: HbmTier(CAP, WIDTH, "lru", np),
    "hbm-lfu": lambda: HbmTier(CAP, WIDTH, "lfu", np),
    "direct-hbm": lambda: DirectHbmTier(NUM_IDS, WIDTH, np),
    "ddr-lru": lambda: DdrTier(CAP, WIDTH, "lru"),
    "ddr-lfu": lambda: DdrTier(CAP, WIDTH, "lfu"),
}
KINDS = sorted([*CACHES, *SSD])


@contextlib.contextmanager
def fresh_tier(kind: str, where):
    """A new tier of ``kind`` (an SSD tier's table under ``where``), closed on leaving."""
    if kind in CACHES:
        yield CACHES[kind]()
        return
    ssd = open_ssd(where / f"s{next(_paths)}", *SSD[kind])
    try:
        yield ssd.table(TABLE)
    finally:
        ssd.close()


@pytest.fixture(scope="module", params=KINDS)
def make(request, tmp_path_factory):
    """A factory of fresh tiers of one kind (``with make() as tier``)."""
    where = tmp_path_factory.mktemp(request.param)
    return lambda: fresh_tier(request.param, where)


def held_ids(tier: Tier) -> np.ndarray:
    """The ids ``tier`` holds (increasing), found by reading every id."""
    return ALL_IDS[tier.read(ALL_IDS)[1]]


def records(ids, step: int) -> np.ndarray:
    """Records distinct per (id, put): a stale or misplaced row never equals the expected one."""
    ids = np.asarray(ids, dtype=np.int64)
    out = ids[:, None] * 8.0 + step * 1000.0 + np.arange(WIDTH) * 0.125 + 0.1
    out[:, -1] *= -1  # optimizer state of either sign
    return out.astype(np.float32)


def bitwise(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def replay(tier: Tier, batches):
    """Put each batch in turn; returns the newest record per id and the newest pushed-out copy per id."""
    newest, pushed = {}, {}
    for step, batch in enumerate(batches):
        ids = np.asarray(batch, dtype=np.int64)
        rows = records(ids, step)
        out_ids, out_rows = tier.put(ids, rows)
        pushed.update(zip(out_ids.tolist(), out_rows, strict=True))
        newest.update(zip(batch, rows, strict=True))
        assert tier.capacity_rows is None or held_ids(tier).shape[0] <= tier.capacity_rows
    return newest, pushed


batch_lists = st.lists(st.lists(st.integers(0, NUM_IDS - 1), min_size=1, max_size=7, unique=True), max_size=8)
few = settings(max_examples=min(settings.default.max_examples, 10), deadline=None)


def test_a_row_put_is_read_back_bitwise(make):
    ids = np.array([3, 0, 2], dtype=np.int64)  # within every capacity: nothing is pushed out
    rows = records(ids, 1)
    rows[0, 3] = -0.0  # a bitwise compare tells -0.0 from 0.0
    with make() as tier:
        assert isinstance(tier, Tier) and tier.width == WIDTH
        out_ids, out_rows = tier.put(ids, rows)
        assert out_ids.shape == (0,) and out_rows.shape == (0, WIDTH)
        got, found = tier.read(ids)
        assert found.all() and bitwise(got, rows)


def test_rows_of_another_shape_are_refused(make):
    from tiered_emb.errors import RowShapeError

    with make() as tier:
        with pytest.raises(RowShapeError, match="shape"):
            tier.put(np.array([1, 2], dtype=np.int64), np.zeros((2, WIDTH + 1), dtype=np.float32))
        assert not tier.read(ALL_IDS)[1].any()


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
        if tier.capacity_rows is not None:  # a cache tier's own count agrees with what it reads
            assert tier.resident_rows == held_ids(tier).shape[0] == np.sort(tier.resident()[1]).shape[0]


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
        assert set(ids[found].tolist()) == set(held_ids(tier).tolist())


@few
@given(batches=batch_lists)
def test_the_same_puts_give_the_same_tier(make, batches):
    with make() as a, make() as b:
        pushed_a, pushed_b = replay(a, batches)[1], replay(b, batches)[1]
        assert np.array_equal(held_ids(a), held_ids(b))
        assert bitwise(a.read(ALL_IDS)[0], b.read(ALL_IDS)[0])
        assert sorted(pushed_a) == sorted(pushed_b)
        assert all(bitwise(pushed_a[i], pushed_b[i]) for i in pushed_a)


@pytest.mark.parametrize("kind", sorted(SSD))
@few
@given(batches=batch_lists)
def test_a_checkpoint_survives_a_reopen(kind, tmp_path_factory, batches):
    path = tmp_path_factory.mktemp(kind) / "s"
    ssd = open_ssd(path, *SSD[kind])
    try:
        newest, _ = replay(ssd.table(TABLE), batches)
        ssd.checkpoint({}, {"epoch": 1}, None)
    finally:
        ssd.close()
    ssd = open_ssd(path, *SSD[kind], existing=True)  # as TieredStore.open does
    try:
        assert ssd.read_meta() == {"epoch": 1}
        ssd.discard_pending()
        tier = ssd.table(TABLE)
        ids = np.array(sorted(newest), dtype=np.int64)
        got, found = tier.read(ids)
        assert found.all() and bitwise(got, np.reshape([newest[i] for i in ids.tolist()], (-1, WIDTH)))
        assert held_ids(tier).tolist() == ids.tolist()
    finally:
        ssd.close()


def test_an_ssd_table_not_in_the_tier_is_a_typed_error(tmp_path):
    from tiered_emb.errors import UnknownTableError

    ssd = open_ssd(tmp_path / "s", None, False)
    try:
        with pytest.raises(UnknownTableError, match="tables: \\['t'\\]"):
            ssd.table("nope")
    finally:
        ssd.close()


def test_a_share_of_a_shared_tier_refuses_a_put():
    """One table's share of a pooled tier reads as a tier, but its put could push out other
    tables' rows, which its answer cannot name: a TypeError, the tier unchanged."""
    from tiered_emb.tiers.pool import DdrShare, HbmShare

    for share in (
        HbmShare(HbmTier(CAP, WIDTH, "lru", np, shared=True), 1, WIDTH),
        DdrShare(DdrTier(CAP, WIDTH, "lru", shared=True), 1, WIDTH),
    ):
        with pytest.raises(TypeError, match="other tables"):
            share.put(np.array([1], dtype=np.int64), records([1], 0))
        assert not share.read(ALL_IDS)[1].any()
