"""Lookahead prefetch: results unchanged for every depth, the thread is safe and leaves nothing behind."""

import dataclasses
import threading

import numpy as np
import pytest

from tiered_emb import Adam, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.errors import ConfigError, IdRangeError, PrefetchError
from tiered_emb.prefetch import Window, lookahead
from tiered_emb.sim.traces import zipf_ids
from tiered_emb.step.plan import plan_bags
from tiered_emb.testing import faults, full_disk_for
from tiered_emb.testing.reference import ReferenceStore
from tiered_emb.tiers.pool import slot_floats

TABLES = [
    TableConfig("u", dim=4, optimizer=RowWiseAdagrad(lr=0.2)),
    TableConfig("v", dim=3, num_rows=400, optimizer=Adam(lr=0.05)),
]


def batches(n, seed, max_size=40):
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n):
        size = int(rng.integers(1, max_size))
        out.append(
            {
                "u": zipf_ids(300, 1.1, size, seed=seed * 1000 + b),
                "v": zipf_ids(400, 0.9, size, seed=seed * 1000 + b + 500),
            }
        )
    return out


def train(store, data, depth, checkpoint_every=0, load_ahead=1, read_ahead=0, pooled=False):
    """With ``pooled`` each id is a bag of its own through the torch modules' path (the
    same arithmetic, so the same reference), which reads rows pinned for the step unlocked."""
    for step, b in enumerate(lookahead(store, data, lambda x: x, depth, load_ahead, read_ahead)):
        for name in sorted(b):
            if pooled:
                plan = plan_bags(b[name], np.arange(b[name].shape[0] + 1))
                rows, fwd = store.engine.lookup_pooled(name, plan)
                store.engine.apply_pooled_gradients(name, fwd, rows * np.float32(0.5) + np.float32(0.01))
                continue
            rows = store.lookup(name, b[name])
            store.apply_gradients(name, b[name], np.asarray(rows) * np.float32(0.5) + np.float32(0.01))
        if checkpoint_every and step % checkpoint_every == checkpoint_every - 1:
            store.checkpoint()
        with store.engine.lock:  # the kept pinned count is the real one, whatever the thread is doing
            for t in (store.engine.table(n) for n in store.tables):
                assert t.hbm.pinned_rows == np.count_nonzero(t.hbm.pins)


def step(store, b):
    """One training step of batch ``b`` through the store's plain calls (the reference's arithmetic)."""
    for name in sorted(b):
        rows = store.lookup(name, b[name])
        store.apply_gradients(name, b[name], np.asarray(rows) * np.float32(0.5) + np.float32(0.01))


def close_keeping_errors(store, raised):
    """``store.close()``, its PrefetchError (if any) appended to ``raised``."""
    try:
        store.close()
    except PrefetchError as err:
        raised.append(err)


def reference(data, tables=TABLES):
    ref = ReferenceStore(tables, seed=4)
    for b in data:
        for name in sorted(b):
            rows = ref.lookup(name, b[name])
            ref.apply_gradients(name, b[name], rows * np.float32(0.5) + np.float32(0.01))
    return ref


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("policy", ["lru", "lookahead+lru", "lookahead+lfu"])
@pytest.mark.parametrize("hbm, ddr", [(8, 0), (24, 16), (1000, 0)])
def test_results_identical_for_every_depth(tmp_path, policy, hbm, ddr, pooled):
    _every_depth(tmp_path, TABLES, policy, hbm, ddr, pooled)


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_narrow_rows_identical_for_every_depth(tmp_path, dtype, pooled):
    """Rows of a narrow dtype round stochastically from bits of (seed, table, step, update,
    id, column): the window's depth, load and read-ahead distances change nothing either."""
    tables = [dataclasses.replace(TABLES[0], dtype=dtype), dataclasses.replace(TABLES[1], dtype=dtype)]
    _every_depth(tmp_path, tables, "lookahead+lru", 24, 16, pooled)


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("policy", ["lru", "lookahead+lru"])
def test_tiers_shared_by_the_tables_identical_for_every_depth(tmp_path, policy, pooled):
    """One HBM and one DDR tier for both tables (sized in bytes): the window pins rows of
    each table in the same slots, and a table's miss may push the other's rows down."""
    hbm_slot, ddr_slot = (4 * f for f in slot_floats(TABLES))
    tiers = TierConfig(policy=policy, device="cpu", hbm_bytes=40 * hbm_slot, ddr_bytes=24 * ddr_slot)
    _every_depth(tmp_path, TABLES, policy, 0, 0, pooled, tiers)


