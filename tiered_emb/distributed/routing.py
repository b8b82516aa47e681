"""What a sharded step sends where, and how the owners put the pieces back in order.

The rule that makes a sharded step bitwise the single process's (docs/distributed.md):
the *global batch* of a table is its features' bags, feature by feature, and within a
feature rank by rank (rank 0's bags, then rank 1's ...): exactly the batch one process
would pool if it held the ranks' batches one after the other.  Every owner rebuilds its
part of that batch in that order, so each id's gradient terms reach the store's reduce in
the single process's order, and each bag is pooled by the same kernel over the same rows
in the same order:

- a **bag shard** (table-wise, or one column piece) gets whole bags and pools them;
- a **row shard** gets the distinct ids it owns, returns their rows, and the asking rank
  pools every bag itself (:func:`pool_local`), never summing partial bags; for the
  backward it keeps each bag's owned positions with their factor (weight, 1/len of a
  mean bag), so its update sums exactly the single process's terms of its ids;
- a **replica** (data-parallel) pools locally; in the backward every rank gets every
  rank's bags and gradients and applies the whole batch's update.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiered_emb.step.gather import pool_rows
from tiered_emb.step.plan import BagPlan, plan_bags

_NO_WEIGHTS = np.empty(0, dtype=np.float32)


@dataclass
class LocalBags:
    """One table's bags on this rank: its features' bags joined, feature by feature.

    ``counts`` int64 (F,): bags per feature; ``lengths`` int64 (B,); ``ids`` int64 (n,);
    ``weights`` float32 (n,) or None; ``plan`` the joined bags' :class:`BagPlan`.
    """

    counts: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray
    weights: np.ndarray | None
    plan: BagPlan

    @classmethod
    def of(cls, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], mean: bool) -> LocalBags:
        """From each feature's ``(ids, offsets, weights or None)``, in the table's feature order."""
        counts = np.array([p[1].shape[0] - 1 for p in parts], dtype=np.int64)
        lengths = np.concatenate([np.diff(p[1]) for p in parts]).astype(np.int64)
        ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
        weights = None
        if any(p[2] is not None for p in parts):
            weights = np.concatenate([p[2] if p[2] is not None else np.ones(p[0].shape[0], np.float32) for p in parts])
        offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(counts, lengths, ids, weights, plan_bags(ids, offsets, weights, mean=mean))

    def message(self) -> list[np.ndarray]:
        """The bags as they travel: counts, lengths, ids, weights (empty: none)."""
        return [self.counts, self.lengths, self.ids, self.weights if self.weights is not None else _NO_WEIGHTS]

    def scales(self) -> np.ndarray:
        """Each position's factor in its bag's gradient (float32 (n,)): weight, times 1/len
        for a mean bag, as the store's reduce forms it."""
        scale = np.ones(self.ids.shape[0], dtype=np.float32)
        if self.plan.mean:
            lens = self.lengths[self.lengths > 0]
            scale = np.repeat(np.float32(1.0) / lens.astype(np.float32), lens)
        if self.weights is not None:
            scale = scale * self.weights
        return scale.astype(np.float32, copy=False)


@dataclass
class GlobalBags:
    """The global batch of a table as an owner rebuilt it from every rank's part.

    ``spans[s]``: for rank s, each feature's ``(first bag, bags)`` in the global batch.
    """

    plan: BagPlan
    spans: list[list[tuple[int, int]]]

    @classmethod
    def of(cls, parts: list[list[np.ndarray] | None], mean: bool) -> GlobalBags:
        """From each rank's :meth:`LocalBags.message` (None: a rank that sent none), features
        in order, within a feature ranks in order."""
        sent = [(s, p) for s, p in enumerate(parts) if p is not None]
        n_feats = max((p[0].shape[0] for _, p in sent), default=0)
        ids, lengths, weights = [], [], []
        weighted = any(p[3].shape[0] for _, p in sent)
        spans: list[list[tuple[int, int]]] = [[] for _ in parts]
        cuts = {}
        for s, (counts, lens, _, _) in sent:
            bag_at = np.concatenate([[0], np.cumsum(counts)])
            id_at = np.concatenate([[0], np.cumsum(lens)])
            cuts[s] = (bag_at, id_at[bag_at])
        first = 0
        for f in range(n_feats):
            for s, (_, lens, sid, w) in sent:
                bag_at, id_at = cuts[s]
                b0, b1, i0, i1 = bag_at[f], bag_at[f + 1], id_at[f], id_at[f + 1]
                spans[s].append((first, int(b1 - b0)))
                first += int(b1 - b0)
                lengths.append(lens[b0:b1])
                ids.append(sid[i0:i1])
                if weighted:
                    weights.append(w[i0:i1] if w.shape[0] else np.ones(i1 - i0, dtype=np.float32))
        lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        offsets = np.zeros(lengths_all.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths_all, out=offsets[1:])
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        w_all = np.concatenate(weights).astype(np.float32) if weighted else None
        return cls(plan_bags(all_ids, offsets, w_all, mean=mean), spans)

    def rows_for(self, pooled: np.ndarray, s: int) -> np.ndarray:
        """Rank s's bags of ``pooled`` (global bag order), its features one after the other."""
        return np.concatenate([pooled[a : a + n] for a, n in self.spans[s]]) if self.spans[s] else pooled[:0]

    def place(self, grads: list[np.ndarray | None], width: int) -> np.ndarray:
        """The global batch's bag gradients (float32 (B, width)) from each rank's, in its bag order."""
        out = np.empty((self.plan.num_bags, width), dtype=np.float32)
        for s, g in enumerate(grads):
            if g is None:
                continue
            at = 0
            for a, n in self.spans[s]:
                out[a : a + n] = g[at : at + n]
                at += n
        return out


