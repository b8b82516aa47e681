"""Tiers sized in bytes and shared by every table (TierConfig(hbm_bytes=..., ddr_bytes=...))."""

import subprocess
import sys

import numpy as np
import pytest

from tiered_emb import SGD, Adam, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.apps.inspect import inspect_store
from tiered_emb.errors import ConfigError
from tiered_emb.tiers.hbm import stride_of
from tiered_emb.tiers.pool import slot_floats

TABLES = [
    TableConfig("a", dim=8, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=20, optimizer=Adam()),
    TableConfig("c", dim=4, optimizer=SGD(lr=0.2)),
    TableConfig("h", dim=6, dtype="float16", optimizer=RowWiseAdagrad(lr=0.1)),
]
HBM_SLOT, DDR_SLOT = (4 * f for f in slot_floats(TABLES))


def _train(path, tiers, steps=12, hot="b"):
    """A few steps on every table (``hot`` with the most ids); the rows and states after, the
    stats, and how many distinct rows the steps touched."""
    rng = np.random.default_rng(3)
    seen = set()
    with TieredStore.create(path, TABLES, tiers, seed=9) as s:
        for step in range(steps):
            for t in TABLES:
                n = 120 if t.name == hot else 30
                ids = rng.integers(0, 400, n)
                seen.update((t.name, i) for i in ids.tolist())
                rows = s.lookup(t.name, ids)
                s.apply_gradients(t.name, ids, np.cos(rows * np.float32(step + 1)))
                if tiers.shared:
                    budget_kept(s, tiers)
        stats = s.stats()
        rows = {t.name: s.peek(t.name, np.arange(400), with_state=True) for t in TABLES}
    return rows, stats, len(seen)


def budget_kept(s, tiers):
    """The bytes each shared tier's rows take, summed over the tables, within its budget."""
    stats = s.stats()
    for tier, budget in (("hbm", tiers.hbm_bytes), ("ddr", tiers.ddr_bytes or 0)):
        held = sum(stats[t][tier]["bytes"] for t in stats)
        assert held <= budget, (tier, held, budget)


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo", "lookahead+lru"])
@pytest.mark.parametrize("hbm_slots, ddr_slots", [(40, 0), (60, 150), (2000, 0)])
def test_shared_tiers_train_bitwise_as_tiers_of_their_own(tmp_path, policy, hbm_slots, ddr_slots):
    """Rows and optimizer state byte for byte what tiers of one table each give, whatever
    the budgets and the policy; every shared tier within its bytes after every step."""
    want, _, touched = _train(tmp_path / "own", TierConfig(5, 7, policy, "cpu"))
    tiers = TierConfig(policy=policy, device="cpu", hbm_bytes=hbm_slots * HBM_SLOT, ddr_bytes=ddr_slots * DDR_SLOT)
    got, stats, _ = _train(tmp_path / "shared", tiers)
    for name, rows in want.items():
        assert rows.tobytes() == got[name].tobytes(), name
    held = [sum(stats[t][tier]["rows"] for t in stats) for tier in ("hbm", "ddr")]
    assert held == [min(hbm_slots, touched), min(ddr_slots, touched - min(hbm_slots, touched))]


def test_a_table_with_no_traffic_takes_no_cache_and_a_hot_one_takes_the_rest(tmp_path):
    tiers = TierConfig(device="cpu", hbm_bytes=300 * HBM_SLOT, ddr_bytes=100 * DDR_SLOT)
    with TieredStore.create(tmp_path / "s", TABLES, tiers, seed=1) as s:
        for step in range(4):
            ids = np.arange(step * 100, step * 100 + 100)
            s.apply_gradients("a", ids, np.ones((100, 8), np.float32))
            s.lookup("c", np.arange(10))
        stats = s.stats()
    assert stats["b"]["hbm"]["rows"] == stats["b"]["ddr"]["rows"] == 0
    assert stats["h"]["hbm"]["rows"] == 0
    assert stats["c"]["hbm"]["rows"] == 10
    # the hot table holds what the others leave: far more than a quarter of the slots
    assert stats["a"]["hbm"]["rows"] == 290 and stats["a"]["ddr"]["rows"] == 100
    assert stats["a"]["hbm"]["bytes"] == 290 * HBM_SLOT and stats["a"]["hbm"]["capacity_rows"] == 300