def _every_depth(tmp_path, tables, policy, hbm, ddr, pooled, tiers=None):
    data = batches(25, seed=1)
    ref = reference(data, tables)
    # window, how far ahead rows come up, how far ahead LMDB is read; evicted rows written every 3 or 65,536
    for depth, load, read, wb in (
        (0, 0, 0, 3),
        (1, 1, 0, 3),
        (4, 0, 0, 65536),
        (4, 1, 0, 3),
        (4, 4, 0, 65536),
        (1, 0, 1, 3),
        (4, 0, 1, 3),
        (4, 0, 4, 65536),
        (4, 1, 2, 3),
    ):
        with TieredStore.create(
            tmp_path / f"{depth}_{load}_{read}", tables, tiers or TierConfig(hbm, ddr, policy, "cpu"), seed=4
        ) as s:
            s.engine.ssd.writeback_rows = wb
            train(s, data, depth, load_ahead=load, read_ahead=read, pooled=pooled)
            for name, n in (("u", 300), ("v", 400)):
                np.testing.assert_array_equal(
                    s.peek(name, np.arange(n), with_state=True), ref.peek_records(name, np.arange(n))
                )
            assert int(s.engine.table("u").hbm.pins.sum()) == 0


def train_bags(store, data, depth, load_ahead):
    """Pooled forward and fused update per table (the torch modules' path), in a lookahead loop."""
    for b in lookahead(store, data, lambda x: {k: v[0] for k, v in x.items()}, depth, load_ahead):
        for name in sorted(b):
            ids, offsets = b[name]
            plan = plan_bags(ids, offsets, None, mean=(name == "v"))
            out, fwd = store.engine.lookup_pooled(name, plan)
            store.engine.apply_pooled_gradients(name, fwd, out * np.float32(0.5) + np.float32(0.01))


@pytest.mark.parametrize("hbm, ddr", [(8, 0), (60, 16), (1000, 0)])
def test_pooled_step_on_rows_pinned_for_it_is_exact(tmp_path, monkeypatch, hbm, ddr):
    """A batch whose rows a ticket pinned is pooled and updated from those slots without
    the lock; results equal no prefetch bit for bit, and with pins beyond the tier the
    step takes the locked path for the rows left below."""
    rng = np.random.default_rng(7)
    data = []
    for b in batches(20, seed=3):
        data.append(
            {
                k: (v, np.sort(np.concatenate([[0, v.shape[0]], rng.integers(0, v.shape[0] + 1, 3)])))
                for k, v in b.items()
            }
        )
    taken = []
    real = Window.pinned_batch

    def spy(self, table, ids):
        got = real(self, table, ids)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(Window, "pinned_batch", spy)
    want = None
    for depth, load in ((0, 0), (1, 1), (4, 1), (4, 4), (4, 0)):
        taken.clear()
        with TieredStore.create(
            tmp_path / f"{depth}_{load}", TABLES, TierConfig(hbm, ddr, "lookahead+lru", "cpu"), seed=4
        ) as s:
            train_bags(s, data, depth, load)
            got = [s.peek(name, np.arange(n), with_state=True) for name, n in (("u", 300), ("v", 400))]
            assert int(s.engine.table("u").hbm.pins.sum()) == 0
        if want is None:
            want = got
        else:
            for g, w in zip(got, want, strict=False):
                np.testing.assert_array_equal(g, w)
        if load > 0 and hbm >= 60:
            assert sum(taken) > len(taken) // 2  # most steps found their rows pinned for them
        if depth == 0:
            assert not any(taken)
        if hbm == 8 and load == 4:
            assert not all(taken)  # 4 batches of pins do not fit in 8 rows


def test_prefetch_raises_hit_rate_of_the_step(tmp_path):
    data = batches(30, seed=2, max_size=30)
    rates = {}
    for depth in (0, 2):
        with TieredStore.create(tmp_path / f"{depth}", TABLES, TierConfig(64, 0, "lookahead+lru", "cpu"), seed=4) as s:
            hits = looks = 0
            for b in lookahead(s, data, lambda x: x, depth, load_ahead=1):
                before = s.stats()["u"]["hbm"]
                s.lookup("u", b["u"])
                after = s.stats()["u"]["hbm"]
                hits += after["hits"] - before["hits"]
                looks += after["lookups"] - before["lookups"]
            rates[depth] = hits / looks
    assert rates[2] == 1.0 and rates[0] < 1.0


