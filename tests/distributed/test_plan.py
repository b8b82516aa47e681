"""Sharding plans and the planner: JSON, checks with typed errors, local tables, the row
hash, and plans that balance the stated cost model within the ranks' limits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("torch")

from tiered_emb import SGD, Adagrad, Adam, RowWiseAdagrad, TableConfig, TierConfig
from tiered_emb.distributed import ShardingPlan, ShardingType, TablePlan, row_owner
from tiered_emb.distributed.plan import column_layout, piece_records, stitch_records
from tiered_emb.distributed.planner import (
    RankLimits,
    TableLoad,
    describe,
    estimate,
    imbalance,
    plan_tables,
    table_loads,
)
from tiered_emb.errors import PlanError
from tiered_emb.init import init_rows

TABLES = [
    TableConfig("big", 64, num_rows=4_000_000, optimizer=RowWiseAdagrad()),
    TableConfig("wide", 1024, num_rows=50_000, optimizer=Adagrad()),
    TableConfig("mid", 32, num_rows=300_000),
    TableConfig("tiny", 8, num_rows=100),
    TableConfig("small", 16, num_rows=2_000, optimizer=SGD()),
]


def test_a_plan_round_trips_through_json_and_keeps_its_fingerprint(tmp_path):
    plan = plan_tables(TABLES, 4, 4096)
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan and again.fingerprint() == plan.fingerprint()
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == plan
    other = ShardingPlan(4, tuple(reversed(plan.tables)))
    assert other.fingerprint() != plan.fingerprint()  # table order is part of the plan


@pytest.mark.parametrize(
    ("tp", "why"),
    [
        (TablePlan("mid", ShardingType.TABLE_WISE, (0, 1)), "one owner"),
        (TablePlan("mid", ShardingType.TABLE_WISE, (2,)), "ranks in 0..1"),
        (TablePlan("mid", ShardingType.ROW_WISE, (1, 0)), "every rank in order"),
        (TablePlan("mid", ShardingType.TABLE_ROW_WISE, (1, 1)), "once each"),
        (TablePlan("mid", ShardingType.COLUMN_WISE, (0, 1), (0, 16, 30)), "one piece per rank"),
        (TablePlan("mid", ShardingType.COLUMN_WISE, (0,), (0, 16, 32)), "one piece per rank"),
        (TablePlan("mid", ShardingType.TABLE_WISE, (0,), (0, 32)), "only a column-wise"),
    ],
)
def test_an_invalid_table_plan_is_a_plan_error(tp, why):
    others = tuple(TablePlan(t.name, ShardingType.TABLE_WISE, (0,)) for t in TABLES if t.name != tp.table)
    with pytest.raises(PlanError, match=why):
        ShardingPlan(2, (tp, *others)).check(TABLES)


def test_a_plan_missing_a_table_or_of_another_format_is_refused():
    plan = plan_tables(TABLES, 2, 1024)
    with pytest.raises(PlanError, match="exactly once"):
        ShardingPlan(2, plan.tables[1:]).check(TABLES)
    with pytest.raises(PlanError, match="format"):
        ShardingPlan.from_json(plan.to_json().replace("tiered_emb-plan/1", "tiered_emb-plan/9"))
    with pytest.raises(PlanError, match="does not parse"):
        ShardingPlan.from_json('{"format": "tiered_emb-plan/1", "world_size": 2}')


def test_column_pieces_start_as_their_columns_of_the_whole_row():
    plan = ShardingPlan(
        3,
        tuple(
            TablePlan(t.name, ShardingType.COLUMN_WISE, (2, 0, 2), (0, 300, 700, 1024))
            if t.name == "wide"
            else TablePlan(t.name, ShardingType.DATA_PARALLEL, (0, 1, 2))
            for t in TABLES
        ),
    )
    plan.check(TABLES)
    pieces = [c for c in plan.local_tables(2, TABLES) if c.init_table == "wide"]
    assert [(c.name, c.dim, c.init_column) for c in pieces] == [
        ("wide.cols0-300", 300, 0),
        ("wide.cols700-1024", 324, 700),
    ]
    ids = np.array([0, 5, 49_999])
    whole = init_rows(TABLES[1], ids, seed=3)
    for c in pieces:
        got = init_rows(c, ids, seed=3)
        assert np.array_equal(got[:, : c.dim], whole[:, c.init_column : c.init_column + c.dim])
    assert TableConfig.from_dict(pieces[1].to_dict()) == pieces[1]


@pytest.mark.parametrize("opt", [SGD(), Adagrad(), RowWiseAdagrad(), Adam()])
@pytest.mark.parametrize("ttl", [None, 5])
def test_column_pieces_hold_their_columns_of_every_record_word(opt, ttl):
    cfg = TableConfig("t", 7, optimizer=opt, ttl_steps=ttl)
    rec = np.arange(3 * cfg.record_width, dtype=np.float32).reshape(3, cfg.record_width)
    cuts = (0, 1, 5, 7)
    pieces = [piece_records(rec, cfg, a, b) for a, b in itertools.pairwise(cuts)]
    for p, (a, b) in zip(pieces, itertools.pairwise(cuts), strict=True):
        piece = TableConfig("p", b - a, optimizer=opt, ttl_steps=ttl)
        assert p.shape == (3, piece.record_width)
        assert np.array_equal(p[:, : b - a], rec[:, a:b])  # the weights first
        arrays, tail = column_layout(cfg)
        for k in range(arrays):  # then each per-column state array's columns
            got = p[:, (b - a) * (1 + k) : (b - a) * (2 + k)]
            assert np.array_equal(got, rec[:, 7 * (1 + k) + a : 7 * (1 + k) + b])
        assert np.array_equal(p[:, p.shape[1] - tail :], rec[:, cfg.record_width - tail :])  # then the row's words
    assert np.array_equal(stitch_records(pieces, cfg, cuts), rec)


def test_the_row_hash_is_fixed_and_spreads_ids_evenly():
    ids = np.arange(1_000_000, dtype=np.int64)
    owner = row_owner(ids, 4)
    assert owner.min() == 0 and owner.max() == 3
    counts = np.bincount(owner, minlength=4)
    assert counts.max() / counts.min() < 1.01
    assert row_owner(np.array([0, 1, 2**62]), 3).tolist() == row_owner(np.array([0, 1, 2**62]), 3).tolist()
    assert np.array_equal(row_owner(ids[::7], 4), owner[::7])  # an id's owner depends on the id alone


def test_the_planner_replicates_small_tables_cuts_wide_ones_and_balances():
    plan = plan_tables(TABLES, 4, 8192)
    kinds = {tp.table: tp.sharding_type for tp in plan.tables}
    assert kinds["tiny"] is ShardingType.DATA_PARALLEL and kinds["small"] is ShardingType.DATA_PARALLEL
    assert kinds["wide"] is ShardingType.COLUMN_WISE
    assert kinds["big"] is not ShardingType.COLUMN_WISE  # (64 columns: narrower than column_dim)
    costs = estimate(plan, TABLES, 8192)
    assert imbalance(costs) < 1.5
    text = describe(costs)
    assert "imbalance" in text and len(text.splitlines()) == 4 + 2
    assert plan_tables(TABLES, 4, 8192) == plan  # same inputs, same plan


def test_a_table_over_one_ranks_disk_is_split_over_as_few_ranks_as_hold_it():
    big_bytes = 4_000_000 * TABLES[0].record_width * 4
    limits = RankLimits(disk_bytes=int(big_bytes * 0.6))
    plan = plan_tables(TABLES, 4, 8192, limits=limits)
    tp = plan["big"]
    assert tp.sharding_type is ShardingType.TABLE_ROW_WISE and len(tp.ranks) == 2
    for c in estimate(plan, TABLES, 8192):
        assert c.disk_bytes <= limits.disk_bytes
    with pytest.raises(PlanError, match="fits no set of ranks"):
        plan_tables(TABLES, 1, 8192, limits=limits)


def test_cache_limits_and_unbounded_tables_without_an_estimate_are_plan_errors():
    tiers = TierConfig(hbm_rows=100_000, ddr_rows=0, device="cpu")
    with pytest.raises(PlanError, match="HBM tier"):
        plan_tables(TABLES, 2, 8192, limits=RankLimits(hbm_bytes=1 << 20), tiers=tiers)
    unbounded = [TableConfig("u", 16)]
    with pytest.raises(PlanError, match="row estimate"):
        plan_tables(unbounded, 2, 8192)
    assert plan_tables(unbounded, 2, 8192, loads={"u": TableLoad(rows=10**6)}).tables[0].table == "u"


def test_shared_tiers_take_at_most_their_bytes_on_each_rank():
    """Tiers sized in bytes: a rank's shards share one HBM and one DDR tier of those bytes,
    so its estimate never exceeds them, and a limit under them is a plan error."""
    tiers = TierConfig(device="cpu", hbm_bytes=1 << 20, ddr_bytes=4 << 20)
    plan = plan_tables(TABLES, 2, 8192, tiers=tiers)
    costs = estimate(plan, TABLES, 8192, tiers=tiers)
    assert all(c.hbm_bytes == 1 << 20 and c.ddr_bytes == 4 << 20 for c in costs)  # (tables larger than both)
    with pytest.raises(PlanError, match="HBM tier"):
        plan_tables(TABLES, 2, 8192, limits=RankLimits(hbm_bytes=1 << 19), tiers=tiers)


def test_loads_from_batches_count_ids_per_sample_and_distinct_ids():
    batches = [{"f": (np.array([1, 2, 2, 3]), np.array([2, 2])), "g": (np.array([3, 9]), np.array([1, 1]))}]
    loads = table_loads(batches, {"f": "t", "g": "t"})
    assert loads["t"].pooling == 3.0  # 6 ids over 2 samples
    assert loads["t"].distinct == 4  # 1, 2, 3, 9


def test_torchrecs_planner_gives_a_plan_of_the_same_placement():
    tiered_torchrec = pytest.importorskip("tiered_emb.torchrec")
    if not tiered_torchrec.HAS_TORCHREC:
        pytest.skip("torchrec is not installed")
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

    configs = [
        EmbeddingBagConfig(num_embeddings=t.num_rows, embedding_dim=t.dim, name=t.name, feature_names=[t.name])
        for t in TABLES
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=4, compute_device="cpu"),
        storage_reservation=FixedPercentageStorageReservation(0.1),  # (the default warns, FutureWarning)
    )
    theirs = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    ours = tiered_torchrec.sharding_plan(theirs, 4)
    assert [tp.table for tp in ours.tables] == [t.name for t in TABLES]
    for tp in ours.tables:
        ps = theirs.plan[""][tp.table]
        assert tp.sharding_type.value == ps.sharding_type
        if tp.sharding_type is ShardingType.COLUMN_WISE:
            assert sorted(tp.ranks) == sorted(ps.ranks) and tp.columns[0] == 0
    ours.check(TABLES)
    assert estimate(ours, TABLES, 8192)
