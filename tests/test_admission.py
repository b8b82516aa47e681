"""Admission (``TableConfig.min_count``): an id's gradients apply from the update that sees it for
the ``min_count``-th time; before, it reads as its initial value and nothing of it reaches LMDB.

- exact counts (a bounded table that fits ``admission_bytes``) equal the reference store
  bitwise whatever the tiers, the policy and the path (fused, pooled with pinned rows);
- the count-min sketch of an unbounded table never admits an id late;
- the counts are saved with each checkpoint: reopen and ``open(snapshot=n)`` restore them;
- bad settings are ConfigErrors.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb import SGD, ConfigError, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.admission import Admission
from tiered_emb.cache.policies import BASE_POLICIES
from tiered_emb.init import init_rows
from tiered_emb.testing.reference import ReferenceStore

ROWS, DIM = 300, 4


def _tables(min_count=3):
    return [
        TableConfig("a", DIM, ROWS, optimizer=RowWiseAdagrad(lr=0.1), min_count=min_count),
        TableConfig("b", 2, ROWS, optimizer=SGD(lr=0.5)),
    ]


def _store(path, tables, hbm=8, ddr=8, policy="lru", keep=1):
    tiers = TierConfig(hbm_rows=hbm, ddr_rows=ddr, policy=policy, device="cpu", keep_checkpoints=keep)
    s = TieredStore.create(path, tables, tiers, seed=5)
    s.engine.ssd.writeback_rows = 16
    return s


def _step(stores, tables, step: int, n: int = 30) -> None:
    rng = np.random.default_rng(step)
    for t in tables:
        ids = rng.zipf(1.3, n) % ROWS
        g = rng.normal(0.0, 1.0, (n, t.dim)).astype(np.float32)
        for s in stores:
            s.apply_gradients(t.name, ids, g)


def _all(s, table="a"):
    ids = np.arange(ROWS)
    return s.peek(table, ids, with_state=True) if isinstance(s, TieredStore) else s.peek_records(table, ids)


def test_an_id_updates_from_its_min_count_th_sighting(tmp_path):
    s = _store(tmp_path / "s", _tables())
    first = s.peek("a", [1, 2], with_state=True)
    g = np.ones((3, DIM), np.float32)
    s.apply_gradients("a", [1, 1, 2], g)  # one sighting each (a batch is one)
    s.apply_gradients("a", [1, 2], g[:2])
    assert s.peek("a", [1, 2], with_state=True).tobytes() == first.tobytes()
    s.apply_gradients("a", [1], g[:1])  # id 1's third: admitted, updated
    now = s.peek("a", [1, 2], with_state=True)
    assert not np.array_equal(now[0], first[0]) and now[1].tobytes() == first[1].tobytes()
    s.flush()
    _, chunks = s.engine.ssd.stored_ids("a")
    assert 2 not in np.concatenate([*chunks, np.empty(0, np.int64)]).tolist()  # nothing of it in LMDB
    s.close()


@settings(max_examples=20, deadline=None)
@given(
    hbm=st.sampled_from([4, 16, 300]),
    ddr=st.sampled_from([0, 16]),
    policy=st.sampled_from(BASE_POLICIES),
    cuts=st.lists(st.integers(1, 11), max_size=3),
)
def test_admission_is_the_reference_whatever_the_tiers_and_reopens(tmp_path_factory, hbm, ddr, policy, cuts):
    """Exact counts, equal to the reference's, through checkpoints and reopenings at any steps."""
    path = tmp_path_factory.mktemp("a") / "s"
    tables = _tables()
    s = _store(path, tables, hbm, ddr, policy)
    ref = ReferenceStore(tables, seed=5)
    for step in range(12):
        if step in cuts:
            s.close()
            s = TieredStore.open(path)
        _step([s, ref], tables, step)
    for t in tables:
        assert _all(s, t.name).tobytes() == _all(ref, t.name).tobytes()
    s.close()


def test_the_pooled_step_with_pinned_rows_admits_as_the_reference(tmp_path):
    torch = pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbeddingBag

    tables = _tables(min_count=2)
    s = _store(tmp_path / "s", tables, hbm=64, policy="lookahead+lru")
    ref = ReferenceStore(tables, seed=5)
    bag = TieredEmbeddingBag(s, "a", mode="sum")
    for step in range(8):
        rng = np.random.default_rng(step)
        ids = rng.integers(0, 20, 12)
        offsets = np.arange(0, 12, 3)
        grad = rng.normal(0.0, 1.0, (4, DIM)).astype(np.float32)
        ticket = s.prefetch({"a": ids})
        s.engine.drain_prefetch()
        with s.engine.stepping(ticket):  # (every row pinned: the update runs on the forward's slots)
            bag(torch.from_numpy(ids), torch.from_numpy(offsets)).backward(torch.from_numpy(grad))
        s.release(ticket)
        ref.apply_gradients("a", ids, np.repeat(grad, 3, axis=0))
    assert _all(s).tobytes() == _all(ref).tobytes()
    s.close()


def test_the_counts_of_a_kept_checkpoint_come_back_with_it(tmp_path):
    tables = _tables()
    s = _store(tmp_path / "s", tables, keep=8)
    g = np.ones((1, DIM), np.float32)
    s.apply_gradients("a", [7], g)
    one = s.checkpoint()
    s.apply_gradients("a", [7], g)
    s.checkpoint()
    first = s.peek("a", [7], with_state=True)
    s.close()
    with TieredStore.open(tmp_path / "s") as s:  # two sightings kept: the third admits
        s.apply_gradients("a", [7], g)
        assert not np.array_equal(s.peek("a", [7], with_state=True), first)
    with TieredStore.open(tmp_path / "s", snapshot=one) as s:  # one sighting: the second does not
        s.apply_gradients("a", [7], g)
        assert s.peek("a", [7], with_state=True).tobytes() == first.tobytes()
        s.apply_gradients("a", [7], g)
        assert not np.array_equal(s.peek("a", [7], with_state=True), first)


def test_a_sketch_never_admits_late_and_rarely_early():
    """An unbounded table's count-min sketch: every id is admitted by its min_count-th
    sighting; collisions admit some early, fewer the more bytes (under 1 % of 20,000 ids
    seen twice each in 256 KiB)."""
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(0, 2**62, 20_000))
    early = {}
    for nbytes in (4096, 1 << 18):
        adm = Admission(TableConfig("u", 4, None, min_count=3, admission_bytes=nbytes))
        first = adm.sight(ids)
        second = adm.sight(ids)
        third = adm.sight(ids)
        assert third.all()  # never late
        early[nbytes] = float((first | second).mean())
    assert early[1 << 18] < early[4096]
    assert early[1 << 18] < 0.01


def test_exact_counts_for_a_bounded_table_that_fits():
    adm = Admission(TableConfig("a", 4, 1000, min_count=2, admission_bytes=4096))
    assert adm.exact and adm.counts.nbytes == 1000
    assert adm.sight(np.array([5, 6])).tolist() == [False, False]
    assert adm.sight(np.array([6, 7])).tolist() == [True, False]


@pytest.mark.parametrize("field,value", [("min_count", 0), ("min_count", 256), ("admission_bytes", 100)])
def test_bad_admission_settings_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=field):
        TableConfig("a", 4, **{field: value})


def test_an_id_never_admitted_reads_its_initial_value(tmp_path):
    s = _store(tmp_path / "s", _tables(min_count=255))
    for step in range(5):
        _step([s], _tables(min_count=255), step)
    assert _all(s).tobytes() == init_rows(_tables()[0], np.arange(ROWS), 5).tobytes()
    s.close()