def test_stress_random_sizes_capacities_checkpoints_and_close(tmp_path):
    rng = np.random.default_rng(7)
    for trial in range(6):
        data = batches(int(rng.integers(5, 25)), seed=100 + trial, max_size=int(rng.integers(2, 60)))
        ref = reference(data)
        path = tmp_path / f"s{trial}"
        tiers = TierConfig(
            int(rng.integers(2, 40)),
            int(rng.integers(0, 20)),
            str(rng.choice(["lru", "lfu", "lookahead+lru", "lookahead+lfu", "fifo", "lookahead+sieve"])),
            "cpu",
        )
        depth = int(rng.integers(1, 6))
        load = int(rng.integers(0, depth + 1))
        read = int(rng.integers(0, depth + 1))
        wb = int(rng.choice([1, 5, 1 << 16]))
        stop = int(rng.integers(1, len(data) + 1))
        pooled = trial % 2 == 1
        s = TieredStore.create(path, TABLES, tiers, seed=4)
        s.engine.ssd.writeback_rows = wb
        train(
            s,
            data[:stop],
            depth,
            checkpoint_every=int(rng.integers(1, 5)),
            load_ahead=load,
            read_ahead=read,
            pooled=pooled,
        )
        s.close()  # mid-way: close drains and joins
        with TieredStore.open(path, tiers=TierConfig(int(rng.integers(2, 40)), 3, "lookahead+lfu", "cpu")) as s:
            s.engine.ssd.writeback_rows = wb
            train(s, data[stop:], depth, load_ahead=load, read_ahead=read, pooled=pooled)
            for name, n in (("u", 300), ("v", 400)):
                np.testing.assert_array_equal(
                    s.peek(name, np.arange(n), with_state=True), ref.peek_records(name, np.arange(n))
                )
    assert not [t for t in threading.enumerate() if t.name in ("tiered_emb-prefetch", "tiered_emb-writer")]


def test_read_ahead_serves_the_step_from_memory(tmp_path):
    data = batches(20, seed=6)
    ref = reference(data)
    path = tmp_path / "r"
    with TieredStore.create(path, TABLES, TierConfig(8, 0, "lookahead+lru", "cpu"), seed=4) as s:
        s.engine.ssd.writeback_rows = 4
        train(s, data[:10], 0)
        s.flush()
        s.engine.ssd.writeback_rows = 1 << 16  # no LMDB write overlaps a staged read: none is dropped
        before = s.stats()["u"]["ssd"]
        train(s, data[10:], 4, load_ahead=0, read_ahead=1)
        after = s.stats()["u"]["ssd"]
        staging = dict(s.engine.ssd.staging)
        for name, n in (("u", 300), ("v", 400)):
            np.testing.assert_array_equal(
                s.peek(name, np.arange(n), with_state=True), ref.peek_records(name, np.arange(n))
            )
    assert staging["reads"] == 10 and staging["discarded"] == 0 and staging["used"] > 0
    assert after["hits"] > before["hits"]  # the step's counters are its own, staged or not
    assert faults.staged_rows(s) == {}  # every staged batch dropped at its release


def test_staged_rows_never_outlive_an_lmdb_write(tmp_path):
    # A row read ahead, then trained, evicted and written back: the staged copy is stale
    # and must not be served.
    tables = [TableConfig("u", dim=2, optimizer=RowWiseAdagrad(lr=0.5))]
    with TieredStore.create(tmp_path / "w", tables, TierConfig(1, 0, "lru", "cpu"), seed=4) as s:
        s.engine.ssd.writeback_rows = 1
        s.apply_gradients("u", np.array([5]), np.ones((1, 2), dtype=np.float32))
        s.lookup("u", np.array([6]))  # 5 evicted, written
        s.engine.ssd.wait_writes()
        ticket = s.prefetch({"u": np.array([5])}, bring_up=False)
        s.engine.read_ahead(ticket)
        ticket.wait()
        assert s.engine.ssd.staging["rows"] == 1
        s.apply_gradients("u", np.array([5]), np.ones((1, 2), dtype=np.float32))  # 5 newer than its staged copy
        s.lookup("u", np.array([6]))  # 5 evicted and written again
        s.engine.ssd.wait_writes()
        assert faults.staged_rows(s)[ticket.seq]["u"] == 0
        got = s.lookup("u", np.array([5]))
        s.release(ticket)
    ref = ReferenceStore(tables, seed=4)
    ref.apply_gradients("u", np.array([5]), np.ones((1, 2), dtype=np.float32))
    ref.apply_gradients("u", np.array([5]), np.ones((1, 2), dtype=np.float32))
    np.testing.assert_array_equal(got, ref.lookup("u", np.array([5])))


