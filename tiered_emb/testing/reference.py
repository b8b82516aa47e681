"""Reference implementations: a dict of rows, and exact LRU / LFU in plain Python.

They are slow on purpose: each line says what the fast path must do.  Tests compare the
store's bytes and the Numba policies' decisions with these.
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np

from tiered_emb.config import TableConfig
from tiered_emb.init import init_rows, table_hash
from tiered_emb.precision import decode, encode, records_of, rounding_key, values_of
from tiered_emb.step.reduce import REDUCE_CHUNK
from tiered_emb.testing.reference_ghosts import GHOST_POLICIES


class ReferencePolicy:
    """One cache tier's decisions, batch by batch, as :class:`tiered_emb.cache.slots.CacheTier` makes them.

    A batch's distinct ids (first-occurrence order) are taken in chunks of at most
    ``capacity`` ids.  Within a chunk the resident ids are pinned first; then, in order,
    a resident id is used again and a missing id takes the lowest free slot, or the slot
    of the victim: for LRU and LFU the unpinned resident with the smallest key, where the
    key is ``last use`` for LRU and ``(use count, last use, slot)`` for LFU; for FIFO,
    CLOCK and SIEVE the one their order gives (:meth:`_queue_victim`); for S3-FIFO and
    ARC their own (:mod:`tiered_emb.testing.reference_ghosts`).
    """

    def __init__(self, capacity: int, policy: str):
        assert policy in ("lru", "lfu", "fifo", "clock", "sieve", *GHOST_POLICIES)
        self.capacity = capacity
        self.policy = policy
        self.ghosts = GHOST_POLICIES[policy](capacity) if policy in GHOST_POLICIES else None
        self.clock = 0
        self.slot_of: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.free = list(range(capacity))  # lowest slot first
        self.order: list[int] = []  # FIFO, CLOCK, SIEVE: residents, oldest first
        self.ref: dict[int, bool] = {}  # CLOCK's and SIEVE's bit
        self.hand: int | None = None  # SIEVE: the id its hand is at (None: the oldest)

    def _queue_victim(self, pinned: set[int]) -> int:
        """FIFO: the oldest; CLOCK: from the oldest, a referenced id loses its bit and
        becomes the newest, the first unreferenced is the victim; SIEVE: from the hand,
        bits are cleared in place, the first unreferenced is the victim and the hand stays
        at the next newer id.  A pinned id is passed over: FIFO and CLOCK make it the
        newest, bit kept; SIEVE's hand goes past it."""
        if self.policy == "sieve":
            at = self.order.index(self.hand) if self.hand is not None else 0
            while True:
                v = self.order[at]
                if v not in pinned and not self.ref[v]:
                    self.hand = self.order[at + 1] if at + 1 < len(self.order) else None
                    self.order.pop(at)
                    return v
                if v not in pinned:
                    self.ref[v] = False
                at = (at + 1) % len(self.order)
        while True:
            v = self.order.pop(0)
            if v in pinned or (self.policy == "clock" and self.ref[v]):
                if v not in pinned:
                    self.ref[v] = False
                self.order.append(v)
                continue
            return v

    def _key(self, i: int):
        if self.policy == "lru":
            return (self.last[i],)
        return (self.count[i], self.last[i], self.slot_of[i])

    def access(self, chunk: list[int]) -> tuple[list[bool], list[int]]:
        """One chunk of distinct ids (len <= capacity); returns (hit per id, evicted ids in order)."""
        assert len(chunk) <= self.capacity and len(set(chunk)) == len(chunk)
        pinned = {i for i in chunk if i in self.slot_of}
        hits, evicted = [], []
        for i in chunk:
            self.clock += 1
            if i in self.slot_of:
                hits.append(True)
                self.count[i] += 1
                self.last[i] = self.clock
                if self.ghosts is not None:
                    self.ghosts.use(i)
                else:
                    self.ref[i] = self.policy != "fifo"
                continue
            hits.append(False)
            if self.ghosts is not None:
                self.ghosts.admit(i)
            if self.free:
                slot = self.free.pop(0)
            else:
                if self.ghosts is not None:
                    victim = self.ghosts.victim(pinned)
                    assert victim is not None, "every resident pinned: chunks are cut by capacity"
                    self.ghosts.forget(victim)
                elif self.policy in ("lru", "lfu"):
                    victim = min((j for j in self.slot_of if j not in pinned), key=self._key)
                else:
                    victim = self._queue_victim(pinned)
                if self.ghosts is None and self.policy not in ("lru", "lfu"):
                    del self.ref[victim]
                slot = self.slot_of.pop(victim)
                del self.count[victim], self.last[victim]
                evicted.append(victim)
            self.slot_of[i] = slot
            self.count[i] = 1
            self.last[i] = self.clock
            if self.ghosts is not None:
                self.ghosts.insert(i)
            elif self.policy not in ("lru", "lfu"):
                self.order.append(i)
                self.ref[i] = False
            pinned.add(i)
        return hits, evicted

    def access_batch(self, ids: list[int]) -> tuple[list[bool], list[int]]:
        """A batch (duplicates allowed): distinct ids in first-occurrence order, chunked."""
        uniq = list(dict.fromkeys(ids))
        hits, evicted = [], []
        for s in range(0, len(uniq), self.capacity):
            h, e = self.access(uniq[s : s + self.capacity])
            hits += h
            evicted += e
        return hits, evicted