def test_victims_of_another_table_reach_the_disk_as_their_own_table_s(tmp_path):
    """Table a's rows pushed out by b's misses (no DDR): written to table a, read back after
    reopening with tiers of each table's own."""
    path = tmp_path / "s"
    tiers = TierConfig(device="cpu", hbm_bytes=50 * HBM_SLOT)
    with TieredStore.create(path, TABLES, tiers, seed=2) as s:
        s.write("a", np.arange(50), np.full((50, 8), 3.0, np.float32))
        s.lookup("b", np.arange(50))  # every slot: a's rows go down, dirty
        assert s.stats()["a"]["hbm"]["rows"] == 0
        assert s.stats()["b"]["hbm"]["rows"] == 50
    with TieredStore.open(path, tiers=TierConfig(4, 0, device="cpu")) as s:
        assert (s.peek("a", np.arange(50)) == 3.0).all()


def test_reopening_moves_between_rows_per_table_and_shared_bytes(tmp_path):
    path = tmp_path / "s"
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((100, 8)).astype(np.float32)
    with TieredStore.create(path, TABLES, TierConfig(8, 4, device="cpu"), seed=3) as s:
        s.write("a", np.arange(100), rows)
    shared = TierConfig(device="cpu", hbm_bytes=30 * HBM_SLOT, ddr_bytes=10 * DDR_SLOT)
    with TieredStore.open(path, tiers=shared) as s:
        np.testing.assert_array_equal(s.lookup("a", np.arange(100)), rows)
        s.apply_gradients("a", np.arange(20), np.ones((20, 8), np.float32))
        after = s.peek("a", np.arange(100))
    with TieredStore.open(path) as s:  # the manifest keeps the shared tiers
        assert s.engine.tiers.hbm_bytes == 30 * HBM_SLOT
        np.testing.assert_array_equal(s.peek("a", np.arange(100)), after)
    listed = inspect_store(str(path))["tiers"]  # (what `tiered-emb inspect` prints)
    assert listed == {
        "shared": True,
        "hbm": {"bytes": 30 * HBM_SLOT, "rows": 30, "slot_bytes": HBM_SLOT},
        "ddr": {"bytes": 10 * DDR_SLOT, "rows": 10, "slot_bytes": DDR_SLOT},
        "reserved": {},
    }


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"hbm_bytes": 1000, "hbm_rows": 4}, "either in bytes"),
        ({"hbm_bytes": 1000, "ddr_rows": 4}, "either in bytes"),
        ({"ddr_bytes": 1000, "hbm_rows": 4}, "both shared tiers in bytes"),
        ({"hbm_bytes": 0}, "number of bytes"),
        ({"hbm_bytes": 1000, "ddr_bytes": -1}, "number of bytes"),
        ({"hbm_bytes": "1GiB"}, "number of bytes"),
        ({}, "hbm_bytes for one HBM tier"),
    ],
)
def test_bad_tier_sizes_are_config_errors(kwargs, hint):
    with pytest.raises(ConfigError, match=hint):
        TierConfig(device="cpu", **kwargs)


def test_a_budget_that_holds_no_row_says_what_a_slot_takes(tmp_path):
    with pytest.raises(ConfigError, match=f"at least {HBM_SLOT}"):
        TieredStore.create(tmp_path / "s", TABLES, TierConfig(device="cpu", hbm_bytes=HBM_SLOT - 1))
    assert not (tmp_path / "s").exists()