def test_failed_background_write_loses_nothing(tmp_path):
    from tiered_emb.errors import StoreFullError

    tables = [TableConfig("u", dim=2, optimizer=RowWiseAdagrad(lr=0.5))]
    ref = ReferenceStore(tables, seed=4)
    path = tmp_path / "f"
    s = TieredStore.create(path, tables, TierConfig(1, 0, "lru", "cpu"), seed=4)
    s.engine.ssd.writeback_rows = 2
    calls = full_disk_for(s)
    raised = []
    for i in range(12):
        g = np.full((1, 2), i + 1, dtype=np.float32)
        try:
            s.apply_gradients("u", np.array([i]), g)
        except StoreFullError:  # the step that meets the writer's error; its update was not applied
            raised.append(i)
            s.apply_gradients("u", np.array([i]), g)
        ref.apply_gradients("u", np.array([i]), g)
    s.close()
    assert calls[0] == "tiered_emb-writer" and len(raised) == 1
    with TieredStore.open(path) as s:
        np.testing.assert_array_equal(s.peek("u", np.arange(12), with_state=True), ref.peek_records("u", np.arange(12)))


@pytest.mark.parametrize("job, load, read", [("bring_up", 1, 0), ("stage", 0, 1), ("enter", 0, 0), ("enter", 1, 1)])
def test_background_error_is_raised_in_the_step_that_needs_the_rows(tmp_path, monkeypatch, job, load, read):
    data = batches(6, seed=3)
    with TieredStore.create(tmp_path / "e", TABLES, TierConfig(16, 0, "lookahead+lru", "cpu"), seed=4) as s:
        real = getattr(s.engine.window, job)

        def failing(ticket):
            if ticket.seq == 3:
                raise OSError("disk went away")
            real(ticket)

        monkeypatch.setattr(s.engine.window, job, failing)
        ran = []
        with pytest.raises(PrefetchError, match="batch 3") as e:
            for i, _ in enumerate(lookahead(s, data, lambda x: x, 2, load, read)):
                ran.append(i)
        assert ran == [0, 1, 2] and isinstance(e.value.__cause__, OSError)
        assert int(s.engine.table("u").hbm.pins.sum()) == 0 and int(s.engine.table("v").hbm.pins.sum()) == 0


def test_failed_unpinning_is_raised_and_loses_nothing(tmp_path, monkeypatch):
    """An unpinning the thread could not do is raised by the next release, or by close
    after its checkpoint, once; every applied update is kept."""
    data = batches(8, seed=6)
    path = tmp_path / "unpin"
    s = TieredStore.create(path, TABLES, TierConfig(24, 8, "lookahead+lru", "cpu"), seed=4)
    real = s.engine.window.unpin

    def failing(ticket):
        if ticket.seq == 2:
            raise OSError("unpin went wrong")
        real(ticket)

    monkeypatch.setattr(s.engine.window, "unpin", failing)
    raised, ran = [], []
    try:
        for i, b in enumerate(lookahead(s, data, lambda x: x, 2, load_ahead=1)):
            step(s, b)
            ran.append(i)
    except PrefetchError as err:
        raised.append(err)
    close_keeping_errors(s, raised)
    assert len(raised) == 1 and "unpinning" in str(raised[0]) and isinstance(raised[0].__cause__, OSError)
    assert ran[:3] == [0, 1, 2] and s.engine.closed
    assert not [t for t in threading.enumerate() if t.name == "tiered_emb-prefetch"]
    ref = reference([data[i] for i in ran])
    with TieredStore.open(path) as s2:
        for name, n in (("u", 300), ("v", 400)):
            np.testing.assert_array_equal(
                s2.peek(name, np.arange(n), with_state=True), ref.peek_records(name, np.arange(n))
            )


