"""Resolve: a batch's unique ids made resident in HBM, walking the tiers (the step's second stage).

For each chunk of at most the unpinned HBM capacity: probe HBM (pinning the hits when
some ids miss, so no miss of the chunk evicts a row the chunk needs), take the misses
out of DDR (exclusive caching), read the rest from LMDB in one transaction, initialise
the never-written rest lazily; HBM's victims go down into DDR and DDR's dirty victims to
LMDB.  A batch with more unique ids than HBM holds is answered chunk by chunk (the spill
path): slower, never different.

What must come from LMDB or the initialiser is read *before* any tier changes, so a
failed read (a corrupt store) leaves the tiers as they were and the call can be retried.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter

import numpy as np

from tiered_emb import expiry
from tiered_emb._backend import to_xp
from tiered_emb._jit import move_rows, one_thread, take_rows
from tiered_emb._order import stable_argsort
from tiered_emb.admission import admission_of
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError, UnknownTableError
from tiered_emb.expiry import expiry_of
from tiered_emb.init import init_rows, init_rows_into, table_hash
from tiered_emb.precision import encode, values_of
from tiered_emb.step.descend import Descents
from tiered_emb.step.device.launch import kernels_for
from tiered_emb.tiers import DdrTier, DirectHbmTier, HbmTier
from tiered_emb.tiers.ssd.codec import tombstones

TIER_COUNTERS = ("lookups", "hits", "misses", "evictions", "writebacks")
#: The parts of a resolve timed in ``Table.moves``, in the order a chunk runs them:
#: both indexes probed; HBM's decisions and its victims copied out; DDR's rows taken up
#: into HBM; LMDB's read; the never-written initialised; LMDB's and the initialiser's rows
#: copied up; HBM's victims admitted into DDR (DDR's dirty victims copied out); those
#: handed to the SSD tier's write-back buffer.
MOVE_PARTS = ("probe", "hbm_victims", "ddr_up", "ssd_read", "init", "below_up", "ddr_down", "write_back")
_NO_IDS = np.empty(0, dtype=np.int64)
_ALL = _NO_IDS  # (an ``inverse`` that is the identity)
#: Below this many rows taken up from DDR, its take runs on the step's thread: handing it to
#: the helper costs more than running it beside HBM's decisions saves.
_BESIDE_ROWS = 4096


def _charge(moves: dict, part: str, t0: float, rows: int, nbytes: int) -> float:
    """Add the time since ``t0``, ``rows`` and ``nbytes`` to ``moves[part]``; returns now."""
    now = perf_counter()
    m = moves[part]
    m[0] += now - t0
    m[1] += rows
    m[2] += nbytes
    return now


class Table:
    """One table's HBM and DDR tiers and its counters (the step's and the prefetch thread's)."""

    def __init__(self, cfg: TableConfig, tiers: TierConfig, xp, shares: tuple | None = None):
        """``shares``: the table's views of tiers shared by all tables
        (:func:`tiered_emb.tiers.pool.shared_tiers`), or None: tiers of its own."""
        self.cfg = cfg
        #: the table's admission counts (None: every id admitted at once)
        self.admission = admission_of(cfg)
        #: the table's touch log (None: its rows never expire)
        self.expiry = expiry_of(cfg)
        if cfg.packed and xp is not np:
            raise ConfigError(
                f"table {cfg.name!r}: rows of dtype {cfg.dtype!r}, state {cfg.state_dtype!r} are held on the "
                "host only in this version",
                "use TierConfig(device='cpu'), or float32 rows and state for an HBM tier on a GPU",
            )
        #: the key of the table's rounding bits (its initial rows' name) and the updates it
        #: had in the store's current step (:func:`tiered_emb.precision.rounding_key`)
        self.key_hash = table_hash(cfg.init_table or cfg.name)
        self.updates = 0
        self.hbm: HbmTier
        self.ddr: DdrTier
        if shares is not None:
            self.hbm, self.ddr = shares
        elif cfg.num_rows is not None and tiers.hbm_rows >= cfg.num_rows:  # the whole table fits: row id in slot id
            self.hbm = DirectHbmTier(cfg.num_rows, cfg.record_width, xp)
        else:
            self.hbm = HbmTier(tiers.hbm_rows, cfg.record_width, tiers.policy, xp)
        if shares is None:
            self.ddr = DdrTier(tiers.ddr_rows, cfg.record_width, tiers.policy)
        self.counters = {tier: dict.fromkeys(TIER_COUNTERS, 0) for tier in ("hbm", "ddr", "ssd")}
        self.counters["ssd"]["lazy_inits"] = 0
        # seconds, rows and bytes of each part of the moves between tiers (MOVE_PARTS)
        self.moves = {part: [0.0, 0, 0] for part in MOVE_PARTS}
        # what the prefetch thread brought up, apart from the step's own traffic
        self.prefetch_counters = {tier: dict(c) for tier, c in self.counters.items()}
        # A step placed rows in HBM for its own batch since the window was last re-pinned
        # (under LRU the prefetch window re-pins only the tables where one did).
        self.step_placed = False

    def stats(self, ssd: dict) -> dict:
        """The counters of each tier, with rows and bytes held and hit rates (``ssd``: the SSD
        tier's own figures of this table); see :meth:`TieredStore.stats`."""
        s: dict = {tier: dict(c) for tier, c in self.counters.items()}
        for tier, held in (("hbm", self.hbm), ("ddr", self.ddr)):
            # a shared tier's row takes a whole slot: the widest record of the store's tables
            row_bytes = 4 * (held.records.shape[1] if held.owner.shape[0] else self.cfg.record_width)
            rows = held.resident_rows
            s[tier].update(rows=rows, capacity_rows=held.capacity_rows, bytes=rows * row_bytes)
        s["ssd"].update(ssd)
        s["moves"] = {part: dict(zip(("seconds", "rows", "bytes"), m, strict=True)) for part, m in self.moves.items()}
        s["prefetch"] = {tier: dict(c) for tier, c in self.prefetch_counters.items()}
        for tier in ("hbm", "ddr", "ssd"):
            for d in (s, s["prefetch"]):
                look = d[tier]["lookups"]
                d[tier]["hit_rate"] = d[tier]["hits"] / look if look else 0.0
        return s

    def count_hits(self, n: int) -> None:
        """Count ``n`` HBM lookups that hit without a resolve (rows pinned for the batch, a direct tier)."""
        c = self.counters["hbm"]
        c["lookups"] += n
        c["hits"] += n