def split_rows(bags: LocalBags, owner: np.ndarray, group: int) -> list[list[np.ndarray]]:
    """A row-wise table's requests, one per rank of its group: the positions owned by
    that rank as ``[counts, sublens (owned positions per bag), ids, scales]``."""
    scales = bags.scales()
    bag_of = np.repeat(np.arange(bags.lengths.shape[0]), bags.lengths)
    out = []
    for g in range(group):
        mine = owner == g
        sublens = np.bincount(bag_of[mine], minlength=bags.lengths.shape[0]).astype(np.int64)
        out.append([bags.counts, sublens, bags.ids[mine], scales[mine]])
    return out


def requested_ids(request: list[np.ndarray]) -> np.ndarray:
    """The distinct ids a row-wise request asks for, sorted: the order rows go back in."""
    return np.unique(request[2])


def rows_by_position(bags: LocalBags, owner: np.ndarray, replies: list[np.ndarray], dim: int) -> np.ndarray:
    """Each position's row (float32 (n, dim)) from the owners' replies (rows of
    :func:`requested_ids`' order)."""
    rows = np.empty((bags.ids.shape[0], dim), dtype=np.float32)
    for g, reply in enumerate(replies):
        mine = np.flatnonzero(owner == g)
        if mine.shape[0]:
            _, inv = np.unique(bags.ids[mine], return_inverse=True)
            rows[mine] = reply[inv]
    return rows


def pool_local(bags: LocalBags, rows: np.ndarray) -> np.ndarray:
    """The bags pooled from their positions' rows by the store's own kernel (bitwise a
    store's ``lookup_pooled`` over the same rows)."""
    out = np.empty((bags.plan.num_bags, rows.shape[1]), dtype=np.float32)
    w = bags.plan.weights if bags.plan.weights is not None else _NO_WEIGHTS
    pool_rows(np.ascontiguousarray(rows), bags.plan, w, out)
    return out


def owned_grads(request: list[np.ndarray], grad: np.ndarray) -> np.ndarray:
    """The gradient rows a row shard needs of one rank's bags: those of its bags holding
    an owned position (``request`` as :func:`split_rows` made it), in bag order."""
    return np.ascontiguousarray(grad[request[1] > 0])


def owned_bags(requests: list[list[np.ndarray] | None], grads: list[np.ndarray | None]) -> tuple[BagPlan, np.ndarray]:
    """A row shard's part of the global batch, for its update: the bags holding owned ids
    (features in order, within one ranks in order), each with only those ids, weighted by
    their factors (sum pooling), and their gradients: the same terms, in the same order,
    the single process sums for those ids."""
    n_feats = max((r[0].shape[0] for r in requests if r is not None), default=0)
    lens, ids, scales, rows = [], [], [], []
    for f in range(n_feats):
        for r, g in zip(requests, grads, strict=True):
            if r is None:
                continue
            counts, sublens, sid, sc = r
            bag_at = np.concatenate([[0], np.cumsum(counts)])
            id_at = np.concatenate([[0], np.cumsum(sublens)])
            b0, b1 = bag_at[f], bag_at[f + 1]
            kept = sublens[b0:b1] > 0
            lens.append(sublens[b0:b1][kept])
            ids.append(sid[id_at[b0] : id_at[b1]])
            scales.append(sc[id_at[b0] : id_at[b1]])
            before = int((sublens[:b0] > 0).sum())
            rows.append(g[before : before + int(kept.sum())])
    dim = next((g.shape[1] for g in grads if g is not None), 0)
    all_lens = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    offsets = np.zeros(all_lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(all_lens, out=offsets[1:])
    plan = plan_bags(
        np.concatenate(ids) if ids else np.zeros(0, np.int64),
        offsets,
        np.concatenate(scales).astype(np.float32) if scales else np.zeros(0, np.float32),
        mean=False,
    )
    grad = np.concatenate(rows) if rows else np.zeros((0, dim), np.float32)
    return plan, np.ascontiguousarray(grad, dtype=np.float32)


__all__ = [
    "GlobalBags",
    "LocalBags",
    "owned_bags",
    "owned_grads",
    "pool_local",
    "requested_ids",
    "rows_by_position",
    "split_rows",
]