def test_failed_unpinning_at_close_is_raised_after_the_checkpoint(tmp_path, monkeypatch):
    """close() with a ticket never released whose unpinning fails: the thread is joined,
    the checkpoint written, then PrefetchError."""
    path = tmp_path / "c"
    s = TieredStore.create(path, TABLES, TierConfig(8, 0, "lookahead+lru", "cpu"), seed=4)
    g = np.ones((1, 4), dtype=np.float32)
    s.apply_gradients("u", np.array([3]), g)  # dirty in HBM, not checkpointed
    ticket = s.prefetch({"u": np.array([1, 2])})
    ticket.wait()
    real = s.engine.window.unpin

    def failing(t):
        if t is ticket:
            raise OSError("unpin went wrong")
        real(t)

    monkeypatch.setattr(s.engine.window, "unpin", failing)
    with pytest.raises(PrefetchError, match="unpinning") as e:
        s.close()
    assert isinstance(e.value.__cause__, OSError) and s.engine.closed
    assert not [t for t in threading.enumerate() if t.name == "tiered_emb-prefetch"]
    ref = ReferenceStore(TABLES, seed=4)
    ref.apply_gradients("u", np.array([3]), g)
    with TieredStore.open(path) as s2:
        np.testing.assert_array_equal(
            s2.peek("u", np.array([3]), with_state=True), ref.peek_records("u", np.array([3]))
        )


def test_failed_unpinning_survives_a_loop_closed_early(tmp_path, monkeypatch):
    """The loop's own clean-up (releasing the window of a loop stopped early) does not take
    a failed unpinning that the thread met meanwhile: close() raises it, once."""
    data = batches(8, seed=6)
    s = TieredStore.create(tmp_path / "l", TABLES, TierConfig(24, 8, "lookahead+lru", "cpu"), seed=4)
    go = threading.Event()
    real_unpin, real_release = s.engine.window.unpin, s.engine.prefetcher.release
    seen = {}

    def failing_unpin(ticket):
        if ticket.seq == 1:
            go.wait(5)  # after the step's own release of batch 1 has returned
            raise OSError("unpin went wrong")
        real_unpin(ticket)

    def release(ticket, check=True):
        seen[ticket.seq] = ticket
        if ticket.seq == 2:  # the loop's clean-up: let the thread fail first
            go.set()
            seen[1].unpinned_event.wait(5)
        real_release(ticket, check)

    monkeypatch.setattr(s.engine.window, "unpin", failing_unpin)
    monkeypatch.setattr(s.engine.prefetcher, "release", release)
    raised = []
    gen = lookahead(s, data, lambda x: x, 2, load_ahead=1)
    try:
        for i, b in enumerate(gen):
            step(s, b)
            if i == 1:
                break
        gen.close()
    except PrefetchError as err:
        raised.append(err)
    close_keeping_errors(s, raised)
    assert len(raised) == 1 and isinstance(raised[0].__cause__, OSError)


@pytest.mark.parametrize("kind", ["loader", "ids"])
@pytest.mark.parametrize("depth, load", [(1, 0), (4, 1), (4, 0)])
def test_a_batch_that_cannot_be_fetched_fails_after_the_ones_before_it(tmp_path, kind, depth, load):
    """The loader raising at batch 6, or batch 6 holding an id out of range: batches 0-5
    run (as without lookahead), then that error; the rows are those of batches 0-5."""
    data = batches(10, seed=8)

    def source():
        for i, b in enumerate(data):
            if i == 6:
                if kind == "loader":
                    raise OSError("bad record")
                b = dict(b, v=np.array([400]))  # v has num_rows=400
            yield b

    ran = []
    with TieredStore.create(tmp_path / "f", TABLES, TierConfig(24, 8, "lookahead+lru", "cpu"), seed=4) as s:
        with pytest.raises(OSError if kind == "loader" else IdRangeError):
            for i, b in enumerate(lookahead(s, source(), lambda x: x, depth, load)):
                step(s, b)
                ran.append(i)
        assert ran == [0, 1, 2, 3, 4, 5]
        assert int(s.engine.table("u").hbm.pins.sum()) == 0 and int(s.engine.table("v").hbm.pins.sum()) == 0
        got = {name: s.peek(name, np.arange(n), with_state=True) for name, n in (("u", 300), ("v", 400))}
    ref = reference(data[:6])
    for name, n in (("u", 300), ("v", 400)):
        np.testing.assert_array_equal(got[name], ref.peek_records(name, np.arange(n)))