class ReferenceStore:
    """The flat all-in-memory model of a store: ``{table: {id: record}}`` plus the initialiser.

    Optimizer arithmetic is written out per row in float32 (float64 for the row-wise
    mean, summed in element order), as the contract of :mod:`tiered_emb.optimizers`.
    """

    def __init__(self, tables: list[TableConfig], seed: int = 0):
        self.tables = {t.name: t for t in tables}
        self.seed = seed
        self.rows: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in tables}
        #: updates that held each id (exact admission counts, up to ``min_count``)
        self.seen: dict[str, dict[int, int]] = {t.name: {} for t in tables}
        #: the step counter (``advance_step``), and the step of each row's last update
        self.step = 0
        self.touched: dict[str, dict[int, int]] = {t.name: {} for t in tables}
        #: each table's updates in the current step (the key of a narrow row's rounding)
        self.updates: dict[str, int] = {t.name: 0 for t in tables}

    def record(self, table: str, i: int) -> np.ndarray:
        """The record (weights and optimizer state, as float32 values) of row ``i``, made
        lazily; changed in place by the caller."""
        rows = self.rows[table]
        if i not in rows:
            cfg = self.tables[table]
            rows[i] = values_of(cfg, init_rows(cfg, np.array([i], dtype=np.int64), self.seed))[0]
        return rows[i]

    def _rounded(self, table: str, ids: list[int], key: int | None, weights_only: bool = False) -> None:
        """Round the records of ``ids`` to the table's dtype and state dtype: to nearest, or
        stochastically with ``key`` (the weights by the arithmetic path, ``encode``'s
        ``generic``; the state arrays through :func:`tiered_emb.precision.records_of`).
        ``weights_only``: a write, which leaves the state as it is."""
        cfg = self.tables[table]
        if not cfg.packed or not ids:
            return
        id_arr = np.array(ids, np.int64)
        values = np.stack([self.record(table, i) for i in ids])
        back = values_of(cfg, records_of(cfg, values, id_arr, key, cfg.init_column))
        words = np.zeros((len(ids), cfg.weight_words), np.float32)
        encode(cfg.dtype, values[:, : cfg.dim], words, None, id_arr, key, generic=True, col0=cfg.init_column)
        back[:, : cfg.dim] = decode(cfg.dtype, words, None, cfg.dim)
        for i, r in zip(ids, back, strict=True):
            if weights_only:
                self.record(table, i)[: cfg.dim] = r[: cfg.dim]
            else:
                self.record(table, i)[:] = r

    def lookup(self, table: str, ids) -> np.ndarray:
        dim = self.tables[table].dim
        return (
            np.stack([self.record(table, int(i))[:dim].copy() for i in ids])
            if len(ids)
            else np.empty((0, dim), np.float32)
        )

    def peek_records(self, table: str, ids) -> np.ndarray:
        return np.stack([self.record(table, int(i)).copy() for i in ids])

    def write(self, table: str, ids, rows) -> None:
        dim = self.tables[table].dim
        for i, r in zip(ids, rows, strict=True):
            self.record(table, int(i))[:dim] = r
            self._rounded(table, [int(i)], None, weights_only=True)
            self._touch(table, int(i))

    def delete(self, table: str, ids) -> None:
        """Forget the rows of ``ids``: each reads as its initial record again."""
        for i in ids:
            self.rows[table].pop(int(i), None)
            self.touched[table].pop(int(i), None)

    def _touch(self, table: str, i: int) -> None:
        cfg = self.tables[table]
        if cfg.ttl_steps is not None:
            self.touched[table][i] = self.step
            self.record(table, i).view(np.uint32)[-1] = self.step

    def advance_step(self) -> int:
        """The next step: rows of a table with ``ttl_steps`` not updated for more steps are deleted."""
        self.step += 1
        self.updates = dict.fromkeys(self.tables, 0)
        for name, cfg in self.tables.items():
            if cfg.ttl_steps is not None:
                old = [i for i, u in self.touched[name].items() if self.step - u > cfg.ttl_steps]
                self.delete(name, old)
        return self.step

    def set_learning_rate(self, table: str | None, lr: float) -> None:
        """The learning rate of ``table`` (every table when None) from the next update on."""
        for name in self.tables if table is None else [table]:
            cfg = self.tables[name]
            self.tables[name] = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, lr=lr))

    def apply_gradients(self, table: str, ids, grads) -> None:
        cfg = self.tables[table]
        terms: dict[int, list[np.ndarray]] = {}
        for i, g in zip(ids, grads, strict=True):
            terms.setdefault(int(i), []).append(g.astype(np.float32))
        seen = self.seen[table]
        if not terms:  # (an empty update is none: it takes no number)
            return
        key = rounding_key(self.seed, table_hash(cfg.init_table or cfg.name), self.step, self.updates[table])
        self.updates[table] += 1
        done = []
        for i, rows in terms.items():
            seen[i] = min(seen.get(i, 0) + 1, cfg.min_count)
            if seen[i] >= cfg.min_count:  # admitted: from the min_count-th update that holds it
                _update_row(cfg, self.record(table, i), chunked_sum(rows))
                self._touch(table, i)
                done.append(i)
        self._rounded(table, done, None if cfg.rounding == "nearest" else key)


