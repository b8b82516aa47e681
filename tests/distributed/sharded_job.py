"""A small sharded job, run on N ranks and in one process, for the sharded tests.

Four tables (each optimizer, bounded and unbounded ids), five features (two on one table,
one with per-sample weights), a global batch a step cut into the ranks' slices, and a
fixed gradient of the pooled output: what the ranks end with must be bitwise what one
process ends with on the global batch.
"""

from __future__ import annotations

import numpy as np
import torch

from tiered_emb import SGD, Adagrad, Adam, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.distributed import ShardedEmbeddingBagCollection, ShardingPlan, ShardingType, TablePlan, open_shards
from tiered_emb.torch import TieredEmbeddingBagCollection

TABLES = [
    TableConfig("a", 8, num_rows=300, optimizer=Adagrad(lr=0.1)),
    TableConfig("b", 6, optimizer=RowWiseAdagrad(lr=0.2, weight_decay=0.01)),
    TableConfig("c", 4, num_rows=50, optimizer=Adam(lr=0.01)),
    TableConfig("d", 10, num_rows=1000, optimizer=SGD(lr=0.5)),
]
FEATURES = {"fa1": "a", "fa2": "a", "fb": "b", "fc": "c", "fd": "d"}
ID_SPACE = {"a": 300, "b": 5000, "c": 50, "d": 1000}
WEIGHTED = ("fd",)
BAGS = 8  # global bags per feature a step (divisible by every world size tested)
STEPS = 3
SEED = 11


def tiers() -> TierConfig:
    # small tiers: rows move between HBM, DDR and LMDB during the job
    return TierConfig(hbm_rows=16, ddr_rows=16, device="cpu")


def global_batch(
    step: int, mode: str = "sum"
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]]:
    """feature -> (ids, lengths, weights or None, upstream gradient (BAGS, dim)) of one step
    (weights with ``mode`` "sum" only, as torch)."""
    rng = np.random.default_rng(1000 + step)
    out = {}
    for f, t in FEATURES.items():
        lengths = rng.integers(0, 6, BAGS)
        ids = (rng.zipf(1.3, int(lengths.sum())) - 1) % ID_SPACE[t]
        w = rng.uniform(0.5, 2.0, ids.shape[0]).astype(np.float32) if f in WEIGHTED else None
        w = w if mode == "sum" else None
        dim = next(c.dim for c in TABLES if c.name == t)
        grad = rng.standard_normal((BAGS, dim)).astype(np.float32)
        out[f] = (ids.astype(np.int64), lengths.astype(np.int64), w, grad)
    return out


def local_slice(batch, rank: int, world: int):
    """This rank's bags of each feature: the global bags cut into ``world`` equal runs."""
    per = BAGS // world
    out = {}
    for f, (ids, lengths, w, grad) in batch.items():
        starts = np.concatenate([[0], np.cumsum(lengths)])
        b0, b1 = rank * per, (rank + 1) * per
        i0, i1 = starts[b0], starts[b1]
        out[f] = (ids[i0:i1], lengths[b0:b1], None if w is None else w[i0:i1], grad[b0:b1])
    return out


def train(module, batches) -> list[dict[str, np.ndarray]]:
    """Each step's forward, then a backward of sum(out * grad); the pooled outputs per step."""
    seen = []
    for batch in batches:
        feats = {
            f: (torch.from_numpy(i), torch.from_numpy(n)) + ((torch.from_numpy(w),) if w is not None else ())
            for f, (i, n, w, _) in batch.items()
        }
        out = module(feats)
        loss = sum((out[f] * torch.from_numpy(batch[f][3])).sum() for f in out)
        loss.backward()
        seen.append({f: o.detach().numpy().copy() for f, o in out.items()})
    return seen


def records(store, tables) -> dict[str, np.ndarray]:
    """Every record (weights and state) of ``tables`` for ids in the id space."""
    return {c.name: store.peek(c.name, np.arange(ID_SPACE[c.init_table or c.name]), with_state=True) for c in tables}


def single(root: str, mode: str = "sum") -> tuple[list, dict]:
    """The job in one process, on the global batch: pooled outputs per step, records."""
    store = TieredStore.create(root, TABLES, tiers(), seed=SEED)
    module = TieredEmbeddingBagCollection(store, FEATURES, mode=mode)
    pooled = train(module, [global_batch(s, mode) for s in range(STEPS)])
    rec = records(store, TABLES)
    store.close()
    return pooled, rec