@pytest.mark.parametrize("depth", [0, 1])
def test_a_plan_forwarded_on_two_tables_updates_each_tables_own_rows(tmp_path, depth):
    """One BagPlan (the same ids) looked up on tables a and b inside a step whose rows are
    pinned: each backward updates its own table's rows, never the other's slots."""
    from tiered_emb import SGD

    tables = [TableConfig("a", dim=2, optimizer=SGD(lr=1.0)), TableConfig("b", dim=2, optimizer=SGD(lr=1.0))]
    ref = ReferenceStore(tables, seed=0)
    with TieredStore.create(tmp_path / "p", tables, TierConfig(16, 0, "lookahead+lru", "cpu")) as s:
        s.lookup("a", np.array([9]))  # a's slots of ids 1, 2 are not b's
        ids = np.array([1, 2])
        for b in lookahead(s, [ids], lambda b: {"a": b, "b": b}, depth=depth, load_ahead=1):
            plan = plan_bags(b, np.array([0, 2]))
            _, fa = s.engine.lookup_pooled("a", plan)
            _, fb = s.engine.lookup_pooled("b", plan)
            s.engine.apply_pooled_gradients("a", fa, np.ones((1, 2), np.float32))
            s.engine.apply_pooled_gradients("b", fb, np.ones((1, 2), np.float32))
        for name in ("a", "b"):
            ref.apply_gradients(name, ids, np.ones((2, 2), np.float32))
            check = np.array([1, 2, 9])
            assert s.peek(name, check, with_state=True).tobytes() == ref.peek_records(name, check).tobytes()


def test_a_loop_closed_after_its_store_raises_nothing(tmp_path):
    s = TieredStore.create(tmp_path / "c", [TableConfig("t", dim=2)], TierConfig(8, 0, "lookahead+lru", "cpu"))
    gen = lookahead(s, [np.array([i, i + 1]) for i in range(5)], lambda b: {"t": b}, depth=2, load_ahead=1)
    s.lookup("t", next(gen))
    s.close()
    gen.close()
    assert s.engine.closed and not [t for t in threading.enumerate() if t.name == "tiered_emb-prefetch"]


def test_stopping_early_releases_pins_and_close_joins_thread(tmp_path):
    data = batches(10, seed=5)
    s = TieredStore.create(tmp_path / "x", TABLES, TierConfig(50, 0, "lookahead+lru", "cpu"), seed=4)
    for i, _ in enumerate(lookahead(s, data, lambda x: x, 4, load_ahead=1, read_ahead=2)):
        if i == 2:
            break
    assert int(s.engine.table("u").hbm.pins.sum()) == 0
    assert [t for t in threading.enumerate() if t.name == "tiered_emb-prefetch"]
    s.close()
    assert not [t for t in threading.enumerate() if t.name == "tiered_emb-prefetch"]


def test_bad_ids_in_prefetch_raise_on_the_caller(tmp_path):
    with TieredStore.create(tmp_path / "b", TABLES, TierConfig(8, 0, "lru", "cpu")) as s:
        with pytest.raises(IdRangeError):
            s.prefetch({"v": np.array([400])})
        with pytest.raises(ConfigError):
            list(lookahead(s, [], lambda x: x, -1))
        assert s.engine.prefetcher.outstanding == []


def test_backward_after_its_step_moved_on_takes_the_locked_path(tmp_path):
    """Gradients accumulated over two batches: the first batch's backward runs after its
    step, when its pins are released and its slots may hold other rows; it must not write
    them unlocked.  Rows equal the same accumulation without the pipeline."""
    tables = [TableConfig("t", dim=4, num_rows=100, optimizer=RowWiseAdagrad(lr=0.5))]
    data = [np.arange(i * 4, i * 4 + 4, dtype=np.int64) for i in range(8)]  # disjoint; 8 HBM rows hold 2 batches
    off = np.array([0, 2, 4])

    def run(path, pipe):
        with TieredStore.create(path, tables, TierConfig(8, 0, "lookahead+lru", "cpu"), seed=1) as s:
            it = lookahead(s, data, lambda b: {"t": b}, 2, load_ahead=1) if pipe else iter(data)
            pending = None
            for b in it:
                plan = plan_bags(b, off)
                out, fwd = s.engine.lookup_pooled("t", plan)
                if pending is None:
                    pending = (fwd, out)
                    continue
                for p, o in (pending, (fwd, out)):
                    s.engine.apply_pooled_gradients("t", p, o * np.float32(0.5) + np.float32(0.01))
                pending = None
            return s.peek("t", np.arange(40), with_state=True)

    np.testing.assert_array_equal(run(tmp_path / "pipe", True), run(tmp_path / "plain", False))