def chunked_sum(rows: list[np.ndarray]) -> np.ndarray:
    """An id's gradient rows summed as the store sums them: in batch order from +0.0 (so -0.0
    alone sums to +0.0), a chunk of REDUCE_CHUNK rows at a time, then the chunks' sums in order."""
    total = np.zeros(rows[0].shape, np.float32)
    for c in range(0, len(rows), REDUCE_CHUNK):
        part = np.zeros(rows[0].shape, np.float32)
        for g in rows[c : c + REDUCE_CHUNK]:
            part = part + g
        total = total + part
    return total


def _power(base: float, n: int) -> float:
    """``base ** n`` by binary powering in Python floats (IEEE doubles): the optimizers' rule."""
    result = 1.0
    while n > 0:
        if n & 1:
            result *= base
        base *= base
        n >>= 1
    return result


def _update_row(cfg: TableConfig, r: np.ndarray, g: np.ndarray) -> None:
    """One row's update, NumPy float32 operation by operation in the kernels' order."""
    opt, dim = cfg.optimizer, cfg.dim
    f32 = np.float32
    p = opt.params()
    lr, wd, mode = p[0], p[-2], p[-1]
    w = r[:dim]
    if mode == 1.0:  # L2: the gradient decayed by the weights before the step
        g = g + wd * w
    c = f32(1.0) - lr * wd if mode == 2.0 else f32(1.0)  # decoupled: the weights scaled first
    if opt.name == "sgd":
        w[:] = c * w - lr * g
    elif opt.name == "adagrad":
        s = r[dim : 2 * dim] + g * g
        r[dim : 2 * dim] = s
        w[:] = c * w - lr * (g / (np.sqrt(s) + p[1]))
    elif opt.name == "rowwise_adagrad":
        acc = 0.0
        for x in g.tolist():
            acc += float(f32(x)) * float(f32(x))
        s = f32(r[dim] + f32(acc / dim))
        r[dim] = s
        step = f32(lr / (f32(np.sqrt(s)) + p[1]))
        w[:] = c * w - step * g
    else:
        one = f32(1.0)
        t = f32(r[3 * dim] + one)
        r[3 * dim] = t
        c1 = one - f32(_power(float(p[1]), int(t)))
        c2 = one - f32(_power(float(p[2]), int(t)))
        m = p[1] * r[dim : 2 * dim] + (one - p[1]) * g
        v = p[2] * r[2 * dim : 3 * dim] + (one - p[2]) * g * g
        r[dim : 2 * dim] = m
        r[2 * dim : 3 * dim] = v
        w[:] = c * w - lr * ((m / c1) / (np.sqrt(v / c2) + p[3]))


@numba.njit(parallel=True, cache=True, nogil=True)
def pool_bags(rows, offsets, weights, use_weights, mean, out):
    """Pool ``rows`` (n, dim) into bags: ``out[b] = sum rows[offsets[b]:offsets[b+1]]``.

    In position order within each bag; ``weights`` (n,) scale rows when ``use_weights``;
    ``mean`` divides by the bag length (empty bags give zeros).  float32 (B, dim).
    """
    dim = rows.shape[1]
    for b in numba.prange(out.shape[0]):
        for j in range(dim):
            out[b, j] = 0.0
        lo = offsets[b]
        hi = offsets[b + 1]
        for i in range(lo, hi):
            w = weights[i] if use_weights else np.float32(1.0)
            for j in range(dim):
                out[b, j] += w * rows[i, j]
        if mean and hi > lo:
            inv = np.float32(1.0) / np.float32(hi - lo)
            for j in range(dim):
                out[b, j] *= inv


@numba.njit(parallel=True, cache=True, nogil=True)
def unpool_grads(grad_out, offsets, weights, use_weights, mean, out):
    """Backward of :func:`pool_bags`: each position's gradient row (n, dim) from its bag's."""
    dim = grad_out.shape[1]
    for b in numba.prange(grad_out.shape[0]):
        lo = offsets[b]
        hi = offsets[b + 1]
        scale = np.float32(1.0)
        if mean and hi > lo:
            scale = np.float32(1.0) / np.float32(hi - lo)
        for i in range(lo, hi):
            w = scale * (weights[i] if use_weights else np.float32(1.0))
            for j in range(dim):
                out[i, j] = w * grad_out[b, j]