def test_memory_of_shared_tiers_is_their_bytes_whatever_the_tables(tmp_path):
    """26 tables over 1e9-id spaces, a stream of new ids read (clean rows: nothing written
    to disk) until both tiers are full many times over: a child process's peak RSS grows by
    the shared tiers' bytes and their bookkeeping, where tiers of each table's own holding
    as many rows would take 26 times that."""
    code = f"""
import resource
import numpy as np
from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
tables = [TableConfig(f"t{{i}}", dim=16, optimizer=RowWiseAdagrad(lr=0.1)) for i in range(26)]
rng = np.random.default_rng(0)
small = TierConfig(device="cpu", hbm_bytes=2000 * 68, ddr_bytes=2000 * 68)
with TieredStore.create({str(tmp_path / "warm")!r}, tables[:2], small) as s:  # (every kernel compiled first)
    for t in tables[:2] * 3:
        s.lookup(t.name, rng.integers(0, 10**9, 10_000))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tiers = TierConfig(device="cpu", hbm_bytes=16 << 20, ddr_bytes=32 << 20)
with TieredStore.create({str(tmp_path / "s")!r}, tables, tiers) as s:
    for step in range(4):
        for t in tables:
            s.lookup(t.name, rng.integers(0, 10**9, 10_000))
    held = s.stats()
    rows = sum(held[t.name]["hbm"]["rows"] + held[t.name]["ddr"]["rows"] for t in tables)
    assert rows == (16 << 20) // 68 + (32 << 20) // 68
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown = int(out.stdout.strip())  # MiB
    slots = (48 << 20) // 68  # a record: 16 weights and the row-wise state
    bound = 48 + slots * 110 / 2**20 + 48  # records, bookkeeping (65-105 bytes a slot, and 4), buffers
    assert grown < bound, (grown, bound)


# Reserved tables: bytes of the budgets set apart as tiers of a table's own.
C_ROW = 4 * stride_of(TABLES[2].record_width)  # an HBM row of table c (dim 4, SGD)


def test_a_reserved_table_keeps_its_rows_against_a_hot_one_and_never_outgrows_them(tmp_path):
    """Table a streams 500 new rows through HBM: c's rows read before survive only when
    c has bytes of its own, and then c holds no more rows than they give, while the others
    share what is left; rows bitwise the same either way."""
    budget = {"device": "cpu", "hbm_bytes": 100 * HBM_SLOT + 10 * C_ROW, "ddr_bytes": 40 * DDR_SLOT}
    hits, rows = {}, {}
    for name, reserved in (("shared", {}), ("reserved", {"c": (10 * C_ROW, 0)})):
        with TieredStore.create(tmp_path / name, TABLES, TierConfig(**budget, reserved=reserved), seed=1) as s:
            s.lookup("c", np.arange(10))
            for step in range(5):
                s.apply_gradients("a", np.arange(step * 100, step * 100 + 100), np.ones((100, 8), np.float32))
            before = s.stats()["c"]["hbm"]["hits"]
            s.lookup("c", np.arange(10))
            hits[name] = s.stats()["c"]["hbm"]["hits"] - before
            s.apply_gradients("c", np.arange(40), np.ones((40, 4), np.float32))  # more rows than its own tiers'
            held = s.stats()
            budget_kept(s, TierConfig(**budget))
            rows[name] = {t.name: s.peek(t.name, np.arange(500), with_state=True) for t in TABLES}
        if reserved:
            assert (held["c"]["hbm"]["rows"], held["c"]["hbm"]["capacity_rows"], held["c"]["ddr"]["rows"]) == (
                10,
                10,
                0,
            )
            assert held["a"]["hbm"]["capacity_rows"] == 100 and held["a"]["hbm"]["rows"] == 100
    assert hits == {"shared": 0, "reserved": 10}
    for t in TABLES:
        assert rows["shared"][t.name].tobytes() == rows["reserved"][t.name].tobytes(), t.name


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "lookahead+lru"])
def test_reserved_tables_train_bitwise_within_the_budget(tmp_path, policy):
    """b (the widest record) and h reserved, the others sharing slots of a's width: rows
    as tiers of each table's own give them; the bytes held within each budget after every step."""
    want, _, _ = _train(tmp_path / "own", TierConfig(5, 7, policy, "cpu"))
    b_row, h_row = (4 * stride_of(t.record_width) for t in (TABLES[1], TABLES[3]))
    reserved = {"b": (30 * b_row, 20 * 4 * TABLES[1].record_width), "h": (8 * h_row, 0)}
    tiers = TierConfig(policy=policy, device="cpu", hbm_bytes=60 * HBM_SLOT, ddr_bytes=60 * DDR_SLOT, reserved=reserved)
    got, stats, _ = _train(tmp_path / "reserved", tiers)
    for name, rows in want.items():
        assert rows.tobytes() == got[name].tobytes(), name
    assert [stats["b"][t]["capacity_rows"] for t in ("hbm", "ddr")] == [30, 20]
    assert stats["a"]["hbm"]["capacity_rows"] == stats["c"]["hbm"]["capacity_rows"]  # (one tier for a and c)
    listed = inspect_store(str(tmp_path / "reserved"))["tiers"]
    assert listed["reserved"] == {
        "b": {"hbm_bytes": 30 * b_row, "ddr_bytes": 80 * TABLES[1].record_width, "hbm_rows": 30, "ddr_rows": 20},
        "h": {"hbm_bytes": 8 * h_row, "ddr_bytes": 0, "hbm_rows": 8, "ddr_rows": 0},
    }
    assert listed["hbm"]["bytes"] == 60 * HBM_SLOT - 30 * b_row - 8 * h_row
    with TieredStore.open(tmp_path / "reserved") as s:  # the manifest keeps them
        assert s.engine.tiers.reserved == (("b", *reserved["b"]), ("h", *reserved["h"]))


