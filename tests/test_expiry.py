"""Expiry (``TableConfig.ttl_steps``): a row no update touched for more than ``ttl_steps`` steps of the
store's counter reads as its initial value again, in every tier and after reopening.

- equal bitwise to the reference store (which deletes by the same rule) whatever the tiers,
  the policy, the checkpoints and reopenings, and however the touch logs are held (in
  memory, spilled, in checkpoints);
- the counter is kept with each checkpoint; ``TieredOptimizer.step()`` and ``TrainPipeline``
  move it; what a killed run reopens at is a completed checkpoint (tests/tiers/ssd/test_crashes.py);
- old touch logs leave LMDB; bad settings are ConfigErrors.
"""

import copy

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb import SGD, Adam, ConfigError, RowWiseAdagrad, TableConfig, TierConfig, TieredStore, expiry
from tiered_emb.cache.policies import BASE_POLICIES
from tiered_emb.init import init_rows
from tiered_emb.testing.reference import ReferenceStore

ROWS, DIM = 120, 4


def _tables(ttl=3):
    return [
        TableConfig("a", DIM, ROWS, optimizer=RowWiseAdagrad(lr=0.1), ttl_steps=ttl),
        TableConfig("b", 2, None, optimizer=Adam(lr=0.01), ttl_steps=ttl + 2),
        TableConfig("c", 2, ROWS, optimizer=SGD(lr=0.5)),  # (rows that never expire beside them)
    ]


def _store(path, tables, hbm=8, ddr=8, policy="lru", keep=1, budget=1 << 30):
    tiers = TierConfig(
        hbm_rows=hbm, ddr_rows=ddr, policy=policy, device="cpu", keep_checkpoints=keep, budget_bytes=budget
    )
    s = TieredStore.create(path, tables, tiers, seed=3)
    s.engine.ssd.writeback_rows = 16
    return s


def _step(stores, tables, step: int) -> None:
    """A step's updates: ids from a window that drifts, so old ids stop coming and expire."""
    rng = np.random.default_rng(step)
    for t in tables:
        ids = 3 * step + rng.integers(0, 30, 20)
        ids = ids % ROWS
        g = rng.normal(0.0, 1.0, (20, t.dim)).astype(np.float32)
        for s in stores:
            s.apply_gradients(t.name, ids, g)
    for s in stores:
        s.advance_step()


def _records(s, table):
    ids = np.arange(ROWS)
    return s.peek(table, ids, with_state=True) if isinstance(s, TieredStore) else s.peek_records(table, ids)


def test_a_row_reads_its_initial_value_once_its_ttl_passes(tmp_path):
    cfg = TableConfig("t", DIM, ROWS, optimizer=SGD(lr=0.1), ttl_steps=2)
    s = _store(tmp_path / "s", [cfg])
    first = init_rows(cfg, np.array([1, 2]), 3)
    g = np.ones((1, DIM), np.float32)
    s.apply_gradients("t", [1], g)
    s.apply_gradients("t", [2], g)  # both at step 0
    s.advance_step()
    s.apply_gradients("t", [2], g)  # 2 again at step 1
    seen = []
    for _ in range(3):
        s.advance_step()
        now = s.peek("t", [1, 2])
        seen.append(
            (s.step, bool(np.array_equal(now[0], first[0, :DIM])), bool(np.array_equal(now[1], first[1, :DIM])))
        )
    # updated at 0: trained through step 2, initial from 3; updated at 1: initial from 4
    assert seen == [(2, False, False), (3, True, False), (4, True, True)]
    s.close()


@settings(max_examples=20, deadline=None)
@given(
    hbm=st.sampled_from([4, 16, 200]),
    ddr=st.sampled_from([0, 16]),
    policy=st.sampled_from(BASE_POLICIES),
    cuts=st.lists(st.tuples(st.integers(1, 14), st.sampled_from(["checkpoint", "reopen", "crash"])), max_size=3),
    spill=st.booleans(),
)
def test_expiry_is_the_reference_whatever_the_tiers(tmp_path_factory, hbm, ddr, policy, cuts, spill):
    """Checkpoints, reopenings and crashes (close without a checkpoint: back to the last one,
    the reference too) at any step; with ``spill`` the touch logs are written every step."""
    path = tmp_path_factory.mktemp("e") / "s"
    tables = _tables()
    expiry.HELD_SHARE = 1 << 62 if spill else 8
    try:
        s = _store(path, tables, hbm, ddr, policy)
        ref = ReferenceStore(tables, seed=3)
        saved = (0, copy.deepcopy(ref))  # the reference at the last checkpoint

        step = 0
        while step < 15:
            for at, what in cuts:
                if at != step:
                    continue
                if what == "checkpoint":
                    s.checkpoint()
                    saved = (step, copy.deepcopy(ref))
                elif what == "reopen":
                    s.close()
                    s = TieredStore.open(path)
                    saved = (step, copy.deepcopy(ref))
                else:  # a crash: the store and the reference go back to the last checkpoint
                    s.close(checkpoint=False)
                    s = TieredStore.open(path)
                    step, ref = saved[0], copy.deepcopy(saved[1])
                    cuts = [c for c in cuts if c != (at, what)]
            _step([s, ref], tables, step)
            step += 1
        assert s.step == ref.step
        for t in tables:
            assert _records(s, t.name).tobytes() == _records(ref, t.name).tobytes(), t.name
        s.close()
    finally:
        expiry.HELD_SHARE = 8


