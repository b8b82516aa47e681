"""The sharded embedding-bag collection: each rank's shards in its own store, ids and rows
crossing ranks by all-to-all, the update synchronous and bitwise one process's.

A forward is three collectives: a check that every rank's batch is valid (one
``all_reduce``), the requests (each table's bags or ids to their owners), and the
replies (pooled bags, or rows the asking rank pools); the backward is one: each rank's
bag gradients to the owners, which check them, agree, and apply their updates when the
backward pass ends (as the single-process modules do).  Every rank must run the same
forwards and backwards in the same order, as with any collective.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tiered_emb._args import table_ids
from tiered_emb.config import TableConfig
from tiered_emb.distributed.chain import chained_tables, run_chain
from tiered_emb.distributed.exchange import Exchange, check_comm_dtype, decode, encode
from tiered_emb.distributed.plan import (
    BAG_SHARDED,
    ROW_SHARDED,
    ShardingPlan,
    ShardingType,
    TablePlan,
    piece_name,
    row_owner,
)
from tiered_emb.distributed.routing import (
    GlobalBags,
    LocalBags,
    owned_bags,
    owned_grads,
    pool_local,
    requested_ids,
    rows_by_position,
    split_rows,
)
from tiered_emb.engine import Forward
from tiered_emb.errors import BackwardError, ConfigError, IdTypeError, PlanError, UnknownTableError
from tiered_emb.torch._autograd import after_backward
from tiered_emb.torch._inputs import as_numpy_ids
from tiered_emb.torch.modules import jagged_of


@dataclass
class _Served:
    """What an owner keeps of one shard between forward and backward."""

    tp: TablePlan
    local: str  # the table's name in this rank's store
    c0: int
    c1: int
    bags: GlobalBags | None = None  # a bag shard's or a replica's global batch
    requests: list | None = None  # a row shard's requests, per rank
    forward: Forward | None = None  # a bag shard's lookup, for its backward


@dataclass
class _Step:
    """One forward of the collection on this rank, kept for its backward."""

    tables: dict[str, LocalBags]
    owners: dict[str, np.ndarray] = field(default_factory=dict)  # row-wise: each position's owner in its group
    requests: dict[tuple[str, int], list] = field(default_factory=dict)  # row-wise: what was asked of each owner
    served: list[_Served] = field(default_factory=list)


class ShardedEmbeddingBagCollection(torch.nn.Module):
    """:class:`tiered_emb.torch.TieredEmbeddingBagCollection` sharded over the ranks of a job.

    Parameters
    ----------
    store : TieredStore
        This rank's store, holding :meth:`ShardingPlan.local_tables` (``open_shards`` opens it).
    plan : ShardingPlan
        The same on every rank (checked here, by fingerprint).
    tables : list of TableConfig
        Every table of the job, as planned.
    feature_tables : dict feature -> table, or a list (feature == table)
    mode : str
        ``"sum"`` or ``"mean"``.
    comm_dtype : str or dict
        ``"fp32"`` (bitwise one process), ``"fp16"`` or ``"bf16"``: the type pooled rows
        and gradients cross ranks in (rounded to nearest even); a dict gives one per table
        (``"fp32"`` for a table it leaves out).
    group : ProcessGroup or None
        A torch.distributed process group; None: the default one.
    grad_scale : float
        Multiplies the pooled outputs' gradients before they leave the rank (1.0).  A
        data-parallel job whose ranks each take the mean loss of their own samples gives
        ``1 / world_size``: the rows then get the gradient of the global batch's mean loss,
        as one process training on that batch.

    Notes
    -----
    ``forward`` takes what the single-process collection takes (a dict feature to
    ``(values, lengths)`` or ``(values, lengths, weights)``, or a ``KeyedJaggedTensor``)
    holding this rank's bags, and returns this rank's pooled bags per feature.  The update
    is fused into the backward; per-sample weights get no gradient.
    """

    def __init__(
        self,
        store,
        plan: ShardingPlan,
        tables: list[TableConfig],
        feature_tables,
        mode: str = "sum",
        nonfinite: str = "raise",
        comm_dtype: str | dict[str, str] = "fp32",
        group=None,
        grad_scale: float = 1.0,
    ):
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ConfigError(f"mode={mode!r}", "a sharded collection pools with 'sum' or 'mean'")
        self.exchange = Exchange(group)
        plan.check(tables)
        if plan.world_size != self.exchange.world_size:
            raise PlanError(
                f"the plan is for {plan.world_size} ranks, the process group has {self.exchange.world_size}",
                "plan for the job's world size (plan_tables(..., world_size=N))",
            )
        if not isinstance(feature_tables, dict):
            feature_tables = {f: f for f in feature_tables}
        job = json.dumps(
            [plan.to_json(), [t.to_dict() for t in tables], list(feature_tables.items()), mode, nonfinite],
            sort_keys=True,
        )
        what = "the plan, tables, features, mode and nonfinite rule"
        self.exchange.same_on_every_rank(hashlib.sha256(job.encode()).hexdigest(), what)
        seed = "" if store is None else str(store.engine.seed)  # (a rank holding no shard has none)
        self.exchange.same_on_every_rank(seed, "the stores' seed", ignore="")
        names = {t.name: t for t in tables}
        unknown = sorted({t for t in feature_tables.values() if t not in names})
        if unknown:
            raise UnknownTableError(f"features name tables {unknown} the plan does not hold", f"use {sorted(names)}")
        local = plan.local_tables(self.exchange.rank, tables)
        if local and store is None:
            raise PlanError(
                f"rank {self.exchange.rank} holds {[c.name for c in local]} but was given no store",
                "open this rank's store with open_shards(root, plan, tables, tiers, rank)",
            )
        for cfg in local:
            have = store.engine.table_config(cfg.name)
            if have != cfg:
                raise PlanError(
                    f"rank {self.exchange.rank}'s store holds table {cfg.name!r} as {have}, the plan as {cfg}",
                    "open each rank's store with open_shards(root, plan, tables, ...) for this plan",
                )
        self.store, self.plan, self.configs = store, plan, names
        self.feature_tables = dict(feature_tables)
        self.mode, self.nonfinite = mode, nonfinite
        if isinstance(comm_dtype, dict):
            unknown = sorted(set(comm_dtype) - set(names))
            if unknown:
                raise UnknownTableError(
                    f"comm_dtype names tables {unknown} the plan does not hold", f"use {sorted(names)}"
                )
            self.comm_dtypes = {t: check_comm_dtype(comm_dtype.get(t, "fp32")) for t in names}
        else:
            self.comm_dtypes = dict.fromkeys(names, check_comm_dtype(comm_dtype))
        self.planned = [tp for tp in plan.tables if tp.table in set(self.feature_tables.values())]
        self.chained = chained_tables(self.planned, names)
        if self.chained and nonfinite == "skip":
            raise ConfigError(
                "nonfinite='skip' with column pieces of row-wise Adagrad tables",
                "use 'raise' or 'zero': a piece cannot skip a row its other pieces update",
            )
        self.grad_scale = np.float32(grad_scale)
        self.busy_s = 0.0  # seconds this rank spent in its stores' lookups and updates and in pooling
        self._anchor = torch.empty(0, requires_grad=True)

    # ------------------------------------------------------------------ forward
    def forward(self, features) -> dict[str, torch.Tensor]:
        """Pooled bags of this rank's batch per feature, float32 (B, dim)."""
        step, failure = None, None
        try:
            step = _Step(self._local_bags(features))
        except (ConfigError, IdTypeError, IndexError) as e:
            failure = e
        self.exchange.agree(failure, "checking the batch")
        assert step is not None
        training = torch.is_grad_enabled() and self.training
        outs = _Bags.apply(self._anchor if training else self._anchor.detach(), self, step, training)
        return dict(zip(self.feature_tables, outs, strict=True))

    def _local_bags(self, features) -> dict[str, LocalBags]:
        jagged = jagged_of(features)
        missing = [f for f in self.feature_tables if f not in jagged]
        if missing:
            raise ConfigError(f"features {missing} are missing from the batch", "give every feature on every rank")
        parts: dict[str, list] = {}
        for f, table in self.feature_tables.items():
            values, lengths, weights = jagged[f]
            ids = as_numpy_ids(values, f"values of feature {f!r}")
            lens = as_numpy_ids(lengths, f"lengths of feature {f!r}")
            if ids.ndim != 1 or lens.ndim != 1 or bool((lens < 0).any()) or int(lens.sum()) != ids.shape[0]:
                raise IdTypeError(
                    f"feature {f!r}: {ids.shape} values with lengths summing to {int(lens.sum())}",
                    "give 1-D values and one length >= 0 per bag, summing to the number of values",
                )
            if weights is not None and (self.mode != "sum" or weights.requires_grad):
                raise ConfigError(
                    f"feature {f!r} has weights (mode {self.mode!r}, requires_grad={weights.requires_grad})",
                    "a sharded collection takes per-sample weights with mode='sum' and no gradient of their own",
                )
            table_ids(table, ids, self.configs[table].num_rows)
            offsets = np.zeros(lens.shape[0] + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            w = None if weights is None else np.array(weights.detach().reshape(-1).cpu().numpy(), np.float32)
            if w is not None and w.shape[0] != ids.shape[0]:
                raise ConfigError(f"feature {f!r} has {w.shape[0]} weights for {ids.shape[0]} values", "one per value")
            parts.setdefault(table, []).append((ids, offsets, w))
        return {t: LocalBags.of(p, self.mode == "mean") for t, p in parts.items()}

    def run_forward(self, step: _Step, training: bool) -> list[np.ndarray]:
        """The requests, the owners' lookups, the replies; this rank's pooled bags per feature."""
        ex = self.exchange
        out: list[list[np.ndarray]] = [[] for _ in range(ex.world_size)]
        for tp in self.planned:
            bags = step.tables[tp.table]
            if tp.sharding_type in BAG_SHARDED:
                for r, _, _ in tp.pieces():
                    out[r] += bags.message()
            elif tp.sharding_type in ROW_SHARDED:
                owner = row_owner(bags.ids, len(tp.ranks))
                step.owners[tp.table] = owner
                for g, req in enumerate(split_rows(bags, owner, len(tp.ranks))):
                    step.requests[(tp.table, g)] = req
                    out[tp.ranks[g]] += req
        incoming = ex.all_to_all(out)
        replies, failure = [[] for _ in range(ex.world_size)], None
        t0 = time.perf_counter()
        try:
            self._serve(step, incoming, replies, training)
        except Exception as e:  # a store's failure on one rank: every rank stops here
            failure = e
        self.busy_s += time.perf_counter() - t0
        ex.agree(failure, "the owners' lookups")
        answers = ex.all_to_all(replies)
        t0 = time.perf_counter()
        out = self._assemble(step, answers)
        self.busy_s += time.perf_counter() - t0
        return out

    def _serve(self, step: _Step, incoming: list[list[np.ndarray]], replies: list, training: bool) -> None:
        ex = self.exchange
        engine = self.store.engine if self.store is not None else None
        at = [0] * ex.world_size
        for tp in self.planned:
            if tp.sharding_type in BAG_SHARDED:
                for r, c0, c1 in tp.pieces():
                    if r != ex.rank:
                        continue
                    local = tp.table if c1 < 0 else piece_name(tp.table, c0, c1)
                    parts = [incoming[s][at[s] : at[s] + 4] for s in range(ex.world_size)]
                    at = [a + 4 for a in at]
                    gb = GlobalBags.of(parts, self.mode == "mean")
                    out, fwd = engine.lookup_pooled(local, engine.check_bags(local, gb.plan), backward=training)
                    pooled = np.asarray(out)
                    for s in range(ex.world_size):
                        replies[s].append(encode(gb.rows_for(pooled, s), self.comm_dtypes[tp.table]))
                    if training:
                        step.served.append(_Served(tp, local, c0, c1, bags=gb, forward=fwd))
            elif tp.sharding_type in ROW_SHARDED and ex.rank in tp.ranks:
                reqs = [incoming[s][at[s] : at[s] + 4] for s in range(ex.world_size)]
                at = [a + 4 for a in at]
                asked = [requested_ids(q) for q in reqs]
                rows = np.asarray(self.store.lookup(tp.table, np.concatenate(asked)))
                bounds = np.cumsum([0] + [a.shape[0] for a in asked])
                for s in range(ex.world_size):
                    replies[s].append(encode(rows[bounds[s] : bounds[s + 1]], self.comm_dtypes[tp.table]))
                if training:
                    step.served.append(_Served(tp, tp.table, 0, -1, requests=reqs))
            elif tp.sharding_type is ShardingType.DATA_PARALLEL and training:
                step.served.append(_Served(tp, tp.table, 0, -1))

    def _assemble(self, step: _Step, answers: list[list[np.ndarray]]) -> list[np.ndarray]:
        ex = self.exchange
        engine = self.store.engine if self.store is not None else None
        at = [0] * ex.world_size
        pooled: dict[str, np.ndarray] = {}
        for tp in self.planned:
            bags, dim = step.tables[tp.table], self.configs[tp.table].dim
            if tp.sharding_type in BAG_SHARDED:
                pieces = []
                for r, _, _ in tp.pieces():
                    pieces.append(decode(answers[r][at[r]]))
                    at[r] += 1
                pooled[tp.table] = pieces[0] if len(pieces) == 1 else np.hstack(pieces)
            elif tp.sharding_type in ROW_SHARDED:
                replies = []
                for r in tp.ranks:
                    replies.append(decode(answers[r][at[r]]))
                    at[r] += 1
                pooled[tp.table] = pool_local(bags, rows_by_position(bags, step.owners[tp.table], replies, dim))
            else:
                checked = engine.check_bags(tp.table, bags.plan)
                pooled[tp.table] = np.asarray(engine.lookup_pooled(tp.table, checked, backward=False)[0])
        return self._per_feature(step, pooled)

    def _per_feature(self, step: _Step, pooled: dict[str, np.ndarray]) -> list[np.ndarray]:
        out, seen = [], dict.fromkeys(pooled, 0)
        for t in self.feature_tables.values():
            k = seen[t]
            counts = step.tables[t].counts
            first = int(counts[:k].sum())
            out.append(np.ascontiguousarray(pooled[t][first : first + int(counts[k])]))
            seen[t] = k + 1
        return out

    # ------------------------------------------------------------------ backward
    def run_backward(self, step: _Step, grads: list[np.ndarray | None]) -> None:
        """Each rank's bag gradients to the owners; the owners' checked updates, queued
        for the end of the backward pass once every rank's checks passed."""
        ex = self.exchange
        per_table = self._per_table(step, grads)
        out: list[list[np.ndarray]] = [[] for _ in range(ex.world_size)]
        for tp in self.planned:
            g, bags, dtype = per_table[tp.table], step.tables[tp.table], self.comm_dtypes[tp.table]
            if tp.sharding_type in BAG_SHARDED:
                for r, c0, c1 in tp.pieces():
                    out[r].append(encode(g if c1 < 0 else g[:, c0:c1], dtype))
            elif tp.sharding_type in ROW_SHARDED:
                for gi, r in enumerate(tp.ranks):
                    out[r].append(encode(owned_grads(step.requests[(tp.table, gi)], g), dtype))
            else:
                for r in range(ex.world_size):
                    out[r] += [*bags.message(), encode(g, dtype)]
        incoming = ex.all_to_all(out)
        updates, splits, failure = [], {}, None
        t0 = time.perf_counter()
        try:
            updates, splits = self._updates(step, incoming)
        except Exception as e:  # a NaN gradient, a failed write-back: no rank updates anything
            failure = e
        self.busy_s += time.perf_counter() - t0
        ex.agree(failure, "the backward's checks")
        for update in updates:
            after_backward(lambda u=update: self._timed(u), step, ())
        if self.chained:  # (every rank: the chain's rounds are collectives)
            dims = {tp.table: self.configs[tp.table].dim for tp in self.chained}
            after_backward(lambda: self._timed(lambda: run_chain(ex, self.chained, splits, dims)), step, ())

    def _timed(self, update) -> None:
        t0 = time.perf_counter()
        update()
        self.busy_s += time.perf_counter() - t0

    def _updates(self, step: _Step, incoming: list[list[np.ndarray]]) -> tuple[list, dict]:
        """The checked updates of this rank's shards, and the halves of its column pieces of
        row-wise Adagrad tables, by (table, piece) (:mod:`tiered_emb.distributed.chain`)."""
        ex = self.exchange
        engine = self.store.engine if self.store is not None else None
        at = [0] * ex.world_size
        served = iter(step.served)
        updates, splits = [], {}
        for tp in self.planned:
            if tp.sharding_type in BAG_SHARDED:
                mine = sum(1 for p in tp.pieces() if p[0] == ex.rank)
            elif tp.sharding_type in ROW_SHARDED:
                mine = 1 if ex.rank in tp.ranks else 0
            else:
                mine = 1
            for _ in range(mine):
                sv = next(served)
                if tp.sharding_type is ShardingType.DATA_PARALLEL:
                    parts = [incoming[s][at[s] : at[s] + 5] for s in range(ex.world_size)]
                    at = [a + 5 for a in at]
                    gb = GlobalBags.of([p[:4] for p in parts], self.mode == "mean")
                    grad = gb.place([decode(p[4]) for p in parts], self.configs[tp.table].dim)
                    checked = engine.check_bags(sv.local, gb.plan)
                    updates.append(engine.pooled_update(sv.local, checked, grad, self.nonfinite))
                    continue
                grads = [decode(incoming[s][at[s]]) for s in range(ex.world_size)]
                at = [a + 1 for a in at]
                if sv.bags is not None:
                    grad = sv.bags.place(grads, grads[0].shape[1] if grads else 0)
                    if tp in self.chained:
                        piece = tp.columns.index(sv.c0)
                        splits[(tp.table, piece)] = engine.split_rows(sv.local, sv.forward, grad, self.nonfinite)
                    else:
                        updates.append(engine.pooled_update(sv.local, sv.forward, grad, self.nonfinite))
                else:
                    plan, grad = owned_bags(sv.requests, grads)
                    updates.append(
                        engine.pooled_update(sv.local, engine.check_bags(sv.local, plan), grad, self.nonfinite)
                    )
        return updates, splits

    def _per_table(self, step: _Step, grads: list[np.ndarray | None]) -> dict[str, np.ndarray]:
        parts: dict[str, list[np.ndarray]] = {t: [] for t in step.tables}
        seen = dict.fromkeys(step.tables, 0)
        for g, t in zip(grads, self.feature_tables.values(), strict=True):
            k = seen[t]
            n = int(step.tables[t].counts[k])
            if g is None:
                g = np.zeros((n, self.configs[t].dim), np.float32)
            elif self.grad_scale != 1:
                g = g * self.grad_scale
            parts[t].append(g)
            seen[t] = k + 1
        return {t: np.ascontiguousarray(np.concatenate(p), dtype=np.float32) for t, p in parts.items()}

    # ------------------------------------------------------------------ lookahead
    def owned_ids(self, features) -> dict[str, np.ndarray]:
        """The ids a future batch (this rank's part, as :meth:`forward` takes it) will ask of
        this rank's store, per table of that store: what ``store.prefetch`` takes, so each
        rank brings its own rows up ahead of the step (``tiered_emb.prefetch.lookahead``
        with ``ids_of=collection.owned_ids``).  A collective: every rank calls it for the
        same batches in the same order.  A bag shard's ids come in the order its lookup
        will take them (its global batch), so the step finds them pinned for it."""
        ex = self.exchange
        failure, bags = None, {}
        try:
            bags = self._local_bags(features)
        except (ConfigError, IdTypeError, IndexError) as e:
            failure = e
        ex.agree(failure, "checking a batch handed ahead")
        out: list[list[np.ndarray]] = [[] for _ in range(ex.world_size)]
        for tp in self.planned:
            b = bags[tp.table]
            if tp.sharding_type in BAG_SHARDED:
                for r, _, _ in tp.pieces():
                    out[r] += [b.counts, b.lengths, b.ids]
            elif tp.sharding_type in ROW_SHARDED:
                owner = row_owner(b.ids, len(tp.ranks))
                for g, r in enumerate(tp.ranks):
                    out[r].append(np.unique(b.ids[owner == g]))
            else:
                for r in range(ex.world_size):
                    out[r].append(b.ids)
        incoming = ex.all_to_all(out)
        return self._owned(incoming)

    def _owned(self, incoming: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        ex = self.exchange
        at = [0] * ex.world_size
        ids: dict[str, list[np.ndarray]] = {}
        for tp in self.planned:
            if tp.sharding_type in BAG_SHARDED:
                for r, c0, c1 in tp.pieces():
                    if r != ex.rank:
                        continue
                    parts = [[*incoming[s][at[s] : at[s] + 3], _NO_WEIGHTS] for s in range(ex.world_size)]
                    at = [a + 3 for a in at]
                    local = tp.table if c1 < 0 else piece_name(tp.table, c0, c1)
                    ids.setdefault(local, []).append(GlobalBags.of(parts, False).plan.ids)
            elif ex.rank in tp.ranks:  # a row shard of this rank's, or a replica
                got = [incoming[s][at[s]] for s in range(ex.world_size)]
                at = [a + 1 for a in at]
                ids.setdefault(tp.table, []).append(np.concatenate(got))
        return {t: np.concatenate(parts) for t, parts in ids.items()}

    def bytes_sent(self) -> int:
        """Bytes this rank has sent to the others since it was built."""
        return self.exchange.sent


_NO_WEIGHTS = np.empty(0, dtype=np.float32)


class _Bags(torch.autograd.Function):
    """The collection's outputs, one per feature, from one exchange; one backward for all."""

    @staticmethod
    def forward(ctx, anchor, module: ShardedEmbeddingBagCollection, step: _Step, training: bool):
        outs = module.run_forward(step, training)
        ctx.module, ctx.step = module, (step if training else None)
        return tuple(torch.from_numpy(o) for o in outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        if ctx.step is None:
            raise BackwardError(
                "a second backward through a sharded collection's output, whose update the owners applied",
                "sum the losses and call backward once",
            )
        step, ctx.step = ctx.step, None
        host = [None if g is None else np.ascontiguousarray(g.detach().cpu().numpy(), dtype=np.float32) for g in grads]
        ctx.module.run_backward(step, host)
        return None, None, None, None


class Shards:
    """A job's sharded tables as this rank sees them: its store (None if the plan gives it
    no table), the plan and every table (``comm_dtype``, ``group``, ``grad_scale`` as
    :class:`ShardedEmbeddingBagCollection` takes them); :meth:`collection` makes the sharded collection
    of some of its features (what :class:`tiered_emb.torchrec.TieredEmbeddingBagCollection`
    takes as ``sharded=`` to shard TorchRec's collection the same way)."""

    def __init__(
        self,
        store,
        plan: ShardingPlan,
        tables: list[TableConfig],
        comm_dtype: str | dict[str, str] = "fp32",
        group=None,
        grad_scale: float = 1.0,
    ):
        self.store, self.plan, self.tables = store, plan, list(tables)
        self.comm_dtype, self.group, self.grad_scale = comm_dtype, group, grad_scale
        self.made: list[ShardedEmbeddingBagCollection] = []

    def table_config(self, name: str) -> TableConfig:
        """The job's config of table ``name`` (whichever rank holds it)."""
        for t in self.tables:
            if t.name == name:
                return t
        raise UnknownTableError(f"table {name!r} is not one of the job's", f"use {[t.name for t in self.tables]}")

    def collection(self, feature_tables, mode: str = "sum", nonfinite: str = "raise") -> ShardedEmbeddingBagCollection:
        """A :class:`ShardedEmbeddingBagCollection` of ``feature_tables`` over these shards
        (every rank must make the same ones, in the same order)."""
        made = ShardedEmbeddingBagCollection(
            self.store,
            self.plan,
            self.tables,
            feature_tables,
            mode=mode,
            nonfinite=nonfinite,
            comm_dtype=self.comm_dtype,
            group=self.group,
            grad_scale=self.grad_scale,
        )
        self.made.append(made)
        return made


__all__ = ["ShardedEmbeddingBagCollection", "Shards"]