def test_a_reservation_beyond_a_table_s_rows_holds_the_table_whole(tmp_path):
    small = TableConfig("s", dim=4, num_rows=30)
    tiers = TierConfig(device="cpu", hbm_bytes=1 << 16, reserved={"s": (1 << 12, 0)})
    with TieredStore.create(tmp_path / "s", [small, TABLES[0]], tiers) as s:
        s.lookup("s", np.arange(30))
        s.lookup("s", np.arange(30))
        held = s.stats()["s"]["hbm"]
        assert (held["capacity_rows"], held["rows"], held["hits"]) == (30, 30, 30)
    assert inspect_store(str(tmp_path / "s"))["tiers"]["reserved"]["s"]["hbm_rows"] == 30


@pytest.mark.parametrize(
    "reserved, hint",
    [
        ({"zz": (C_ROW, 0)}, "which the store does not hold"),
        ({"c": (C_ROW - 1, 0)}, f"at least {C_ROW} HBM bytes"),
        ({"c": (40 * HBM_SLOT - HBM_SLOT // 2, 0)}, "once the reserved bytes are set apart"),
    ],
)
def test_a_reservation_the_store_cannot_hold_is_refused_before_anything_is_made(tmp_path, reserved, hint):
    tiers = TierConfig(device="cpu", hbm_bytes=40 * HBM_SLOT, reserved=reserved)
    with pytest.raises(ConfigError, match=hint):
        TieredStore.create(tmp_path / "s", TABLES, tiers)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"hbm_rows": 4, "reserved": {"a": (64, 0)}}, "without hbm_bytes"),
        ({"hbm_bytes": 100, "reserved": {"a": (101, 0)}}, "more HBM bytes than hbm_bytes=100"),
        ({"hbm_bytes": 100, "ddr_bytes": 10, "reserved": {"a": (10, 6), "b": (10, 6)}}, "more DDR bytes"),
        ({"hbm_bytes": 100, "reserved": [("a", 1, 0), ("a", 2, 0)]}, "names a table twice"),
        ({"hbm_bytes": 100, "reserved": {"a": 64}}, "is invalid"),
        ({"hbm_bytes": 100, "reserved": {"a": (-1, 0)}}, "is invalid"),
    ],
)
def test_bad_reservations_are_config_errors(kwargs, hint):
    with pytest.raises(ConfigError, match=hint):
        TierConfig(device="cpu", **kwargs)
