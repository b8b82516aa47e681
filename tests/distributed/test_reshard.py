"""Resharding: a job's rows moved from one plan's shards to another's (another world size,
other sharding types) hold exactly the rows one process holds after the same steps; and a
sharded reader answers for whole tables as one process's store."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
import sharded_job as job

from tiered_emb import TieredStore
from tiered_emb.distributed import ShardedReader, open_shards, shard_path
from tiered_emb.distributed.launch import run_ranks
from tiered_emb.distributed.reshard import reshard
from tiered_emb.errors import PlanError

OLD = ["row_wise", "column_wise"]
NEW = [(4, "table_wise"), (4, "column_wise"), (1, "table_wise"), (3, "row_wise"), (4, "table_row_wise")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The job's shards after its steps on 2 ranks under each of OLD, and one process's records."""
    root = tmp_path_factory.mktemp("trained")
    run_ranks(job.sharded_rank, 2, (str(root), OLD, "sum", "fp32"))
    _, reference = job.single(str(root / "one"))
    return root, reference


def _records(root, plan, world):
    out = []
    for r in range(world):
        local = plan.local_tables(r, job.TABLES)
        if not local:
            out.append({})
            continue
        with TieredStore.open(shard_path(root, r)) as store:
            out.append(job.records(store, local))
    return out


@pytest.mark.parametrize("old_kind", OLD)
@pytest.mark.parametrize(("world", "new_kind"), NEW)
def test_resharded_rows_are_one_process_rows(trained, tmp_path, old_kind, world, new_kind):
    root, reference = trained
    old_plan, new_plan = job.plan_of(old_kind, 2), job.plan_of(new_kind, world)
    new_root = tmp_path / "new"
    epochs = reshard(root / old_kind, old_plan, [None, None], new_root, new_plan, job.TABLES, job.tiers(), job.SEED)
    assert [e is not None for e in epochs] == [bool(new_plan.local_tables(r, job.TABLES)) for r in range(world)]
    assert job.record_mismatches(new_plan, _records(new_root, new_plan, world), reference) == []


def test_a_resharded_root_opens_as_its_plans_shards_and_refuses_another(trained, tmp_path):
    root, _ = trained
    new_plan = job.plan_of("table_wise", 4)
    reshard(
        root / "row_wise",
        job.plan_of("row_wise", 2),
        [None, None],
        tmp_path / "n",
        new_plan,
        job.TABLES,
        job.tiers(),
        job.SEED,
    )
    store = open_shards(tmp_path / "n", new_plan, job.TABLES, job.tiers(), 1, seed=job.SEED)
    assert sorted(store.tables) == sorted(c.name for c in new_plan.local_tables(1, job.TABLES))
    store.close()
    with pytest.raises(PlanError, match="reshard"):
        open_shards(tmp_path / "n", job.plan_of("row_wise", 4), job.TABLES, job.tiers(), 1, seed=job.SEED)


@pytest.mark.parametrize("kind", OLD)
def test_a_sharded_reader_answers_as_one_process(trained, kind):
    root, reference = trained
    with ShardedReader(root / kind, job.plan_of(kind, 2), [None, None]) as reader:
        for cfg in job.TABLES:
            ids = np.arange(job.ID_SPACE[cfg.name])
            got = reader.peek(cfg.name, ids, with_state=True)
            assert np.array_equal(got.view(np.uint32), reference[cfg.name].view(np.uint32)), cfg.name
            assert np.array_equal(reader.lookup(cfg.name, ids[::-3]), reference[cfg.name][ids[::-3], : cfg.dim])
