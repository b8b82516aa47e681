"""TorchRec's DistributedModelParallel shards the tiered collection with ``dmp_sharder``:
TorchRec's planner places the tables, and what the ranks end with is one process's, bit
for bit."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
tiered_torchrec = pytest.importorskip("tiered_emb.torchrec")
if not tiered_torchrec.HAS_TORCHREC:
    pytest.skip("torchrec is not installed", allow_module_level=True)
import sharded_job as job  # noqa: E402

from tiered_emb.distributed import ShardedReader, ShardingPlan  # noqa: E402
from tiered_emb.distributed.launch import run_ranks  # noqa: E402
from tiered_emb.errors import ConfigError  # noqa: E402


@pytest.mark.parametrize("opt", ["adagrad", "rowwise_adagrad"])
def test_distributed_model_parallel_shards_the_tiered_collection_bitwise(tmp_path, opt):
    pooled_ref, records_ref = job.dmp_single(str(tmp_path / "one"), opt)
    results = run_ranks(job.dmp_rank, 2, (str(tmp_path / "dmp"), opt))
    plan = ShardingPlan.from_json(results[0][1])
    assert results[1][1] == results[0][1]
    kinds = {tp.table: tp.sharding_type.value for tp in plan.tables}
    # TorchRec's planner cuts the 520-wide table (row-wise Adagrad: its row state chained over the pieces)
    assert kinds["w"] == "column_wise"
    per = job.BAGS // 2
    for r, (pooled, _) in enumerate(results):
        for s, got in enumerate(pooled):
            assert np.array_equal(got, pooled_ref[s][r * per : (r + 1) * per]), (r, s)
    with ShardedReader(tmp_path / "dmp", plan, [None, None]) as reader:
        for name, want in records_ref.items():
            got = reader.peek(name, np.arange(want.shape[0]), with_state=True)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_a_collection_without_a_store_asks_to_be_sharded():
    from tiered_emb import SGD

    ebc = tiered_torchrec.TieredEmbeddingBagCollection(None, job.dmp_configs(), optimizer=SGD(lr=0.1))
    kjt, _ = job.dmp_batches(1, 0)[0]
    with pytest.raises(ConfigError, match="DistributedModelParallel"):
        ebc(kjt)
    with pytest.raises(ConfigError, match="optimizer"):
        tiered_torchrec.TieredEmbeddingBagCollection(None, job.dmp_configs())