def test_the_counter_is_kept_and_moved_by_the_torch_front_end(tmp_path):
    torch = pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbeddingBag, TieredOptimizer

    tables = _tables()
    s = _store(tmp_path / "s", tables)
    bag = TieredEmbeddingBag(s, "a")
    opt = TieredOptimizer(bag)
    for _ in range(3):
        opt.zero_grad()
        bag(torch.tensor([[1, 2]])).sum().backward()
        opt.step()
    assert s.step == 3
    s.checkpoint()
    s.close()
    with TieredStore.open(tmp_path / "s") as s:
        assert s.step == 3


def test_old_touch_logs_leave_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(expiry, "HELD_SHARE", 1 << 62)  # (the logs written every step)
    tables = _tables(ttl=2)
    s = _store(tmp_path / "s", tables)
    for step in range(30):
        _step([s], tables, step)
        if step % 5 == 4:
            s.checkpoint()
    s.close()
    env = lmdb.open(str(tmp_path / "s" / "lmdb"), readonly=True, max_dbs=16, lock=False)
    with env.begin() as txn:
        meta = env.open_db(b"meta", txn=txn, create=False)
        with txn.cursor(db=meta) as cur:
            steps = sorted({int.from_bytes(k[6:14], "big") for k, _ in cur if k.startswith(b"touch:")})
    env.close()
    # the logs a reopening at the last checkpoint (step 30) may still need: its ttl + 1 steps before it
    assert steps and min(steps) >= 30 - 4 - 1 and max(steps) <= 30


@pytest.mark.parametrize("ttl", [0, -1, True, 2.5, 2**31])
def test_bad_ttl_is_a_config_error(ttl):
    with pytest.raises(ConfigError, match="ttl_steps"):
        TableConfig("a", 4, ttl_steps=ttl)


@pytest.mark.parametrize("held", [False, True])
def test_lifecycle_is_the_same_for_every_window_load_ahead_and_thread_count(tmp_path, held):
    """Admission and expiry on a table trained through TrainPipeline (fused or held updates):
    the same rows with no prefetch, a window of 3 loading 1 or 2 ahead, on 1 or 2 threads,
    and as tiny tiers give."""
    torch = pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbeddingBag, TieredOptimizer, TrainPipeline

    cfg = TableConfig("a", DIM, ROWS, optimizer=RowWiseAdagrad(lr=0.1), min_count=2, ttl_steps=3)
    batches = []
    for step in range(14):
        rng = np.random.default_rng(step)
        batches.append(torch.from_numpy((2 * step + rng.integers(0, 25, (8, 3))) % ROWS))
    results = []
    for k, (window, load, threads, hbm) in enumerate([(0, 0, 1, 64), (3, 1, 2, 64), (3, 2, 1, 64), (3, 1, 1, 200)]):
        tiers = TierConfig(hbm_rows=hbm, ddr_rows=8, policy="lookahead+lru", device="cpu")
        s = TieredStore.create(tmp_path / f"s{k}", [cfg], tiers, seed=3)
        torch.manual_seed(0)
        bag = TieredEmbeddingBag(s, "a")
        opt = TieredOptimizer(bag) if held else None
        pipe = TrainPipeline(
            s,
            bag,
            opt,
            lambda b: {"a": b.reshape(-1).numpy()},
            lambda m, b: m(b).square().sum(),
            lookahead_batches=window,
            load_ahead=load,
            step_threads=threads,
        )
        for _ in pipe.run(iter(batches)):
            pass
        assert s.step == 14
        results.append(s.peek("a", np.arange(ROWS), with_state=True).tobytes())
        s.close()
    assert all(r == results[0] for r in results)


def test_an_expired_row_is_gone_for_readers_and_export_after_its_checkpoint(tmp_path):
    from tiered_emb.apps.portable import export_store

    cfg = TableConfig("t", DIM, ROWS, optimizer=SGD(lr=0.1), ttl_steps=1)
    s = _store(tmp_path / "s", [cfg])
    s.write("t", np.arange(10), np.ones((10, DIM), np.float32))  # written at step 0
    s.checkpoint()
    for _ in range(3):
        s.apply_gradients("t", [5], np.ones((1, DIM), np.float32))  # 5 kept alive
        s.advance_step()
    s.checkpoint()
    s.close()
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        got = r.peek("t", np.arange(10))
    first = init_rows(cfg, np.arange(10), 3)[:, :DIM]
    assert np.array_equal(np.delete(got, 5, axis=0), np.delete(first, 5, axis=0))
    assert not np.array_equal(got[5], first[5])
    assert export_store(tmp_path / "s", tmp_path / "x")["t"] == 1
    assert np.load(tmp_path / "x" / "t.ids.npy").tolist() == [5]