def test_window_keeps_its_own_copy_of_the_ids(tmp_path):
    """The step is matched to its ticket by comparing ids, so the ticket must not share the
    caller's array: changed after the hand-over, it would match ids whose rows are not pinned."""
    with TieredStore.create(tmp_path / "s", TABLES, TierConfig(40, 0, "lookahead+lru", "cpu"), seed=1) as s:
        ids = np.arange(5, dtype=np.int64)
        ticket = s.prefetch({"u": ids})
        ids[:] = 99
        s.engine.window.stepping = ticket
        ticket.wait()
        assert s.engine.window.pinned_batch("u", ids) is None  # the changed array is not the batch handed over
        got = s.engine.window.pinned_batch("u", np.arange(5, dtype=np.int64))
        assert got is not None and got[1].tolist() == [0, 1, 2, 3, 4]
        s.engine.window.stepping = None
        s.release(ticket)


def test_rows_a_step_brings_up_are_pinned_for_later_window_batches(tmp_path):
    """A row the step of batch A brings up, needed again by batch C of the window, is pinned
    for C when the next batch enters (not for B, the oldest then: its step may be running),
    and every such pin is gone once the tickets are released."""
    with TieredStore.create(tmp_path / "s", [TableConfig("t", dim=2)], TierConfig(16, 0, "lookahead+lfu", "cpu")) as s:
        tickets = [s.prefetch({"t": np.array(ids)}, bring_up=False) for ids in ([1, 2], [3, 4], [3, 5])]
        for tk in tickets:
            tk.wait_entered()
        assert all(int((tk.aligned["t"] >= 0).sum()) == 0 for tk in tickets)  # nothing resident yet
        s.lookup("t", np.array([1, 2, 3]))  # A's step; 3 comes up with it
        s.release(tickets[0])
        d = s.prefetch({"t": np.array([6])}, bring_up=False)  # enters: the window is re-pinned first
        d.wait_entered()
        b, c = tickets[1], tickets[2]
        slot3 = int(s.engine.table("t").hbm.find(np.array([3]))[0])
        assert slot3 >= 0
        assert c.aligned["t"].tolist() == [slot3, -1]  # C = [3, 5]: 3 pinned for it
        assert c.uids["t"].tolist() == [5]  # what is left to bring up
        assert b.aligned["t"].tolist() == [-1, -1]  # B, the oldest, left alone
        assert int(s.engine.table("t").hbm.pins[slot3]) == 1
        for tk in (b, c, d):
            s.release(tk)
        s.engine.drain_prefetch()
        assert int(s.engine.table("t").hbm.pins.sum()) == 0
        assert s.engine.window.tickets == []


@pytest.mark.parametrize("policy", ["lookahead+lru", "lookahead+lfu"])
def test_the_window_is_re_pinned_where_it_can_matter(tmp_path, policy):
    """Under LRU only tables where a step placed rows for its own batch are re-pinned (rows
    the thread brings up are the most recent when unpinned); under LFU every table is."""
    s = TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=64, ddr_rows=64, policy=policy, device="cpu"))
    probed = []
    pin_resident = s.engine.window.pin_resident

    def counting(ticket, name):
        probed.append(name)
        pin_resident(ticket, name)

    data = batches(8, seed=3)
    try:
        tickets = [s.prefetch(b, bring_up=False) for b in data[:3]]
        for tk in tickets:
            tk.wait()
        s.engine.window.pin_resident = counting
        s.engine.bring_up(tickets[0])  # the thread places rows: no table flagged by a step
        tickets[0].wait()
        s.prefetch(data[3], bring_up=False).wait()  # enters: re-pins the window, or not
        repinned = sorted(set(probed[:-2]))  # the last two: the entering batch's own tables
        assert repinned == ([] if policy == "lookahead+lru" else ["u", "v"])
        probed.clear()
        s.lookup("v", data[5]["v"])  # a step places rows of table v
        s.prefetch(data[4], bring_up=False).wait()
        assert sorted(set(probed[:-2])) == (["v"] if policy == "lookahead+lru" else ["u", "v"])
    finally:
        s.close()
