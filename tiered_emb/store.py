"""TieredStore: one directory holding several embedding tables across HBM, DDR and LMDB.

The facade: each public method is a few calls into the stages of a step, read in the
order a batch uses them (docs/architecture.md):

``lookup`` / ``apply_gradients`` / ``write``
  -> :mod:`tiered_emb._args`        ids and rows checked
  -> :mod:`tiered_emb.step.plan`    dedupe (first-occurrence order)
  -> :mod:`tiered_emb.step.resolve` per chunk of at most the HBM capacity: HBM probe, misses
                                    up (DDR -> LMDB -> lazy init), victims down; pinned slots
  -> :mod:`tiered_emb.step.gather`  rows (or pooled bags) out of the slots
  -> :mod:`tiered_emb.step.reduce`, :mod:`tiered_emb.step.update`  the backward

Ahead of the step, :mod:`tiered_emb.prefetch` keeps the window of the next batches;
on disk, :mod:`tiered_emb._directory` keeps the manifest and the lock, and the SSD tier
(:mod:`tiered_emb.tiers`) the rows and the checkpoints.  The state, and the plumbing the
torch front end, the apps and the tests use, are the engine's (:mod:`tiered_emb.engine`,
``store.engine``); this class holds what a user calls.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike

from tiered_emb import _opening
from tiered_emb._args import extra_bytes, table_ids, table_rows
from tiered_emb._backend import to_xp
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.engine import Engine
from tiered_emb.errors import ConfigError, NonFiniteGradientError
from tiered_emb.prefetch import Ticket
from tiered_emb.reader import StoreReader
from tiered_emb.step import gather, plan, reduce
from tiered_emb.step.dirty import dirty_chunks, written


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
    def __init__(self, engine: Engine):
        #: The store's state and plumbing (:mod:`tiered_emb.engine`): what the torch front
        #: end, the apps and the tests use beside this class's methods.
        self.engine = engine
        self._res = engine.resolver

    @classmethod
    def create(
        cls, path: str | os.PathLike[str], tables: Iterable[TableConfig], tiers: TierConfig, seed: int = 0
    ) -> TieredStore:
        """Create a new store directory at ``path`` (which must not exist).

        Parameters
        ----------
        path : str or Path
        tables : list of TableConfig (distinct names)
        tiers : TierConfig
        seed : int, 0 <= seed < 2**64; with the table name and id it fixes every initial row
        """
        return cls(_opening.create(path, tables, tiers, seed))

    @overload
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        tiers: TierConfig | None = None,
        restore: str = "checkpoint",
        mode: Literal["w"] = "w",
        snapshot: int | None = None,
    ) -> TieredStore: ...

    @overload
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        tiers: None = None,
        restore: str = "checkpoint",
        *,
        mode: Literal["r"],
        snapshot: int | None = None,
    ) -> StoreReader: ...

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        tiers: TierConfig | None = None,
        restore: str = "checkpoint",
        mode: str = "w",
        snapshot: int | None = None,
    ) -> TieredStore | StoreReader:
        """Open an existing store.

        Parameters
        ----------
        mode : ``"w"`` (default) or ``"r"``
            ``"w"``: as its one writer (the store's lock is taken).  ``"r"``: as a reader
            beside the writer, at its last checkpoint (:class:`~tiered_emb.reader.StoreReader`;
            no lock, any number of them; ``tiers`` and ``restore`` do not apply).
        tiers : TierConfig, optional
            New tier sizes / policy / device; the stored ones by default.
        restore : ``"checkpoint"`` (default) or ``"latest"``
            What to find after a crash: the last checkpoint, or also every row flushed
            since and the write-backs of evicted rows that had reached LMDB (they go out
            in groups of ``writeback_rows``; see docs/architecture.md).
        snapshot : int, optional
            A kept checkpoint's number (:meth:`snapshots`) to open at instead of the last:
            a writer restarts the run from it (the later checkpoints are dropped), a reader
            just reads it.
        """
        if mode != "w":
            return StoreReader.opened(path, mode, tiers, restore, snapshot)
        return cls(_opening.open_writer(path, tiers, restore, snapshot))

    def close(self, checkpoint: bool = True, extra: bytes | None = None) -> None:
        """Checkpoint, then release the LMDB environment and the writer lock (idempotent).

        If the checkpoint fails (``StoreFullError``: the disk is full) the store stays open
        with every row it holds, so nothing is lost: free space and call ``close()`` again.

        ``extra`` is saved with that checkpoint (:meth:`checkpoint`, :attr:`extra`).
        ``checkpoint=False`` closes without one, giving up every change since the last, as
        after a crash: for a trainer whose step failed midway, its state saved with that one.
        """
        if self.engine.closed:
            return
        extra_bytes(extra)
        if extra is not None and not checkpoint:
            raise ConfigError(
                "close(checkpoint=False, extra=...) would not save extra",
                "pass extra with checkpoint=True, or leave it out",
            )
        self.engine.prefetcher.close()
        if checkpoint:
            self.checkpoint(extra)
        self.engine.shut()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tables(self) -> dict[str, TableConfig]:
        """The store's tables by name (a new dict)."""
        return {n: t.cfg for n, t in self._res.tables.items()}

    @property
    def extra(self) -> bytes | None:
        """The ``extra`` bytes last saved with a checkpoint (``checkpoint(extra=...)`` or
        ``close(extra=...)``; e.g. a trainer's state), or None.  A checkpoint without
        ``extra`` keeps them as they were, so after ``checkpoint(extra=state)``, more steps
        and a plain ``close()`` they are older than the rows: pass the state to ``close`` too."""
        self.engine.check_open()
        return self.engine.ssd.read_extra()

    @property
    def epoch(self) -> int:
        """How many checkpoints this store has taken."""
        return self.engine.epoch

    def set_learning_rate(self, table: str | None, lr: float) -> None:
        """Set the learning rate of ``table`` (of every table when None) for the updates from now on.

        Call it between steps, or let a torch ``lr_scheduler`` drive it (``TieredOptimizer``).
        Each checkpoint keeps the rate and :meth:`open` restores it, so a resumed schedule
        goes on bitwise.  ``table_config(table).optimizer.lr`` reads it.

        ``lr``: a finite number >= 0 (ConfigError, nothing changed, for a negative or NaN one,
        or one that decoupled weight decay cannot take); UnknownTableError for a table that
        is not the store's.
        """
        with self._res.lock:
            self.engine.check_open()
            names = sorted(self._res.tables) if table is None else [self.engine.table(table).cfg.name]
            configs = {n: self._res.tables[n].cfg.with_learning_rate(lr) for n in names}  # every one checked first
            for n, cfg in configs.items():
                self._res.tables[n].cfg = cfg

    # ------------------------------------------------------------------ the step
    def lookup(self, table: str, ids: ArrayLike, admit: bool = True) -> Any:
        """Newest rows of ``ids``, duplicates allowed.

        Parameters
        ----------
        table : str
        ids : int array (n,), >= 0 and below ``num_rows`` when it is set
        admit : bool
            False: each row is read where it is (HBM, DDR, LMDB, the initialiser) and no row
            moves, the caches as they were: a lookup no update follows (evaluation, serving).

        Returns
        -------
        float32 array (n, dim) on the HBM backend (``store.xp``).
        """
        with self._res.lock:
            t = self.engine.table(table)
            uids, inverse = plan.dedupe(table_ids(table, ids, t.cfg.num_rows))
            if admit:
                return gather.gather(self._res, t, uids, inverse)
            return to_xp(self.engine.xp, self._res.read_through(t, uids, inverse, t.cfg.dim, t.counters))

    def apply_gradients(self, table: str, ids: ArrayLike, grads: Any, nonfinite: str = "raise") -> None:
        """Apply the table's optimizer: duplicate ids' gradients summed in batch order, one update per row.

        Parameters
        ----------
        ids : int array (n,)
        grads : float32 array (n, dim), host or HBM backend
        nonfinite : ``"raise"`` (NonFiniteGradientError, nothing changes), ``"skip"`` (rows
            whose summed gradient is not finite are left alone) or ``"zero"`` (treated as 0)
        """
        with self._res.lock:
            self.engine.gradient_update(table, ids, grads, nonfinite)()

    def write(self, table: str, ids: ArrayLike, rows: Any) -> None:
        """Set the weights of ``ids`` (optimizer state kept); for duplicates the last row wins.

        ``rows``: float32 (n, dim), finite; a table of a narrower ``dtype`` rounds them to
        nearest (:mod:`tiered_emb.precision`).
        """
        with self._res.lock:
            t = self.engine.table(table)
            ids = table_ids(table, ids, t.cfg.num_rows)
            r = table_rows(table, rows, ids.shape[0], t.cfg.dim, "rows")
            if not reduce.all_finite(r):
                raise NonFiniteGradientError(f"rows written to table {table!r} hold NaN/inf", "write finite values")
            if ids.shape[0] == 0:
                return
            uids, inverse = plan.dedupe(ids)
            # each id's last row (no id repeated: every row, in place; each tier copies what it keeps)
            rows_u = r if uids.shape[0] == ids.shape[0] else r[plan.last_occurrence(inverse, uids.shape[0])]
            self._res.write(t, uids, rows_u)

    def delete(self, table: str, ids: ArrayLike) -> None:
        """Delete the rows of ``ids`` (weights and optimizer state): from now on each reads as
        its initial value, as an id never written, until written or updated again.

        Durable at the next :meth:`checkpoint` (a tombstone in the segment log; a crash before
        it brings the rows back, as it does any change since).  ``open(snapshot=n)`` of a
        checkpoint from before the delete brings them back: compaction keeps what a kept
        checkpoint reads.  See docs/durability.md for when the bytes leave the files.
        UnknownTableError, IdTypeError, IdRangeError or ConfigError (an id pinned by a
        prefetched batch), each with nothing changed.
        """
        self.engine.check_open()
        self.engine.prefetcher.drain()
        with self._res.lock:
            t = self.engine.table(table)
            uids = plan.dedupe(table_ids(table, ids, t.cfg.num_rows))[0]
            self.engine.ssd.raise_failed_write()
            if uids.shape[0]:
                self._res.delete(t, uids)

    def peek(self, table: str, ids: ArrayLike, with_state: bool = False) -> np.ndarray:
        """Newest values of ``ids`` as NumPy, without touching any cache state.

        Returns float32 (n, dim), or (n, dim + state_width) records with ``with_state``
        (weights decoded from the table's ``dtype``, every value exactly as held).
        """
        with self._res.lock:
            t = self.engine.table(table)
            uids, inverse = plan.dedupe(table_ids(table, ids, t.cfg.num_rows))  # the LMDB read takes distinct ids
            return self._res.read_through(t, uids, inverse, t.cfg.value_width if with_state else t.cfg.dim)

    # ------------------------------------------------------------------ lookahead
    def prefetch(self, batch: dict[str, ArrayLike], bring_up: bool = True) -> Ticket:
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
        self.engine.check_open()
        if not isinstance(batch, dict):
            raise ConfigError(f"batch of type {type(batch).__name__} is invalid", "pass {table name: ids}")
        for name in batch:
            self.engine.table(name)  # (a name that is not a table's, an int say, before sorting them)
        handed = {}
        for name in sorted(batch):  # checked here, deduped by the thread
            # a copy: the step is matched to its ticket by these ids
            handed[name] = np.array(self.engine.check_ids(name, batch[name]), copy=True)
        return self.engine.prefetcher.submit(handed, queue=bring_up)

    def release(self, ticket: Ticket, check: bool = True) -> None:
        """Unpin a prefetched batch (after its update): queued on the background thread, after
        what it was given of the batch; raises its PrefetchError if bringing it up failed.
        The rows stay pinned until the thread gets there (:meth:`flush`, :meth:`checkpoint`
        and :meth:`close` wait for it)."""
        self.engine.check_open()
        self.engine.prefetcher.release(ticket, check)

    # ------------------------------------------------------------------ durability
    def flush(self) -> int:
        """Write every dirty row to LMDB (durable; not a checkpoint). Returns rows written."""
        self.engine.check_open()
        self.engine.prefetcher.drain()
        with self._res.lock:
            counts: dict[str, int] = {}
            n = self.engine.ssd.write_pending(dirty_chunks(self._res, counts))
            written(self._res, counts)
            return n

    def checkpoint(self, extra: bytes | None = None) -> int:
        """Flush and make this instant the store's durable point, atomically.

        After it returns, a crash at any instant loses nothing up to here, and
        :meth:`open` restores it bitwise.  ``extra`` (bytes, e.g. a trainer's step and
        dense weights) is saved in the same transaction; read it back as :attr:`extra`.
        Returns the checkpoint's number (its :attr:`epoch`); the rows it wrote are
        ``engine.last_checkpoint_rows``.
        """
        self.engine.check_open()
        extra_bytes(extra)
        self.engine.prefetcher.drain()
        with self._res.lock:
            counts: dict[str, int] = {}
            rates = {n: t.cfg.optimizer.lr for n, t in sorted(self._res.tables.items())}
            meta = dict(self.engine.meta, epoch=self.epoch + 1, lr=rates)
            meta["step"] = self._res.step
            meta["updates"] = {n: t.updates for n, t in sorted(self._res.tables.items()) if t.updates}
            blobs, logs = self._res.admission_blobs(), self.engine.checkpoint_logs(meta)
            try:
                self.engine.last_checkpoint_rows = self.engine.ssd.checkpoint(
                    dirty_chunks(self._res, counts), meta, extra, blobs, logs
                )
            except BaseException:
                self._res.hold_logs(logs)  # (kept for the next checkpoint)
                raise
            self.engine.meta = meta
            written(self._res, counts)
            self.engine.write_manifest()
            return self.epoch

    @property
    def step(self) -> int:
        """The store's step counter: :meth:`advance_step` moves it on, each checkpoint keeps it."""
        return self._res.step

    def advance_step(self) -> int:
        """End a training step: the step counter moves on by one, and the rows of tables with
        ``ttl_steps`` that no update touched for more than that many steps are deleted
        (:mod:`tiered_emb.expiry`).  ``TieredOptimizer.step()`` and ``TrainPipeline`` call it;
        a loop of its own over ``apply_gradients`` calls it once a step.  Returns the new step."""
        with self._res.lock:  # (the prefetch thread's moves give the same rows before or after)
            self.engine.check_open()
            self._res.advance()
            return self._res.step

    def snapshots(self) -> list[int]:
        """The numbers of the checkpoints this store keeps (``TierConfig.keep_checkpoints``),
        oldest first: each opens bitwise with ``open(path, snapshot=n)``."""
        with self._res.lock:
            self.engine.check_open()
            return [epoch for epoch, _, _ in self.engine.ssd.snapshots()]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, dict[str, Any]]:
        """Per table and tier: lookups, hits, misses, evictions, writebacks, rows and bytes held.

        ``lookups`` of a tier count the unique ids asked of it; ``ssd.misses`` are rows
        created by the initialiser (never written); ``ssd.rows`` counts LMDB records.
        The step's traffic is at the top level; what the prefetch thread moved is under
        ``"prefetch"`` (same keys), so the step's HBM hit rate shows what prefetch won.
        """
        with self._res.lock:
            self.engine.check_open()
            return {name: t.stats(self.engine.ssd.table_stats(name)) for name, t in sorted(self._res.tables.items())}

    def verify(self) -> dict[str, Any]:
        """Check every byte the SSD tier holds, a segment at a time (memory: one segment).

        Returns ``{"segments", "rows", "records", "damaged"}``: what was checked, and a list
        with each damaged segment or record (its table, segment number, ids, offset in
        ``data.mdb`` and what is wrong).  Rows in HBM and DDR are not read from disk."""
        with self._res.lock:
            self.engine.check_open()
            return self.engine.ssd.verify()


__all__ = ["TieredStore"]