def plan_of(kind: str, world: int) -> ShardingPlan:
    """Every table sharded ``kind``."""
    everyone = tuple(range(world))
    plans = []
    for i, cfg in enumerate(TABLES):
        if kind == "table_wise":
            tp = TablePlan(cfg.name, ShardingType.TABLE_WISE, ((i + 1) % world,))
        elif kind == "on_rank_0":  # the other ranks hold no shard (and no store)
            tp = TablePlan(cfg.name, ShardingType.TABLE_WISE, (0,))
        elif kind == "row_wise":
            tp = TablePlan(cfg.name, ShardingType.ROW_WISE, everyone)
        elif kind == "table_row_wise":
            group = everyone[world // 2 :] if i % 2 else everyone[: max(1, world // 2)]
            tp = TablePlan(cfg.name, ShardingType.TABLE_ROW_WISE, group)
        elif kind == "data_parallel":
            tp = TablePlan(cfg.name, ShardingType.DATA_PARALLEL, everyone)
        else:
            pieces = min(world, 3) if cfg.dim >= 6 else 2
            cuts = tuple(cfg.dim * k // pieces for k in range(pieces + 1))
            tp = TablePlan(cfg.name, ShardingType.COLUMN_WISE, tuple((k + i) % world for k in range(pieces)), cuts)
        plans.append(tp)
    return ShardingPlan(world, tuple(plans))


def sharded_rank(rank: int, world: int, root: str, kinds: list[str], mode: str, comm_dtype: str):
    """One rank of the job for each plan kind: its pooled outputs per step, and its
    shards' records (table name in its store -> records)."""
    results = {}
    for kind in kinds:
        plan = plan_of(kind, world)
        store = open_shards(f"{root}/{kind}", plan, TABLES, tiers(), rank, seed=SEED)
        module = ShardedEmbeddingBagCollection(store, plan, TABLES, FEATURES, mode=mode, comm_dtype=comm_dtype)
        batches = [local_slice(global_batch(s, mode), rank, world) for s in range(STEPS)]
        pooled = train(module, batches)
        local = plan.local_tables(rank, TABLES)
        rec = records(store, local) if store is not None else {}
        if store is not None:
            store.close()
        results[kind] = (
            pooled,
            rec,
            {c.name: (c.init_table, c.init_column, c.dim) for c in local},
            module.bytes_sent(),
        )
    return results


def record_mismatches(plan: ShardingPlan, ranks: list[dict], reference: dict[str, np.ndarray]) -> list[str]:
    """Where the ranks' shards differ from the single process's records, bit for bit:
    ``ranks[r]`` is rank r's (local table -> records); a column piece is compared with
    :func:`~tiered_emb.distributed.plan.piece_records` of the whole records (checked on its
    own in tests/distributed/test_plan.py)."""
    from tiered_emb.distributed import row_owner
    from tiered_emb.distributed.plan import piece_records

    bad = []
    by_name = {c.name: c for c in TABLES}
    for tp in plan.tables:
        ref = reference[tp.table]
        ids = np.arange(ref.shape[0])
        if tp.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            owner = row_owner(ids, len(tp.ranks))
            checks = [(r, tp.table, owner == g, ref) for g, r in enumerate(tp.ranks)]
        elif tp.sharding_type is ShardingType.COLUMN_WISE:
            checks = [
                (r, f"{tp.table}.cols{c0}-{c1}", slice(None), piece_records(ref, by_name[tp.table], c0, c1))
                for r, c0, c1 in tp.pieces()
            ]
        else:
            checks = [(r, tp.table, slice(None), ref) for r in tp.ranks]
        for r, local, rows, want in checks:
            got = ranks[r][local]
            if not np.array_equal(got[rows].view(np.uint32), want[rows].view(np.uint32)):
                bad.append(f"{tp.table} ({tp.sharding_type.value}) on rank {r} as {local}")
    return bad


def faulty_rank(rank: int, world: int, root: str, fault: str):
    """One step of the table-wise job, then a second whose batch or gradient is bad on one
    rank (``fault``: "ids" an id out of range on the last rank, "nan" a NaN gradient on
    rank 0).  Returns the error type each rank met, and its shards' records before and
    after the bad step."""
    plan = plan_of("row_wise", world)
    store = open_shards(root, plan, TABLES, tiers(), rank, seed=SEED)
    module = ShardedEmbeddingBagCollection(store, plan, TABLES, FEATURES)
    train(module, [local_slice(global_batch(0), rank, world)])
    local = plan.local_tables(rank, TABLES)
    before = records(store, local)
    batch = local_slice(global_batch(1), rank, world)
    if fault == "ids" and rank == world - 1:
        ids, lengths, w, grad = batch["fc"]
        batch["fc"] = (np.where(np.arange(ids.shape[0]) == 0, 10**6, ids), lengths, w, grad)
    if fault == "nan" and rank == 0:
        ids, lengths, w, grad = batch["fa1"]
        batch["fa1"] = (ids, lengths, w, np.full_like(grad, np.nan))
    error = None
    try:
        train(module, [batch])
    except Exception as e:
        error = type(e).__name__
    after = records(store, local)
    store.close()
    return error, before, after


def mismatched_rank(rank: int, world: int, root: str):
    """Rank 1 is given another plan: every rank's collection refuses to start."""
    plan = plan_of("table_wise" if rank != 1 else "row_wise", world)
    store = open_shards(f"{root}/{rank}", plan, TABLES, tiers(), rank, seed=SEED)
    try:
        ShardedEmbeddingBagCollection(store, plan, TABLES, FEATURES)
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        if store is not None:
            store.close()
    return None, ""


def dying_rank(rank: int, world: int, root: str, when: str):
    """The last rank dies (``when``: "before" its first forward, or "mid-step": after its
    forward, before its backward): the others fail within the group's timeout with a
    DistributedError instead of waiting forever, and change no row.  Returns the error
    type, the seconds it took, and whether the rank's shards kept their rows."""
    import os
    import time

    plan = plan_of("table_wise", world)
    store = open_shards(root, plan, TABLES, tiers(), rank, seed=SEED)
    module = ShardedEmbeddingBagCollection(store, plan, TABLES, FEATURES)
    local = plan.local_tables(rank, TABLES)
    before = records(store, local)
    batch = local_slice(global_batch(0), rank, world)
    if rank == world - 1 and when == "before":
        os._exit(0)
    t0 = time.monotonic()
    error = None
    try:
        feats = {f: (torch.from_numpy(i), torch.from_numpy(n)) for f, (i, n, _, _) in batch.items()}
        out = module(feats)
        if rank == world - 1:
            os._exit(0)
        sum((out[f] * torch.from_numpy(batch[f][3])).sum() for f in out).backward()
    except Exception as e:
        error = type(e).__name__
    waited = time.monotonic() - t0
    kept = all(np.array_equal(before[t], after) for t, after in records(store, local).items())
    return error, waited, kept


# ---------------------------------------------------------------------------------------------------------
# TorchRec's DistributedModelParallel over the tiered collection


def dmp_configs():
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(num_embeddings=300, embedding_dim=8, name="a", feature_names=["fa1", "fa2"]),
        EmbeddingBagConfig(num_embeddings=1000, embedding_dim=520, name="w", feature_names=["fw"]),
        EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="c", feature_names=["fc"]),
    ]


