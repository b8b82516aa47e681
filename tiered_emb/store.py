"""TieredStore: one directory holding several embedding tables across HBM, DDR and LMDB.

A step walks this file top to bottom (see docs/architecture.md):

``lookup`` / ``apply_gradients`` / ``write``
  -> :meth:`_plan`      validate ids, dedupe (first-occurrence order)
  -> :meth:`_chunks`    per chunk of at most the HBM capacity: resolve (HBM probe, pin),
                        bring misses up (DDR take -> LMDB read -> lazy init), push victims
                        down (DDR admit -> dirty ones to LMDB); yields the pinned slots
  -> gather / optimizer update on those slots, then release the pins

A batch with more unique ids than HBM holds is answered chunk by chunk (the spill path):
slower, never different.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np

from tiered_emb._version import __version__
from tiered_emb._backend import resolve_xp, to_host, to_xp
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import (ConfigError, CorruptStoreError, IdRangeError, IdTypeError, NonFiniteGradientError,
                     RowDtypeError, RowShapeError, StoreClosedError, StoreExistsError, StoreFullError,
                     StoreLockedError, StoreNotFoundError, UnknownTableError)
from tiered_emb.init import init_rows
from tiered_emb.kernels import (_all_finite, _gather_positions, _gather_rows, _last_occurrence, dedupe, reduce_grads)
from tiered_emb.optimizers import _no_update, apply_update
from tiered_emb.cache.policies import LRU, POLICIES
from tiered_emb.prefetch import Prefetcher, Ticket
from tiered_emb.tiers import DdrTier, DirectHbmTier, HbmTier, SsdTier

FORMAT = "tiered_emb/2"
#: An older format :meth:`TieredStore.open` still takes: the same but for the rows written
#: after the last checkpoint (one LMDB record per row; now segments), which only
#: ``restore="checkpoint"`` can take (it drops them); the store is then rewritten as FORMAT.
FORMAT_1 = "tiered_emb/1"


def _locked(method):
    """Run ``method`` holding the store's lock (the prefetch thread takes the same one)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


_TIER_COUNTERS = ("lookups", "hits", "misses", "evictions", "writebacks")


class _Table:
    """One table's tiers and counters."""

    def __init__(self, cfg: TableConfig, tiers: TierConfig, xp):
        self.cfg = cfg
        if cfg.num_rows is not None and tiers.hbm_rows >= cfg.num_rows:  # the whole table fits: row id in slot id
            self.hbm = DirectHbmTier(cfg.num_rows, cfg.record_width, xp)
        else:
            self.hbm = HbmTier(tiers.hbm_rows, cfg.record_width, tiers.policy, xp)
        self.ddr = DdrTier(tiers.ddr_rows, cfg.record_width, tiers.policy)
        self.counters = {tier: dict.fromkeys(_TIER_COUNTERS, 0) for tier in ("hbm", "ddr", "ssd")}
        self.counters["ssd"]["lazy_inits"] = 0
        # what the prefetch thread brought up, apart from the step's own traffic
        self.prefetch_counters = {tier: dict(c) for tier, c in self.counters.items()}
        # A step placed rows in HBM for its own batch since the window was last re-pinned
        # (under LRU, TieredStore._repin_window re-pins only the tables where one did).
        self.step_placed = False


