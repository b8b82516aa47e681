"""Tiers sized in bytes and shared by every table (TierConfig(hbm_bytes=..., ddr_bytes=...))."""

import subprocess
import sys

import numpy as np
import pytest

from tiered_emb import SGD, Adam, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.apps.inspect import inspect_store
from tiered_emb.errors import ConfigError
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