class Resolver:
    """The store's tables over its SSD tier: what the step and the prefetch window resolve ids with.

    ``lock`` (re-entrant) guards every change to the tiers; the store and the prefetch
    thread share it.  ``seed`` fixes the initial value of every row never written.
    """

    def __init__(self, tables: dict[str, Table], ssd, seed: int, xp, where: str = "", budget_bytes: int = 1 << 62):
        self.where = where  # the store's path, for messages
        self.budget_bytes = budget_bytes  # a batch's distinct records must fit in it
        self.tables = tables
        #: the tables in name order: a shared tier's table numbers
        self.names = sorted(tables)
        self.ssd = ssd
        self.seed = seed
        self.xp = xp
        # the step's CUDA kernels when HBM is on a GPU (step/device/launch.py); None: the host's Numba kernels
        self.kernels = kernels_for(xp)
        self.lock = threading.RLock()
        self.closed = False
        #: the store's step counter (:meth:`advance`; kept with each checkpoint)
        self.step = 0
        self._helper: ThreadPoolExecutor | None = None  # a second thread for bookkeeping, made at first use
        #: the bring-ups' descents handed to a thread of their own (:mod:`tiered_emb.step.descend`)
        self.descents = Descents()

    def _beside(self, fn, *args) -> Future:
        """Run ``fn(*args)`` (a kernel that lets the GIL go) on the helper thread."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="tiered_emb-resolve")
        return self._helper.submit(fn, *args)

    def shutdown(self) -> None:
        """Let the helper threads go (the store is closing)."""
        self.descents.shutdown()
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None

    def table(self, name) -> Table:
        """The table called ``name``, or UnknownTableError with the names there are."""
        t = self.tables.get(name) if isinstance(name, str) else None
        if t is None:
            raise UnknownTableError(
                f"table {name!r} is not in store {self.where!r}", f"use one of {sorted(self.tables)}"
            )
        return t

    def chunks(self, t: Table, uids: np.ndarray, checked: bool = False):
        """Yield ``(start, slots)`` for consecutive chunks of ``uids``, each held in HBM while the caller uses it.

        ``checked``: the caller raised an earlier failed write-back itself.
        """
        self.check_budget(t, uids.shape[0])
        with self.lock:
            # An earlier write-back that failed (a full disk) is raised now, before this
            # operation changes anything; a failure during it waits for the next one, so an
            # update spread over chunks is applied whole or not at all.
            if not checked:
                self.ssd.raise_failed_write()
            cap = t.hbm.unpinned_capacity
            if cap < 1:
                raise RuntimeError("every HBM slot is pinned")  # prefetch keeps a reserve; a bug if reached
            for start in range(0, uids.shape[0], cap):
                chunk = uids[start : start + cap]
                slots, pinned = self.bring_up(t, chunk, defer_errors=True)
                try:
                    yield start, slots
                finally:
                    if pinned:
                        t.hbm.release(slots)

    def read_below(
        self, t: Table, ids: np.ndarray, moves: dict | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Records of ``ids`` (none in HBM or DDR) from LMDB, or initialised where never written;
        timed into ``moves`` (:attr:`Table.moves`) where given.

        Returns ``(records float32 (n, record_width), on_ssd bool (n,), fresh int64 indices)``.
        """
        t0 = perf_counter()
        row_bytes = 4 * t.cfg.record_width
        sub = np.empty((ids.shape[0], t.cfg.record_width), dtype=np.float32)
        on_ssd = self.ssd.read(t.cfg.name, ids, sub)
        fresh = np.flatnonzero(~on_ssd)
        n_ssd = ids.shape[0] - fresh.shape[0]
        if moves is not None:
            t0 = _charge(moves, "ssd_read", t0, n_ssd, n_ssd * row_bytes)
        if fresh.shape[0]:
            init_rows_into(t.cfg, ids[fresh], self.seed, sub, fresh)
            if moves is not None:
                _charge(moves, "init", t0, fresh.shape[0], fresh.shape[0] * row_bytes)
        return sub, on_ssd, fresh

    def admission_blobs(self) -> dict[str, bytes]:
        """The admission counts of every table that has them, as a checkpoint saves them."""
        return {f"admission:{n}": t.admission.to_bytes() for n, t in sorted(self.tables.items()) if t.admission}

    def load_admission(self) -> None:
        """Take the admission counts saved with the SSD tier's last checkpoint (none: all zero)."""
        for name, t in sorted(self.tables.items()):
            saved = self.ssd.read_blob(f"admission:{name}") if t.admission else None
            if saved is not None:
                t.admission.load(saved, f"table {name!r} of {self.ssd.path}")

    def write(self, t: Table, uids: np.ndarray, rows: np.ndarray) -> None:
        """Set the weights of distinct ``uids`` to ``rows`` (float32 (k, dim), checked): in HBM,
        chunk by chunk; a bulk write of more than HBM holds sets those not resident straight
        in LMDB (:meth:`write_below`)."""
        if uids.shape[0] > t.hbm.unpinned_capacity:
            self.check_budget(t, uids.shape[0])  # (as for any batch; before anything is written)
            self.ssd.raise_failed_write()
            resident = self.write_below(t, uids, rows)
            uids, rows = uids[resident], rows[resident]
        for start, slots in self.chunks(t, uids):
            part = rows[start : start + slots.shape[0]]
            if t.cfg.dtype == "float32":
                t.hbm.records[to_xp(self.xp, slots), : t.cfg.dim] = to_xp(self.xp, part)
            else:  # (host records only: see Table)
                encode(t.cfg.dtype, part, t.hbm.records, slots)
            t.hbm.dirty[slots] = 1
            if t.expiry is not None:  # (a write is an update: the row's last one now)
                t.expiry.touch(
                    t.hbm.records, to_xp(self.xp, slots), uids[start : start + slots.shape[0]], self.step, self.xp
                )

    def advance(self) -> None:
        """One step more: the counter moves on, and each table with ``ttl_steps`` deletes the rows
        of its touch log of step ``step - ttl_steps - 1`` whose last update is still that step
        (:mod:`tiered_emb.expiry`); the logs held in memory are written once past an eighth of
        the budget."""
        self.step += 1
        for t in self.tables.values():
            t.updates = 0
        held = 0
        for name, t in sorted(self.tables.items()):
            if t.expiry is None:
                continue
            due = self.step - t.expiry.ttl - 1
            if due >= 0:
                ids = np.union1d(t.expiry.held_log(due), self.ssd.checkpoints.read_log(name, due))
                if ids.shape[0]:
                    gone = ids[t.expiry.last_update(self.peek(t, ids)) == due]
                    if gone.shape[0]:
                        self.delete(t, gone, pinned_too=True)
                t.expiry.held.pop(due, None)  # (a reopening replays the steps after its checkpoint)
            held += t.expiry.held_bytes
        if held > self.budget_bytes // expiry.HELD_SHARE:
            self.ssd.checkpoints.put_logs(self.take_logs())

    def take_logs(self) -> dict:
        """The touch logs held in memory, ``{(table, step): ids}``, handed over to be written."""
        return {
            (name, step): ids
            for name, t in sorted(self.tables.items())
            if t.expiry is not None
            for step, ids in t.expiry.take_held().items()
        }

    def hold_logs(self, logs) -> None:
        """Hold again the touch logs :meth:`take_logs` handed to a checkpoint that failed."""
        for (name, step), ids in (logs[0] if logs else {}).items():
            self.tables[name].expiry.log(ids, step)

    def delete(self, t: Table, uids: np.ndarray, pinned_too: bool = False) -> None:
        """Delete the rows of distinct ``uids``: each one held in HBM or DDR is set to its initial
        record there, clean (nothing writes its old bytes), and each one LMDB holds a row of
        gets a tombstone in the write-back buffer, read as no row at once and written with the next
        write-back or checkpoint.  ConfigError, nothing changed, for a row pinned by prefetch
        (unless ``pinned_too``: expiry resets a pinned row in its slot, between two steps).
        A slice of an eighth of the budget's records at a time."""
        hs = t.hbm.find(uids)
        at_h = np.flatnonzero(hs >= 0)
        pinned = at_h[t.hbm.pins[hs[at_h]] > 0]
        if pinned.shape[0] and not pinned_too:
            raise ConfigError(
                f"{pinned.shape[0]} of the ids to delete from table {t.cfg.name!r} are pinned for a "
                f"prefetched batch (id {int(uids[pinned[0]])} first)",
                "release the tickets of the batches that hold them (store.release), then delete",
            )
        step = max(1, self.budget_bytes // (32 * t.cfg.record_width))
        for a in range(0, uids.shape[0], step):
            self._delete_slice(t, uids[a : a + step], hs[a : a + step])

    def _delete_slice(self, t: Table, uids: np.ndarray, hs: np.ndarray) -> None:
        at_h = np.flatnonzero(hs >= 0)
        if at_h.shape[0]:
            width = t.cfg.record_width
            t.hbm.records[to_xp(self.xp, hs[at_h]), :width] = to_xp(self.xp, init_rows(t.cfg, uids[at_h], self.seed))
            t.hbm.dirty[hs[at_h]] = 0
        self.descents.wait(t.ddr)
        ds = t.ddr.find(uids)
        at_d = np.flatnonzero(ds >= 0)
        if at_d.shape[0]:
            t.ddr.records[ds[at_d], : t.cfg.record_width] = init_rows(t.cfg, uids[at_d], self.seed)
            t.ddr.dirty[ds[at_d]] = 0
        below = self.ssd.written.maybe_stored(t.cfg.name, uids, np.arange(uids.shape[0]))
        if below.shape[0]:  # a tombstone for each id LMDB holds a live row of
            found = self.ssd.read(t.cfg.name, uids[below], np.empty((below.shape[0], t.cfg.record_width), np.float32))
            below = below[found]
        if below.shape[0]:
            dead = tombstones(below.shape[0], t.cfg.record_width)
            self.ssd.write_pending({t.cfg.name: (uids[below], dead)}, durable=False)

    def check_budget(self, t: Table, n: int) -> None:
        """ConfigError when ``n`` distinct records of ``t`` exceed the budget (a batch must fit)."""
        need = n * 4 * t.cfg.record_width
        if need > self.budget_bytes:
            raise ConfigError(
                f"a batch of {n:,} distinct ids of table {t.cfg.name!r} holds {need:,} bytes of "
                f"records, more than TierConfig.budget_bytes={self.budget_bytes:,}",
                f"raise budget_bytes to at least {need:,} (TieredStore.open(path, tiers=...)) or split the batch",
            )

    def write_below(self, t: Table, uids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Set the weights of those of ``uids`` (distinct, within the budget: the caller checked)
        held in neither HBM nor DDR straight in LMDB (their optimizer state read, or
        initialised), as one sorted write on the writer thread; returns the mask of the others
        (resident: the caller sets them there).

        A bulk write larger than HBM would otherwise bring every row up only to evict it.
        """
        self.descents.wait(t.ddr)
        resident = t.hbm.find(uids) >= 0
        resident[~resident] = t.ddr.find(uids[~resident]) >= 0
        below = np.flatnonzero(~resident)
        below = below[stable_argsort(uids[below])]  # in id order (a bulk write's segments are)
        # a fifth of the budget a transaction: with background writes one commits (its rows,
        # encoded segments and LMDB's pages) while the next is copied and encoded
        step = max(1, self.budget_bytes // (5 * (8 + 4 * t.cfg.record_width)))
        for a in range(0, below.shape[0], step):
            at = below[a : a + step]
            if t.cfg.record_width == t.cfg.dim and t.cfg.dtype == "float32":  # the rows are the records
                # (a copy: the write goes on on the writer thread after the caller's rows change)
                recs, fresh = take_rows(rows, at), at[:0]
            else:
                recs, _, fresh = self.read_below(t, uids[at])
                encode(t.cfg.dtype, take_rows(rows, at), recs)
                if t.expiry is not None:
                    t.expiry.stamp(recs, self.step)
                    t.expiry.log(uids[at], self.step)
            # a failed write (an earlier failure was raised by the caller) waits for the next
            # operation, its rows in memory and on the read path: the write goes on to its end
            self.ssd.write_sorted(t.cfg.name, uids[at], recs, defer_errors=True)
            t.counters["ssd"]["writebacks"] += at.shape[0]
            t.counters["ssd"]["lazy_inits"] += fresh.shape[0]
        return resident

    def bring_up(
        self, t: Table, chunk: np.ndarray, c: dict | None = None, force_pin: bool = False, defer_errors: bool = False
    ):
        """Resolve ``chunk`` in HBM: misses come up from DDR / LMDB / the initialiser; victims go down.

        ``c``: the counters to charge (the step's by default; the prefetcher has its own).
        ``defer_errors``: a failed write-back is kept for the next operation (see :meth:`chunks`)
        instead of raised here.
        Returns ``(slots, pinned)``; an all-hit chunk is not pinned unless ``force_pin``.

        Each index is probed once: HBM's answer goes to its decisions, DDR's to its take.
        Decisions first, then the rows, in this order: HBM's victims out to a buffer, DDR's
        rows straight into their HBM slots, LMDB's and the initialiser's in, then DDR's dirty
        victims out to the write-back buffer and HBM's victims into DDR (docs/architecture.md,
        "Moving rows").
        """
        # While the SSD tier's writer works, its thread and process hold a core: the rows
        # move on this thread alone (measured: halves that wait for a busy core lose more
        # than the second core gains).
        with one_thread(self.ssd.writing):
            return self._bring_up(t, chunk, c, force_pin, defer_errors)

    def _bring_up(self, t: Table, chunk: np.ndarray, c: dict | None, force_pin: bool, defer_errors: bool):
        """:meth:`bring_up` on the threads it was given."""
        by_step = c is None
        c = t.counters if c is None else c
        moves = t.moves
        self.descents.wait(t.ddr)  # (its DDR tier changed by no other thread from here on)
        t0 = perf_counter()
        probe = t.hbm.find(chunk)
        missing = chunk[probe < 0]
        ddr_slots = t.ddr.find(missing) if missing.shape[0] else _NO_IDS
        below_at = np.flatnonzero(ddr_slots < 0)
        t0 = _charge(moves, "probe", t0, chunk.shape[0], 0)
        if below_at.shape[0]:  # first: a failed read changes nothing
            sub, on_ssd, fresh = self.read_below(t, missing[below_at], moves)
            t0 = perf_counter()
        # HBM's decisions and DDR's take (cache/bringup.py); a large take runs beside the
        # decisions, on the helper thread: they share no state
        dirty = np.zeros(missing.shape[0], dtype=np.uint8)
        if missing.shape[0] - below_at.shape[0] >= _BESIDE_ROWS:
            taking = self._beside(t.ddr.take_slots, missing, ddr_slots, dirty)
            try:
                slots, miss_idx, vslots, vids, vdirty, vtabs, pinned = t.hbm.decide(chunk, force_pin, probe)
            finally:
                n_ddr = taking.result()
        else:
            up = t.hbm.decide_up(t.ddr, chunk, force_pin, probe, missing, ddr_slots, dirty)
            slots, miss_idx, vslots, vids, vdirty, vtabs, pinned, n_ddr = up
        k, m, n_v = chunk.shape[0], miss_idx.shape[0], vids.shape[0]
        c["hbm"]["lookups"] += k
        c["hbm"]["hits"] += k - m
        c["hbm"]["misses"] += m
        c["hbm"]["evictions"] += n_v
        # and DDR's decisions on HBM's victims beside the copies up (those read no record of
        # DDR's that they change), the copies then on this thread alone
        behind = n_v > 0 and self.descents.on
        admitting = (
            self._beside(t.ddr.admit_decide, vids, vdirty, vtabs) if n_v >= _BESIDE_ROWS and not behind else None
        )
        try:
            with one_thread(admitting is not None):
                t0, vrows = self._copy_up(t, c, moves, t0, slots, miss_idx, vslots, ddr_slots, n_ddr, dirty)
                if below_at.shape[0]:
                    t0 = self._below_up(t, c, moves, t0, slots[miss_idx], below_at, dirty, sub, on_ssd, fresh)
        finally:
            plan = admitting.result() if admitting is not None else None
        t.step_placed |= by_step and m > 0
        if not n_v:
            return slots, pinned
        c["hbm"]["writebacks"] += int(vdirty.sum())
        if behind:  # (``vrows``, HBM's victim buffer, is reused by the table's next bring-up only, which waits)
            self.descents.hand(t.ddr, self.descend, t, c, vids, vdirty, vtabs, vrows, None, None, defer_errors)
            return slots, pinned
        try:  # raises a failed background write (its rows, and these, wait in memory)
            self.descend(t, c, vids, vdirty, vtabs, vrows, plan, t0, defer_errors)
        except BaseException:
            if pinned:
                t.hbm.release(slots)
            raise
        return slots, pinned

    def descend(self, t: Table, c: dict, vids, vdirty, vtabs, vrows, plan, t0, defer_errors: bool) -> None:
        """The descent of a bring-up's victims (ids, dirty flags, tables, rows): into DDR, and
        DDR's dirty victims to the write-back buffer (:mod:`tiered_emb.step.descend`).
        ``plan``: DDR's decisions, when made already; ``t0``: when the part began (None: now)."""
        moves, n_v = t.moves, vids.shape[0]
        t0 = perf_counter() if t0 is None else t0
        if plan is None:
            plan = t.ddr.admit_decide(vids, vdirty, vtabs)
        ev_ids, ev_rows, n_ev = t.ddr.admit_rows(vrows, plan)
        row_bytes = 4 * t.cfg.record_width
        t0 = _charge(moves, "ddr_down", t0, n_v, (n_v + ev_ids.shape[0]) * row_bytes)
        c["ddr"]["evictions"] += n_ev
        c["ddr"]["writebacks"] += ev_ids.shape[0]
        if ev_ids.shape[0]:
            c["ssd"]["writebacks"] += ev_ids.shape[0]
            rows = self._by_table(t, ev_ids, ev_rows, plan.ev_tabs)
            self.ssd.write_pending(rows, durable=False, defer_errors=defer_errors)
            _charge(moves, "write_back", t0, ev_ids.shape[0], ev_ids.shape[0] * row_bytes)

    def _by_table(self, t: Table, ids: np.ndarray, rows: np.ndarray, tabs: np.ndarray) -> dict:
        """DDR's dirty rows pushed out, ``{table: (ids, rows)}``: all of ``t`` from tiers of its
        own; from shared tiers, each table's (in table order) at its own width."""
        if not t.ddr.owner.shape[0]:
            return {t.cfg.name: (ids, rows)}
        out = {}
        for tab in np.unique(tabs):
            at = np.flatnonzero(tabs == tab)
            u = self.tables[self.names[int(tab)]]
            width = u.cfg.record_width
            mine = np.empty((at.shape[0], width), dtype=np.float32)
            move_rows(rows, at, mine, None, width)
            out[u.cfg.name] = (ids[at], mine)
        return out

    def _copy_up(self, t, c, moves, t0, slots, miss_idx, vslots, ddr_slots, n_ddr, dirty):
        """HBM's victims copied out, then DDR's rows into their HBM slots (the misses are the
        ids :meth:`_bring_up` found missing, in chunk order).  Returns ``(now, victims' rows)``."""
        row_bytes = 4 * t.cfg.record_width
        vrows = t.hbm.victim_rows(vslots)  # out before any row comes in
        t0 = _charge(moves, "hbm_victims", t0, vslots.shape[0], vslots.shape[0] * row_bytes)
        m = miss_idx.shape[0]
        if not m:
            return t0, vrows
        to = slots[miss_idx]
        if n_ddr:
            up = ddr_slots >= 0
            t.hbm.fill_from(t.ddr.records, ddr_slots[up] if n_ddr < m else ddr_slots, to[up] if n_ddr < m else to)
        t.hbm.dirty[to] = dirty
        c["ddr"]["lookups"] += m
        c["ddr"]["hits"] += n_ddr
        c["ddr"]["misses"] += m - n_ddr
        return _charge(moves, "ddr_up", t0, n_ddr, n_ddr * row_bytes), vrows

    def _below_up(self, t, c, moves, t0, to, below_at, dirty, sub, on_ssd, fresh) -> float:
        """The rows read from LMDB or initialised (``sub``) into their HBM slots."""
        n_ssd = int(on_ssd.sum())
        c["ssd"]["lookups"] += below_at.shape[0]
        c["ssd"]["hits"] += n_ssd
        c["ssd"]["misses"] += below_at.shape[0] - n_ssd
        c["ssd"]["lazy_inits"] += fresh.shape[0]
        t.hbm.fill(to[below_at], sub, dirty[below_at])
        return _charge(moves, "below_up", t0, below_at.shape[0], below_at.shape[0] * 4 * t.cfg.record_width)

    def peek(self, t: Table, uids: np.ndarray) -> np.ndarray:
        """Newest records of distinct ``uids`` as float32 values (k, value_width), touching no cache state."""
        return self.read_through(t, uids, _ALL, t.cfg.value_width)

    def read_through(
        self, t: Table, uids: np.ndarray, inverse: np.ndarray, cols: int, c: dict | None = None
    ) -> np.ndarray:
        """The first ``cols`` floats of the newest records of ``uids[inverse]`` read as float32
        values (:meth:`TableConfig.value_width <tiered_emb.config.TableConfig.value_width>`; distinct ``uids``;
        ``inverse`` empty: ``uids`` themselves), read where they are, HBM, DDR, LMDB or the
        initialiser: float32 host (n, cols).  No row moves and no cache state changes (a
        row never written is made, not kept).  ``c``: the counters to charge (None: none).

        The records are gathered into one buffer (LMDB's and the initialiser's through a
        buffer of their own, :meth:`read_below`, unless they are all of them), which is the
        answer when it is one (``cols`` the whole record, ``inverse`` the identity); else its
        rows are copied to the answer by ``inverse``, ``cols`` floats each.
        """
        k, width = uids.shape[0], t.cfg.record_width
        self.descents.wait(t.ddr)
        hs = t.hbm.find(uids)
        rest = np.flatnonzero(hs < 0)
        ds = t.ddr.find(uids[rest]) if rest.shape[0] else _NO_IDS
        below = rest[ds < 0]
        if below.shape[0] == k:  # (all from below: the buffer is the answer's source)
            src, on_ssd, _ = self.read_below(t, uids)
        else:
            src = np.empty((k, width), dtype=np.float32)
            at_h = np.flatnonzero(hs >= 0)
            if self.xp is np:
                move_rows(t.hbm.records, hs[at_h], src, at_h, width)
            elif at_h.shape[0]:
                src[at_h] = t.hbm.rows_at(hs[at_h])
            move_rows(t.ddr.records, ds, src, np.where(ds >= 0, rest, -1), width)
            on_ssd = np.zeros(0, dtype=bool)
            if below.shape[0]:
                rows, on_ssd, _ = self.read_below(t, uids[below])
                move_rows(rows, None, src, below, width)
        if t.cfg.packed:
            src, width = values_of(t.cfg, src), t.cfg.value_width
        if c is not None:
            for tier, asked, found in (
                ("hbm", k, k - rest.shape[0]),
                ("ddr", rest.shape[0], rest.shape[0] - below.shape[0]),
                ("ssd", below.shape[0], int(on_ssd.sum())),
            ):
                c[tier]["lookups"] += asked
                c[tier]["hits"] += found
                c[tier]["misses"] += asked - found
        if not inverse.shape[0]:
            return src if cols == width else np.ascontiguousarray(src[:, :cols])
        out = np.empty((inverse.shape[0], cols), dtype=np.float32)
        move_rows(src, inverse, out, None, cols)
        return out


__all__ = ["MOVE_PARTS", "TIER_COUNTERS", "Resolver", "Table"]