class TieredStore:
    """Embedding tables kept across HBM (CuPy or NumPy), DDR (NumPy) and LMDB.

    Build one with :meth:`create` or :meth:`open`; use it as a context manager.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig
    >>> d = tempfile.mkdtemp()
    >>> with TieredStore.create(d + "/s", [TableConfig("t", dim=4)], TierConfig(hbm_rows=2, device="cpu")) as s:
    ...     s.write("t", np.array([7]), np.ones((1, 4), np.float32))
    ...     s.lookup("t", np.array([7, 1, 7])).shape
    (3, 4)
    """

    # ------------------------------------------------------------------ lifecycle
    def __init__(self, path: Path, tables: list[TableConfig], tiers: TierConfig, seed: int, lock_fd: int,
                 ssd: SsdTier, meta: dict):
        self.path = path
        self.tiers = tiers
        self.seed = seed
        self.xp = resolve_xp(tiers.device)
        self._lock_fd = lock_fd
        self.ssd = ssd
        self._meta = meta
        self._tables = {t.name: _Table(t, tiers, self.xp) for t in tables}
        self._closed = False
        self._lock = threading.RLock()
        self._prefetcher = Prefetcher(self)

    @classmethod
    def create(cls, path, tables, tiers: TierConfig, seed: int = 0) -> "TieredStore":
        """Create a new store directory at ``path`` (which must not exist).

        Parameters
        ----------
        path : str or Path
        tables : list of TableConfig (distinct names)
        tiers : TierConfig
        seed : int, 0 <= seed < 2**64; with the table name and id it fixes every initial row
        """
        path = Path(path)
        tables = list(tables)
        if not tables or not all(isinstance(t, TableConfig) for t in tables):
            raise ConfigError(f"tables={tables!r} is invalid", "pass a non-empty list of TableConfig")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"tables have duplicate names {sorted(names)}", "give every table its own name")
        if not isinstance(tiers, TierConfig):
            raise ConfigError(f"tiers={tiers!r} is invalid", "pass a TierConfig")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ConfigError(f"seed={seed!r} is invalid", "use an int in [0, 2**64)")
        half_made = _half_made(path, look_inside=False)
        if path.exists() and not half_made:
            raise StoreExistsError(f"store path {str(path)!r} already exists",
                                   "open it with TieredStore.open, or choose a new path")
        resolve_xp(tiers.device)  # fail on device="cuda" before anything is written
        new_dirs = [] if half_made else [p for p in (path, *path.parents) if not p.exists()]
        if not half_made:
            try:
                path.mkdir(parents=True)
            except (NotADirectoryError, FileExistsError) as err:  # a file where a parent directory should be
                raise ConfigError(f"store path {str(path)!r} cannot be made ({err})",
                                  "choose a path whose parents are directories (or do not exist yet)") from err
        lock_fd = _lock(path)  # a create still running there holds it: StoreLockedError
        if half_made and not _half_made(path):  # looked at again, inside, under the lock
            os.close(lock_fd)
            raise StoreExistsError(f"store path {str(path)!r} holds an LMDB store without its manifest.json",
                                   "restore manifest.json from a backup, or choose a new path")
        try:
            for d in reversed(new_dirs):  # each new directory's entry in its parent
                _fsync_dir(d.parent)
            if half_made:  # a create() killed before its manifest: start it over
                shutil.rmtree(path / "lmdb", ignore_errors=True)
                (path / "manifest.json.tmp").unlink(missing_ok=True)
            ssd = SsdTier(path / "lmdb", {t.name: t.record_width for t in tables}, tiers.ssd_compression,
                          tiers.map_size_bytes, background_writes=tiers.background_writes,
                          table_rows={t.name: t.num_rows for t in tables})
            meta = {"format": FORMAT, "epoch": 0}
            ssd.checkpoint({}, meta, None)
            _fsync_dir(path / "lmdb")  # data.mdb's entry (LMDB syncs the file, not its directory)
            store = cls(path, tables, tiers, seed, lock_fd, ssd, meta)
            store._write_manifest()
        except BaseException:
            os.close(lock_fd)
            shutil.rmtree(path, ignore_errors=True)  # it did not exist: a retry finds no half-made store
            raise
        return store

    @classmethod
    def open(cls, path, tiers: TierConfig | None = None, restore: str = "checkpoint") -> "TieredStore":
        """Open an existing store.

        Parameters
        ----------
        tiers : TierConfig, optional
            New tier sizes / policy / device; the stored ones by default.
        restore : ``"checkpoint"`` (default) or ``"latest"``
            What to find after a crash: the last checkpoint, or also every row flushed
            since and the write-backs of evicted rows that had reached LMDB (they go out
            in groups of ``writeback_rows``; see docs/architecture.md).
        """
        path = Path(path)
        if restore not in ("checkpoint", "latest"):
            raise ConfigError(f"restore={restore!r} is invalid", "use 'checkpoint' or 'latest'")
        manifest_path = path / "manifest.json"
        if _half_made(path):
            raise StoreNotFoundError(f"{str(path)!r} holds a store whose create() did not finish (no manifest.json, "
                                     "no rows)", "call TieredStore.create on it again: it starts a half-made store over")
        if not manifest_path.is_file():
            raise StoreNotFoundError(f"no store at {str(path)!r} (no manifest.json)",
                                     "check the path, or make one with TieredStore.create")
        try:
            manifest = json.loads(manifest_path.read_text())
            if not isinstance(manifest, dict):
                raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
            if manifest.get("format") not in (FORMAT, FORMAT_1):
                raise ValueError(f"format {manifest.get('format')!r}")
            tables = [TableConfig.from_dict(t) for t in manifest["tables"]]
            stored_tiers = TierConfig(**manifest["tiers"])
            seed = manifest["seed"]
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
                raise ValueError(f"seed {seed!r}")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            raise CorruptStoreError(f"manifest {str(manifest_path)!r} is corrupt ({type(err).__name__}: {err})",
                                    "restore the store directory from a backup") from err
        if tiers is not None and not isinstance(tiers, TierConfig):
            raise ConfigError(f"tiers={tiers!r} is invalid", "pass a TierConfig or None")
        tiers = tiers or stored_tiers
        if not (path / "lmdb" / "data.mdb").is_file():
            raise CorruptStoreError(f"store {str(path)!r} has no LMDB data file (lmdb/data.mdb)",
                                    "restore the store directory from a backup")
        lock_fd = _lock(path)
        ssd = None
        try:
            resolve_xp(tiers.device)
            ssd = SsdTier(path / "lmdb", {t.name: t.record_width for t in tables}, tiers.ssd_compression,
                          max(tiers.map_size_bytes, stored_tiers.map_size_bytes),
                          background_writes=tiers.background_writes, table_rows={t.name: t.num_rows for t in tables},
                          legacy_pending=manifest["format"] == FORMAT_1, existing=True)
            meta = ssd.read_meta()
            if restore == "latest":
                ssd.promote_pending()
            else:
                ssd.discard_pending()
            store = cls(path, tables, tiers, seed, lock_fd, ssd, meta)
            if manifest["format"] != FORMAT:
                store._write_manifest()  # before any row is written in this format
        except BaseException:
            if ssd is not None:
                ssd.close()
            os.close(lock_fd)
            raise
        return store

    def _write_manifest(self) -> None:
        manifest = {"format": FORMAT, "version": __version__, "seed": self.seed, "epoch": self._meta["epoch"],
                    "tables": [t.cfg.to_dict() for t in self._tables.values()], "tiers": self.tiers.to_dict()}
        tmp = self.path / "manifest.json.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / "manifest.json")
            _fsync_dir(self.path)  # the rename itself: without this a power loss may undo it
        except OSError as err:  # the rows are committed in LMDB by then; only the manifest is behind
            if err.errno == errno.ENOSPC:
                raise StoreFullError(f"the disk under {str(self.path)!r} is full writing manifest.json ({err})",
                                     "free disk space; the next checkpoint() or close() writes it again") from err
            raise CorruptStoreError(f"writing {str(tmp)!r} failed ({err})",
                                    "check the disk and the store directory's permissions") from err

    def close(self, checkpoint: bool = True, extra: bytes | None = None) -> None:
        """Checkpoint, then release the LMDB environment and the writer lock (idempotent).

        If the checkpoint fails (``StoreFullError``: the disk is full) the store stays open
        with every row it holds, so nothing is lost: free space and call ``close()`` again.

        ``extra`` is saved with that checkpoint, as with :meth:`checkpoint`; without it the
        bytes of an earlier checkpoint stay (see :attr:`extra`).  ``checkpoint=False``
        closes without one: every change since the last checkpoint is given up, as after a
        crash (:meth:`open` restores that checkpoint).  For a trainer whose step failed
        midway, whose own state was saved with that checkpoint.
        """
        if self._closed:
            return
        _check_extra(extra)
        if extra is not None and not checkpoint:
            raise ConfigError("close(checkpoint=False, extra=...) would not save extra",
                              "pass extra with checkpoint=True, or leave it out")
        self._prefetcher.close()
        if checkpoint:
            self.checkpoint(extra)
        try:
            self._prefetcher.check()  # a failed unpinning on the thread, raised once the rows are safe
        finally:
            self._closed = True
            self.ssd.close()
            os.close(self._lock_fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def tables(self) -> dict[str, TableConfig]:
        return {n: t.cfg for n, t in self._tables.items()}

    @property
    def extra(self) -> bytes | None:
        """The ``extra`` bytes last saved with a checkpoint (``checkpoint(extra=...)`` or
        ``close(extra=...)``; e.g. a trainer's state), or None.  A checkpoint without
        ``extra`` keeps them as they were, so after ``checkpoint(extra=state)``, more steps
        and a plain ``close()`` they are older than the rows: pass the state to ``close`` too."""
        self._check_open()
        return self.ssd.read_extra()

    @property
    def epoch(self) -> int:
        """How many checkpoints this store has taken."""
        return int(self._meta["epoch"])

    # ------------------------------------------------------------------ validation
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {str(self.path)!r} is closed", "open it again with TieredStore.open")

    def _table(self, name) -> _Table:
        self._check_open()
        t = self._tables.get(name) if isinstance(name, str) else None
        if t is None:
            raise UnknownTableError(f"table {name!r} is not in store {str(self.path)!r}",
                                    f"use one of {sorted(self._tables)}")
        return t

    @staticmethod
    def _ids(t: _Table, ids) -> np.ndarray:
        try:
            a = np.asarray(ids)
        except (ValueError, TypeError) as err:  # ragged lists, say
            raise IdTypeError(f"ids for table {t.cfg.name!r} do not make an array ({err})",
                              "pass a 1-D integer array, e.g. np.asarray(ids, dtype=np.int64)") from err
        if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):  # ([] is float64)
            raise IdTypeError(f"ids for table {t.cfg.name!r} have dtype {a.dtype}",
                              "pass integer ids, e.g. np.asarray(ids, dtype=np.int64)")
        if a.ndim != 1:
            raise IdTypeError(f"ids for table {t.cfg.name!r} have shape {a.shape}", "pass a 1-D array (ravel it)")
        if a.shape[0] == 0:
            return a.astype(np.int64)
        if a.dtype == np.uint64 and int(a.max()) > 2**63 - 1:
            raise IdRangeError(f"id {int(a.max())} of table {t.cfg.name!r} is beyond int64", "ids are int64 >= 0")
        a = np.ascontiguousarray(a, dtype=np.int64)
        lo, hi = int(a.min()), int(a.max())
        if lo < 0:
            raise IdRangeError(f"id {lo} of table {t.cfg.name!r} is negative", "ids are >= 0")
        if t.cfg.num_rows is not None and hi >= t.cfg.num_rows:
            raise IdRangeError(f"id {hi} of table {t.cfg.name!r} is not below num_rows={t.cfg.num_rows}",
                               "check the id mapping, or create the table with a larger num_rows (or None)")
        return a

    @staticmethod
    def _rows(t: _Table, rows, n: int, what: str) -> np.ndarray:
        r = to_host(rows) if not isinstance(rows, np.ndarray) and hasattr(rows, "get") else np.asarray(rows)
        if r.dtype != np.float32:
            raise RowDtypeError(f"{what} for table {t.cfg.name!r} have dtype {r.dtype}",
                                "pass float32, e.g. np.asarray(x, dtype=np.float32)")
        if r.shape != (n, t.cfg.dim):
            raise RowShapeError(f"{what} for table {t.cfg.name!r} have shape {r.shape}, expected {(n, t.cfg.dim)}",
                                "pass one row of the table's dim per id")
        return np.ascontiguousarray(r)

    # ------------------------------------------------------------------ the step
    def _chunks(self, t: _Table, uids: np.ndarray, checked: bool = False):
        """Yield ``(start, slots)`` for consecutive chunks of ``uids``, each held in HBM while the caller uses it.

        ``checked``: the caller raised an earlier failed write-back itself (see below).
        """
        with self._lock:
            # An earlier write-back that failed (a full disk) is raised now, before this
            # operation changes anything; a failure during it waits for the next one, so an
            # update spread over chunks is applied whole or not at all.
            if not checked:
                self.ssd.raise_failed_write()
            cap = t.hbm.unpinned_capacity
            if cap < 1:
                raise RuntimeError("every HBM slot is pinned")  # prefetch keeps a reserve; a bug if reached
            for start in range(0, uids.shape[0], cap):
                chunk = uids[start:start + cap]
                slots, pinned = self._bring_up(t, chunk, defer_errors=True)
                try:
                    yield start, slots
                finally:
                    if pinned:
                        t.hbm.release(slots)

    def _bring_up(self, t: _Table, chunk: np.ndarray, c: dict | None = None, force_pin: bool = False,
                  defer_errors: bool = False):
        """Resolve ``chunk`` in HBM: misses come up from DDR / LMDB / the initialiser; victims go down.

        ``c``: the counters to charge (the step's by default; the prefetcher has its own).
        ``defer_errors``: a failed write-back is kept for the next operation (see :meth:`_chunks`)
        instead of raised here.
        Returns ``(slots, pinned)``; an all-hit chunk is not pinned unless ``force_pin``.
        """
        by_step = c is None
        c = t.counters if c is None else c
        # What must come from LMDB or the initialiser is read first, before any tier
        # changes: a failed read (a corrupt store) then leaves the tiers as they were,
        # instead of slots mapped to rows never filled and victims never pushed down.
        missing = chunk[t.hbm.find(chunk) < 0]
        below = missing[t.ddr.find(missing) < 0] if missing.shape[0] else missing
        if below.shape[0]:
            sub = np.empty((below.shape[0], t.cfg.record_width), dtype=np.float32)
            on_ssd = self.ssd.read(t.cfg.name, below, sub)
            fresh = np.flatnonzero(~on_ssd)
            if fresh.shape[0]:
                sub[fresh] = init_rows(t.cfg, below[fresh], self.seed)
        slots, miss_idx, vids, vrows, vdirty, pinned = t.hbm.resolve(chunk, force_pin)
        k, m = chunk.shape[0], miss_idx.shape[0]
        c["hbm"]["lookups"] += k
        c["hbm"]["hits"] += k - m
        c["hbm"]["misses"] += m
        c["hbm"]["evictions"] += vids.shape[0]
        if m:
            t.step_placed |= by_step
            miss_ids = chunk[miss_idx]  # == missing: the misses are the ids not resident, in chunk order
            rows = np.empty((m, t.cfg.record_width), dtype=np.float32)
            dirty = np.zeros(m, dtype=np.uint8)
            found = t.ddr.take(miss_ids, rows, dirty)
            n_ddr = int(found.sum())
            c["ddr"]["lookups"] += m
            c["ddr"]["hits"] += n_ddr
            c["ddr"]["misses"] += m - n_ddr
            if n_ddr < m:
                rest = np.flatnonzero(found == 0)  # == below, in the same order
                n_ssd = int(on_ssd.sum())
                c["ssd"]["lookups"] += rest.shape[0]
                c["ssd"]["hits"] += n_ssd
                c["ssd"]["misses"] += rest.shape[0] - n_ssd
                c["ssd"]["lazy_inits"] += fresh.shape[0]
                rows[rest] = sub
            t.hbm.fill(slots[miss_idx], rows, dirty)
        if vids.shape[0]:
            c["hbm"]["writebacks"] += int(vdirty.sum())
            ev_ids, ev_rows, n_ev = t.ddr.admit(vids, vrows, vdirty)
            c["ddr"]["evictions"] += n_ev
            c["ddr"]["writebacks"] += ev_ids.shape[0]
            if ev_ids.shape[0]:
                c["ssd"]["writebacks"] += ev_ids.shape[0]
                try:  # raises a failed background write (its rows, and these, wait in memory)
                    self.ssd.write_pending({t.cfg.name: (ev_ids, ev_rows)}, durable=False, defer_errors=defer_errors)
                except BaseException:
                    if pinned:
                        t.hbm.release(slots)
                    raise
        return slots, pinned

    @_locked
    def lookup(self, table: str, ids):
        """Newest rows of ``ids``, duplicates allowed.

        Parameters
        ----------
        table : str
        ids : int array (n,), >= 0 and below ``num_rows`` when it is set

        Returns
        -------
        float32 array (n, dim) on the HBM backend (``store.xp``).
        """
        t = self._table(table)
        ids = self._ids(t, ids)
        uids, inverse = dedupe(ids)
        n, dim = ids.shape[0], t.cfg.dim
        xp = self.xp
        if uids.shape[0] <= t.hbm.unpinned_capacity:
            for _, slots in self._chunks(t, uids):
                if xp is np:
                    out = np.empty((n, dim), dtype=np.float32)
                    _gather_rows(t.hbm.records, slots, inverse, out)
                else:
                    out = t.hbm.records[xp.asarray(slots[inverse]), :dim]
            return out if uids.shape[0] else xp.empty((0, dim), dtype=xp.float32)
        # Spill path: more unique ids than HBM holds; positions grouped by chunk.
        out_host = np.empty((n, dim), dtype=np.float32)
        cap = t.hbm.unpinned_capacity
        by_chunk = np.argsort(inverse // cap, kind="stable")
        bounds = np.searchsorted((inverse // cap)[by_chunk], np.arange(0, uids.shape[0] // cap + 2))
        for start, slots in self._chunks(t, uids):
            ci = start // cap
            positions = by_chunk[bounds[ci]:bounds[ci + 1]]
            if xp is np:
                _gather_positions(t.hbm.records, slots, inverse, positions, start, out_host)
            else:
                out_host[positions] = t.hbm.rows_at(slots[inverse[positions] - start])[:, :dim]
        return to_xp(xp, out_host)

    @_locked
    def apply_gradients(self, table: str, ids, grads, nonfinite: str = "raise") -> None:
        """Apply the table's optimizer: duplicate ids' gradients summed in batch order, one update per row.

        Parameters
        ----------
        ids : int array (n,)
        grads : float32 array (n, dim), host or HBM backend
        nonfinite : ``"raise"`` (NonFiniteGradientError, nothing changes), ``"skip"`` (rows
            whose summed gradient is not finite are left alone) or ``"zero"`` (treated as 0)
        """
        self.gradient_update(table, ids, grads, nonfinite)()

    def gradient_update(self, table: str, ids, grads, nonfinite: str = "raise"):
        """:meth:`apply_gradients` in two halves: every check and the reduction now (what it
        raises, it raises here, having changed nothing), the update when the returned
        callable is called (it takes the store's lock).  A backward through several tables
        checks them all before it updates any (:mod:`tiered_emb.torch`)."""
        t = self._table(table)
        ids = self._ids(t, ids)
        g = self._rows(t, grads, ids.shape[0], "gradients")
        if nonfinite not in ("raise", "skip", "zero"):
            raise ConfigError(f"nonfinite={nonfinite!r} is invalid", "use 'raise', 'skip' or 'zero'")
        if ids.shape[0] == 0:
            return _no_update
        uids, inverse = dedupe(ids)
        summed = reduce_grads(g, inverse, uids.shape[0])
        bad = None if _all_finite(summed) else ~np.isfinite(summed).all(axis=1)
        uids, summed = self._screen_nonfinite(t, uids, summed, bad, nonfinite)
        self.raise_failed_write()

        def update() -> None:
            with self._lock:
                self._update_rows(self._table(table), uids, summed, checked=True)
        return update

    def raise_failed_write(self) -> None:
        """Raise the failure of an earlier write-back of evicted rows (a full disk), once, if
        there is one; its rows still wait in memory, and the next write retries them.  The
        checks of :meth:`gradient_update` end with it."""
        with self._lock:
            self.ssd.raise_failed_write()

    @staticmethod
    def _screen_nonfinite(t: _Table, uids, summed, bad, nonfinite: str):
        """Apply the ``nonfinite`` rule to gradients summed per unique id (``bad``: bool (k,) or None)."""
        if bad is None or not bad.any():
            return uids, summed
        if nonfinite == "raise":
            raise NonFiniteGradientError(
                f"gradients of table {t.cfg.name!r} hold NaN/inf for {int(bad.sum())} ids (first id {int(uids[bad][0])})",
                "lower the learning rate or clip gradients; apply_gradients(..., nonfinite='skip'|'zero') tolerates them")
        if nonfinite == "skip":
            return uids[~bad], summed[~bad]
        summed[~np.isfinite(summed)] = 0.0
        return uids, summed

    def _update_rows(self, t: _Table, uids, summed, kernel=None, checked: bool = False) -> None:
        """One optimizer update per unique id, chunk by chunk in HBM; ``kernel`` overrides the CPU
        kernel; ``checked`` as :meth:`_chunks`."""
        opt = t.cfg.optimizer
        for start, slots in self._chunks(t, uids, checked):
            chunk = summed[start:start + slots.shape[0]]
            if kernel is not None and self.xp is np:
                kernel(t.hbm.records, slots, chunk, opt.params())
            else:
                apply_update(opt, t.hbm.records, slots if self.xp is np else self.xp.asarray(slots), chunk, self.xp)
            t.hbm.dirty[slots] = 1

    @_locked
    def write(self, table: str, ids, rows) -> None:
        """Set the weights of ``ids`` (optimizer state kept); for duplicates the last row wins.

        ``rows``: float32 (n, dim), finite.
        """
        t = self._table(table)
        ids = self._ids(t, ids)
        r = self._rows(t, rows, ids.shape[0], "rows")
        if not _all_finite(r):
            raise NonFiniteGradientError(f"rows written to table {t.cfg.name!r} hold NaN/inf",
                                         "write finite values")
        if ids.shape[0] == 0:
            return
        uids, inverse = dedupe(ids)
        last = np.empty(uids.shape[0], dtype=np.int64)
        _last_occurrence(inverse, last)
        rows_u = r[last]
        dim = t.cfg.dim
        for start, slots in self._chunks(t, uids):
            xs = to_xp(self.xp, slots)
            t.hbm.records[xs, :dim] = to_xp(self.xp, rows_u[start:start + slots.shape[0]])
            t.hbm.dirty[slots] = 1

    @_locked
    def peek(self, table: str, ids, with_state: bool = False) -> np.ndarray:
        """Newest values of ``ids`` as NumPy, without touching any cache state.

        Returns float32 (n, dim), or (n, dim + state_width) records with ``with_state``.
        """
        t = self._table(table)
        ids = self._ids(t, ids)
        ids, inverse = dedupe(ids)  # the LMDB read takes distinct ids
        out = np.empty((ids.shape[0], t.cfg.record_width), dtype=np.float32)
        hs = t.hbm.find(ids)
        at_h = np.flatnonzero(hs >= 0)
        if at_h.shape[0]:
            out[at_h] = t.hbm.rows_at(hs[at_h])
        rest = np.flatnonzero(hs < 0)
        ds = t.ddr.find(ids[rest])
        at_d = ds >= 0
        out[rest[at_d]] = t.ddr.records[ds[at_d]]
        rest = rest[~at_d]
        sub = np.empty((rest.shape[0], t.cfg.record_width), dtype=np.float32)
        found = self.ssd.read(t.cfg.name, ids[rest], sub)
        if (~found).any():
            sub[~found] = init_rows(t.cfg, ids[rest[~found]], self.seed)
        out[rest] = sub
        out = out[inverse]
        return out if with_state else np.ascontiguousarray(out[:, : t.cfg.dim])

    # ------------------------------------------------------------------ lookahead
    def prefetch(self, batch: dict, bring_up: bool = True) -> Ticket:
        """Hand the store the ids of a *future* batch; its rows come up and stay pinned in HBM.

        Parameters
        ----------
        batch : dict of table name -> int ids (n,)
        bring_up : queue the batch for the background thread now; with False the batch
            only enters the window (see below) until :meth:`bring_up` queues it

        Returns
        -------
        Ticket: pass it to :meth:`release` once that batch's update is applied.
        Bad ids raise here, on the caller's thread, and queue nothing.

        With a ``lookahead+`` policy the worker first pins the rows of the batch already
        resident (they cannot be evicted while the batch waits in the window), then brings
        up the rest.  See :mod:`tiered_emb.prefetch`.
        """
        self._check_open()
        if not isinstance(batch, dict):
            raise ConfigError(f"batch of type {type(batch).__name__} is invalid", "pass {table name: ids}")
        for name in batch:
            self._table(name)  # (a name that is not a table's, an int say, before sorting them)
        handed = {}
        for name in sorted(batch):  # checked here, deduped by the thread
            # a copy: the step is matched to its ticket by these ids
            handed[name] = np.array(self._ids(self._table(name), batch[name]), copy=True)
        return self._prefetcher.submit(handed, queue=bring_up)

    def bring_up(self, ticket: Ticket) -> None:
        """Queue a ticket made with ``prefetch(..., bring_up=False)`` for the background thread (once)."""
        self._check_open()
        self._prefetcher.bring_up(ticket)

    def read_ahead(self, ticket: Ticket) -> None:
        """Queue the LMDB reads of a ticket's batch for the background thread (once).

        The thread reads the records of the batch's rows that are neither in HBM nor in
        DDR, without holding the store's lock, and keeps them in host memory beside the
        tiers until the ticket is released; the step then finds them there instead of
        waiting on LMDB.  Where rows are placed is still decided by the step, so hit
        rates are those of the step alone.
        """
        self._check_open()
        self._prefetcher.read_ahead(ticket)

    def release(self, ticket: Ticket) -> None:
        """Unpin a prefetched batch (after its update): queued on the background thread, after
        what it was given of the batch; raises its PrefetchError if bringing it up failed.
        The rows stay pinned until the thread gets there (:meth:`flush`, :meth:`checkpoint`
        and :meth:`close` wait for it)."""
        self._check_open()
        self._prefetcher.release(ticket)

    def _enter_ticket(self, ticket: Ticket) -> None:
        """Worker side: a batch enters the window; with a ``lookahead+`` policy its resident rows are pinned,
        after the rows that came up for the window's later batches since they entered (:meth:`_repin_window`)."""
        lookahead_policy = POLICIES[self.tiers.policy].lookahead
        if lookahead_policy:
            self._repin_window()
        self._prefetcher.window.append(ticket)  # the worker's own view of the window, in the order of its jobs
        for name, ids in sorted(ticket.ids.items()):
            u, inverse = dedupe(ids)
            ticket.aligned[name] = np.full(u.shape[0], -1, dtype=np.int64)
            ticket.todo_at[name] = np.arange(u.shape[0])
            ticket.uids[name] = u
            with self._lock:
                if self._closed:
                    return
                if lookahead_policy:
                    self._pin_resident(ticket, name)
            ticket.batch[name] = (ids, u, inverse)  # last: _pinned_batch reads it, then the rest

    def _repin_window(self) -> None:
        """Worker side: pin, for each batch of the window but the oldest (nearest first), its
        rows that came up since it entered (brought up by a step for its own batch) and are
        not yet pinned for it, within the pin budget; with an LRU base policy only in the
        tables where a step placed rows since the last time.

        Why: a batch's resident rows are pinned when it enters the window, but a row a later
        step brings up would otherwise be left to the policy until its own batch, and a
        policy evicts a newcomer first (LFU: one use).  With this, ``lookahead+lfu`` equals
        offline Belady knowing the same window (LFU ties) at every point measured
        (docs/benchmarks.md).  The oldest batch is left alone: its step may be running.
        Under LRU the rows the worker brings up (pinned for their own batch) are the most
        recent when unpinned, evicted after every older row: re-pinning them for later
        batches moved ``lookahead+lru`` by under 0.04 points at every point measured
        (docs/benchmarks.md) and cost the job's lookahead thread ~4 ms a step (probing
        every later batch's ids again as each batch enters).  So with an LRU base only the
        tables where a step placed rows are re-pinned.  Under LFU those rows are newcomers
        (one use), evicted first: there every table is, as before (without it
        ``lookahead+lfu`` loading a batch ahead lost up to 0.76 points).
        """
        with self._lock:
            if self._closed:
                return
            recency = POLICIES[self.tiers.policy].code == LRU
            placed = {name for name, t in self._tables.items() if t.step_placed or not recency}
            for name in placed:
                self._tables[name].step_placed = False
            if not placed:
                return
            for ticket in self._prefetcher.window[1:]:
                if ticket.error is not None:  # (released or not: its unpinning, queued after, takes every pin)
                    continue
                for name in sorted(ticket.uids):
                    if name in placed and ticket.todo_at[name].shape[0]:
                        self._pin_resident(ticket, name)

    def _pin_resident(self, ticket: Ticket, name: str) -> None:
        """Under the lock: pin for ``ticket`` the rows of table ``name`` that are resident and
        not yet pinned for it (the first ones, within the pin budget)."""
        t = self._tables[name]
        slots = t.hbm.find(ticket.uids[name])
        got = np.flatnonzero(slots >= 0)[:max(self._pin_budget(t), 0)]
        t.hbm.pin(slots[got])
        self._record_pins(ticket, name, got, slots[got])

    @staticmethod
    def _record_pins(ticket: Ticket, name: str, at: np.ndarray, slots: np.ndarray) -> None:
        """``slots`` are pinned for ``ticket`` now, for the entries ``at`` of its ids of table
        ``name`` still to place (``ticket.uids[name]``), which leave that list."""
        prev = ticket.slots.get(name)
        ticket.slots[name] = slots if prev is None else np.concatenate([prev, slots])
        todo = ticket.todo_at[name]
        ticket.aligned[name][todo[at]] = slots
        rest = np.ones(todo.shape[0], dtype=bool)
        rest[at] = False
        ticket.todo_at[name] = todo[rest]
        ticket.uids[name] = ticket.uids[name][rest]

    def _bring_up_ticket(self, ticket: Ticket) -> None:
        """Worker side: bring a ticket's rows up and leave them pinned (nearest batches first).

        The lock is taken table by table, so the step's own calls wait for one table at most.
        """
        if ticket.error is not None:  # it failed to enter the window
            return
        for name in sorted(ticket.uids):
            with self._lock:
                if self._closed:
                    return
                t = self._tables[name]
                take = ticket.uids[name][:max(self._pin_budget(t), 0)]
                if take.shape[0]:
                    slots, _ = self._bring_up(t, take, t.prefetch_counters, force_pin=True)
                    self._record_pins(ticket, name, np.arange(take.shape[0]), slots)

    def _pinned_batch(self, table: str, ids: np.ndarray):
        """``(ticket, uids, inverse, slots)`` when ``ids`` are the stepping batch's ids of ``table`` and
        every one of its rows is pinned in (host) HBM for it; else None.

        Pinned rows stay in their slots until the ticket is released after the step, and
        nothing else reads or writes them meanwhile (the worker only places other rows),
        so the step may pool and update them without the store's lock.
        """
        ticket = self._prefetcher.stepping
        if ticket is None or self.xp is not np or ticket.error is not None:
            return None
        handed = ticket.batch.get(table)
        if handed is None or handed[0].shape != ids.shape or not np.array_equal(handed[0], ids):
            return None
        slots = ticket.aligned[table]
        if slots.shape[0] and slots.min() < 0:
            return None
        return ticket, handed[1], handed[2], slots

    def _still_pinned(self, ticket: Ticket) -> bool:
        """True while ``ticket``'s step runs (its pins hold): it is the stepping one and not released."""
        return ticket is self._prefetcher.stepping and not ticket.released

    def _stage_ticket(self, ticket: Ticket) -> None:
        """Worker side of :meth:`read_ahead`: LMDB reads outside the lock, held by the SSD tier."""
        if ticket.error is not None:  # it failed to enter the window
            return
        batch = {}
        with self._lock:
            if self._closed:
                return
            for name in sorted(ticket.uids):
                t = self._tables[name]
                u = ticket.uids[name]
                batch[name] = u[(t.hbm.find(u) < 0) & (t.ddr.find(u) < 0)]
        self.ssd.stage(ticket.seq, batch)

    @staticmethod
    def _pin_budget(t: _Table) -> int:
        """Rows a ticket may still pin: prefetch leaves 1/8 of HBM (>= 1 row) to the step's own misses."""
        return t.hbm.unpinned_capacity - max(1, t.hbm.capacity_rows // 8)

    def _unpin_ticket(self, ticket: Ticket) -> None:
        window = self._prefetcher.window
        if ticket in window:
            window.remove(ticket)
        with self._lock:
            for name, slots in sorted(ticket.slots.items()):
                self._tables[name].hbm.release(slots)
            ticket.slots = {}
            ticket.ids, ticket.batch, ticket.aligned = {}, {}, {}  # nothing pinned for it any more (the arrays go)
            self.ssd.unstage(ticket.seq)

    # ------------------------------------------------------------------ durability
    def _dirty_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for name, t in sorted(self._tables.items()):
            parts_ids, parts_rows = [], []
            for tier in (t.hbm, t.ddr):
                slots = np.flatnonzero((tier.dirty != 0) & (tier.slot_ids >= 0))
                if slots.shape[0]:
                    parts_ids.append(tier.slot_ids[slots])
                    parts_rows.append(t.hbm.rows_at(slots) if tier is t.hbm else tier.records[slots])
            if parts_ids:
                out[name] = (np.concatenate(parts_ids), np.concatenate(parts_rows))
        return out

    def _mark_clean(self) -> None:
        for t in self._tables.values():
            t.hbm.dirty[:] = 0
            t.ddr.dirty[:] = 0

    def flush(self) -> int:
        """Write every dirty row to LMDB (durable; not a checkpoint). Returns rows written."""
        self._check_open()
        self._prefetcher.drain()
        with self._lock:
            return self._flush()

    def _flush(self) -> int:
        batches = self._dirty_rows()
        n = self.ssd.write_pending(batches)
        self._mark_clean()
        for name, (ids, _) in batches.items():
            self._tables[name].counters["ssd"]["writebacks"] += ids.shape[0]
        return n

    def checkpoint(self, extra: bytes | None = None) -> int:
        """Flush and make this instant the store's durable point, atomically.

        After it returns, a crash at any instant loses nothing up to here, and
        :meth:`open` restores it bitwise.  ``extra`` (bytes, e.g. a trainer's step and
        dense weights) is saved in the same transaction; read it back as :attr:`extra`.
        Returns the number of rows written.
        """
        self._check_open()
        _check_extra(extra)
        self._prefetcher.drain()
        with self._lock:
            return self._checkpoint(extra)

    def _checkpoint(self, extra) -> int:
        batches = self._dirty_rows()
        meta = dict(self._meta, epoch=self.epoch + 1)
        n = self.ssd.checkpoint(batches, meta, extra)
        self._meta = meta
        self._mark_clean()
        for name, (ids, _) in batches.items():
            self._tables[name].counters["ssd"]["writebacks"] += ids.shape[0]
        self._write_manifest()
        return n

    # ------------------------------------------------------------------ introspection
    @_locked
    def stats(self) -> dict:
        """Per table and tier: lookups, hits, misses, evictions, writebacks, rows and bytes held.

        ``lookups`` of a tier count the unique ids asked of it; ``ssd.misses`` are rows
        created by the initialiser (never written); ``ssd.rows`` counts LMDB records.
        The step's traffic is at the top level; what the prefetch thread moved is under
        ``"prefetch"`` (same keys), so the step's HBM hit rate shows what prefetch won.
        """
        self._check_open()
        out = {}
        for name, t in sorted(self._tables.items()):
            row_bytes = 4 * t.cfg.record_width
            s = {tier: dict(c) for tier, c in t.counters.items()}
            s["hbm"].update(rows=t.hbm.resident_rows, capacity_rows=t.hbm.capacity_rows,
                            bytes=t.hbm.resident_rows * row_bytes)
            s["ddr"].update(rows=t.ddr.resident_rows, capacity_rows=t.ddr.capacity_rows,
                            bytes=t.ddr.resident_rows * row_bytes)
            ssd = self.ssd.table_stats(name)
            s["ssd"].update(rows=ssd["rows"] + ssd["pending_rows"], bytes=ssd["bytes"] + ssd["pending_bytes"],
                            writeback_rows=ssd["writeback_rows"])
            s["prefetch"] = {tier: dict(c) for tier, c in t.prefetch_counters.items()}
            for tier in ("hbm", "ddr", "ssd"):
                for d in (s, s["prefetch"]):
                    look = d[tier]["lookups"]
                    d[tier]["hit_rate"] = d[tier]["hits"] / look if look else 0.0
            out[name] = s
        return out

    @_locked
    def disk_bytes(self) -> int:
        """Bytes of the LMDB files on disk."""
        self._check_open()
        return self.ssd.file_bytes()


def _check_extra(extra) -> None:
    if extra is not None and not isinstance(extra, (bytes, bytearray, memoryview)):
        raise ConfigError(f"extra of type {type(extra).__name__} is invalid", "pass bytes (e.g. pickle.dumps(state))")


def _half_made(path: Path, look_inside: bool = True) -> bool:
    """Whether ``path`` is what a :meth:`TieredStore.create` killed before its manifest leaves:
    a directory of nothing but its lock file and LMDB files, no ``manifest.json``, and (with
    ``look_inside``; call it holding the lock) an LMDB environment holding no row and no
    checkpoint past the first.  A finished store that lost its manifest is not one."""
    try:
        top = {p.name for p in path.iterdir()}
        lmdb_files = {p.name for p in (path / "lmdb").iterdir()} if (path / "lmdb").is_dir() else set()
    except OSError:  # absent, not a directory, unreadable
        return False
    if not ("LOCK" in top and top <= {"LOCK", "lmdb", "manifest.json.tmp"} and lmdb_files <= {"data.mdb", "lock.mdb"}):
        return False
    return not look_inside or "data.mdb" not in lmdb_files or _holds_nothing(path / "lmdb")


def _holds_nothing(lmdb_dir: Path) -> bool:
    """True when the LMDB environment at ``lmdb_dir`` has no row in any table and no meta
    record past epoch 0; False when it has, or cannot be read (then nothing is replaced)."""
    import lmdb
    try:
        env = lmdb.open(str(lmdb_dir), readonly=True, lock=False, max_dbs=4096, subdir=True)
    except lmdb.Error:
        return False
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                if name == b"meta":
                    meta = txn.get(b"meta", db=db)
                    if meta is not None and json.loads(bytes(meta)).get("epoch", 0) != 0:
                        return False
                elif txn.stat(db)["entries"]:
                    return False
        return True
    except (lmdb.Error, ValueError, AttributeError):
        return False
    finally:
        env.close()


def _fsync_dir(path: Path) -> None:
    """fsync a directory: makes the renames and creations of entries in it durable (POSIX
    leaves them in the page cache until then, so a power loss could bring back the old
    ``manifest.json`` beside a newer checkpoint).

    Best effort where it cannot be done: a directory one may write but not list (mode
    0333) cannot be opened to fsync, and some filesystems refuse fsync on a directory
    (EINVAL); those are skipped, as databases do.  Other errors (EIO) are a
    :class:`CorruptStoreError`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM):
            return
        raise CorruptStoreError(f"directory {str(path)!r} cannot be opened to fsync it ({err})",
                                "check the disk and the directory") from err
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise CorruptStoreError(f"fsync of directory {str(path)!r} failed ({err})", "check the disk") from err
    finally:
        os.close(fd)


def _lock(path: Path) -> int:
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        os.close(fd)
        raise StoreLockedError(f"store {str(path)!r} is held by another writer",
                               "close the other TieredStore (or process) using it first") from err
    return fd


__all__ = ["TieredStore"]