DMP_IDS = {"fa1": 300, "fa2": 300, "fw": 1000, "fc": 50}


def dmp_batches(world: int, rank: int):
    """Two steps of KeyedJaggedTensors (this rank's bags of a global batch of BAGS bags a
    feature) and their upstream gradients, or the global ones with ``world`` 1."""
    from torchrec import KeyedJaggedTensor

    out = []
    for step in range(2):
        rng = np.random.default_rng(500 + step)
        per = BAGS // world
        values, lengths = [], []
        for n in DMP_IDS.values():
            lens = rng.integers(0, 5, BAGS)
            ids = (rng.zipf(1.3, int(lens.sum())) - 1) % n
            starts = np.concatenate([[0], np.cumsum(lens)])
            b0, b1 = rank * per, (rank + 1) * per
            values.append(ids[starts[b0] : starts[b1]])
            lengths.append(lens[b0:b1])
        grad = rng.standard_normal((BAGS, 8 * 2 + 520 + 4)).astype(np.float32)[rank * per : (rank + 1) * per]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            list(DMP_IDS), torch.from_numpy(np.concatenate(values)), torch.from_numpy(np.concatenate(lengths))
        )
        out.append((kjt, torch.from_numpy(grad)))
    return out


def _dmp_optimizer(name: str):
    from tiered_emb import Adagrad

    return Adagrad(lr=0.1) if name == "adagrad" else RowWiseAdagrad(lr=0.1)


def dmp_rank(rank: int, world: int, root: str, opt: str = "adagrad"):
    """The tiered collection in a model DistributedModelParallel shards with its planner:
    each step's pooled values, then the plan (ours) and every shard closed."""
    from torchrec.distributed import DistributedModelParallel

    from tiered_emb.torchrec import TieredEmbeddingBagCollection, dmp_sharder, sharding_plan

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = TieredEmbeddingBagCollection(None, dmp_configs(), optimizer=_dmp_optimizer(opt))

        def forward(self, kjt):
            return self.ebc(kjt).values()

    sharder = dmp_sharder(root, tiers(), SEED)
    model = DistributedModelParallel(Model(), device=torch.device("cpu"), sharders=[sharder])
    pooled = []
    for kjt, grad in dmp_batches(world, rank):
        out = model(kjt)
        (out * grad).sum().backward()
        pooled.append(out.detach().numpy().copy())
    for sub in model.modules():
        store = getattr(getattr(sub, "inner", None), "store", None)
        if store is not None:
            store.close()
    return pooled, sharding_plan(model.plan, world, "ebc").to_json()


def dmp_single(root: str, opt: str = "adagrad"):
    """The same model in one process over one store: pooled values per step, records."""
    from tiered_emb.torchrec import TieredEmbeddingBagCollection, table_configs

    tables = table_configs(dmp_configs(), _dmp_optimizer(opt))
    store = TieredStore.create(root, tables, tiers(), seed=SEED)
    ebc = TieredEmbeddingBagCollection(store, dmp_configs())
    pooled = []
    for kjt, grad in dmp_batches(1, 0):
        out = ebc(kjt).values()
        (out * grad).sum().backward()
        pooled.append(out.detach().numpy().copy())
    rec = {t.name: store.peek(t.name, np.arange(t.num_rows), with_state=True) for t in tables}
    store.close()
    return pooled, rec
