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
(:mod:`tiered_emb.tiers`) the rows and the checkpoints.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike

from tiered_emb import _directory, _opening
from tiered_emb._args import extra_bytes, table_ids, table_rows
from tiered_emb._backend import resolve_xp, to_xp
from tiered_emb._version import __version__
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError, NonFiniteGradientError, StoreClosedError
from tiered_emb.prefetch import Prefetcher, Ticket, Window
from tiered_emb.reader import StoreReader
from tiered_emb.step import backward, gather, plan, reduce
from tiered_emb.step.resolve import Resolver, Table
from tiered_emb.tiers import SsdTier


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
    def __init__(
        self,
        path: Path,
        tables: list[TableConfig],
        tiers: TierConfig,
        seed: int,
        lock_fd: int,
        ssd: SsdTier,
        meta: dict[str, Any],
    ):
        self.path = path
        self.tiers = tiers
        self.seed = seed
        self.xp = resolve_xp(tiers.device)
        #: The SSD tier (LMDB): its public methods report and tune what is on disk.
        self.ssd = ssd
        #: the rows the last :meth:`checkpoint` wrote
        self.last_checkpoint_rows = 0
        self._lock_fd = lock_fd
        self._meta = meta
        rates = meta.get("lr", {})  # the learning rates of the checkpoint opened (the manifest's before them)
        tables = [t.with_learning_rate(rates[t.name]) if t.name in rates else t for t in tables]
        self._res = Resolver(
            {t.name: Table(t, tiers, self.xp) for t in tables}, ssd, seed, self.xp, str(path), tiers.budget_bytes
        )
        self._res.load_admission()  # (the counts of the checkpoint opened)
        self._res.step = int(meta.get("step", 0))
        if any(t.expiry for t in self._res.tables.values()) and ssd.snapshots():
            ssd.checkpoints.drop_logs_from(self._res.step + 1)  # (the logs of steps after it)
        #: The prefetch window over this store's tables (see :mod:`tiered_emb.prefetch`).
        self.window = Window(self._res, tiers.policy)
        #: The prefetch thread that runs the window's jobs.
        self.prefetcher = Prefetcher(self.window)  # type: ignore[no-untyped-call]

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
        store: TieredStore = _opening.create(cls, path, tables, tiers, seed)
        return store

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
        store: TieredStore = _opening.open_writer(cls, path, tiers, restore, snapshot)
        return store

    def write_manifest(self) -> None:
        """Write ``manifest.json`` (format, seed, epoch, tables, tiers) atomically; every
        checkpoint does, and an open that moves a store to the current format."""
        _directory.write_manifest(
            self.path,
            {
                "format": _directory.FORMAT,
                "version": __version__,
                "seed": self.seed,
                "epoch": self._meta["epoch"],
                "tables": [t.cfg.to_dict() for t in self._res.tables.values()],
                "tiers": self.tiers.to_dict(),
            },
        )

    def close(self, checkpoint: bool = True, extra: bytes | None = None) -> None:
        """Checkpoint, then release the LMDB environment and the writer lock (idempotent).

        If the checkpoint fails (``StoreFullError``: the disk is full) the store stays open
        with every row it holds, so nothing is lost: free space and call ``close()`` again.

        ``extra`` is saved with that checkpoint (:meth:`checkpoint`, :attr:`extra`).
        ``checkpoint=False`` closes without one, giving up every change since the last, as
        after a crash: for a trainer whose step failed midway, its state saved with that one.
        """
        if self.closed:
            return
        extra_bytes(extra)
        if extra is not None and not checkpoint:
            raise ConfigError(
                "close(checkpoint=False, extra=...) would not save extra",
                "pass extra with checkpoint=True, or leave it out",
            )
        self.prefetcher.close()
        if checkpoint:
            self.checkpoint(extra)
        try:
            self.prefetcher.check()  # a failed unpinning on the thread, raised once the rows are safe
        finally:
            self._res.closed = True
            self._res.shutdown()
            self.ssd.close()
            os.close(self._lock_fd)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._res.closed

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
        self._check_open()
        return self.ssd.read_extra()

    @property
    def epoch(self) -> int:
        """How many checkpoints this store has taken."""
        return int(self._meta["epoch"])

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"store {str(self.path)!r} is closed", "open it again with TieredStore.open")

    def _table(self, name: object) -> Table:
        self._check_open()
        return self._res.table(name)

    def table_config(self, table: str) -> TableConfig:
        """The configuration of ``table``; UnknownTableError (with the names there are) if none."""
        return self._table(table).cfg

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
            self._check_open()
            names = sorted(self._res.tables) if table is None else [self._table(table).cfg.name]
            configs = {n: self._res.tables[n].cfg.with_learning_rate(lr) for n in names}  # every one checked first
            for n, cfg in configs.items():
                self._res.tables[n].cfg = cfg

    def tiers_of(self, table: str) -> Table:
        """The HBM and DDR tiers and counters of ``table``, to look at (change rows through the store)."""
        return self._table(table)

    @property
    def lock(self) -> threading.RLock:
        """The store's lock (re-entrant): every change to the tiers holds it, the prefetch
        thread's too, but for one: a pooled step whose rows are all pinned for it by the
        prefetch window reads and updates those rows without it (pinned slots are never
        victims).  Hold it to see the tiers still while you look at them."""
        return self._res.lock

    def check_bags(self, table: str, bags: plan.BagPlan) -> None:
        """Check the ids of ``bags`` against ``table`` now (a collection checks every feature
        before it reads any); :meth:`lookup_pooled` then does not check them again."""
        t = self._table(table)
        table_ids(table, bags.ids, t.cfg.num_rows)
        bags.checked = t

    def check_ids(self, table: str, ids: ArrayLike) -> np.ndarray:
        """``ids`` of ``table`` checked (integers, 1-D, ``>= 0``, below ``num_rows``) as int64 (n,).

        Raises UnknownTableError, IdTypeError or IdRangeError; changes nothing.
        """
        t = self._table(table)
        return table_ids(t.cfg.name, ids, t.cfg.num_rows)

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
            t = self._table(table)
            uids, inverse = plan.dedupe(table_ids(table, ids, t.cfg.num_rows))
            if admit:
                return gather.gather(self._res, t, uids, inverse)
            return to_xp(self.xp, self._res.read_through(t, uids, inverse, t.cfg.dim, t.counters))

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
            self.gradient_update(table, ids, grads, nonfinite)()

    def gradient_update(self, table: str, ids: ArrayLike, grads: Any, nonfinite: str = "raise") -> Callable[[], None]:
        """:meth:`apply_gradients` in two halves: every check and the reduction now (what it
        raises, it raises here, having changed nothing), the update when the returned
        callable is called (it takes the store's lock).  A backward through several tables
        checks them all before it updates any (:mod:`tiered_emb.torch`)."""
        return backward.gradient_update(self._res, self._table(table), ids, grads, nonfinite)

    def raise_failed_write(self) -> None:
        """Raise the failure of an earlier write-back of evicted rows (a full disk), once, if
        there is one; its rows still wait in memory, and the next write retries them.  The
        checks of :meth:`gradient_update` end with it."""
        with self._res.lock:
            self.ssd.raise_failed_write()

    def write(self, table: str, ids: ArrayLike, rows: Any) -> None:
        """Set the weights of ``ids`` (optimizer state kept); for duplicates the last row wins.

        ``rows``: float32 (n, dim), finite.
        """
        with self._res.lock:
            t = self._table(table)
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
        self._check_open()
        self.prefetcher.drain()
        with self._res.lock:
            t = self._table(table)
            uids = plan.dedupe(table_ids(table, ids, t.cfg.num_rows))[0]
            self.ssd.raise_failed_write()
            if uids.shape[0]:
                self._res.delete(t, uids)

    def peek(self, table: str, ids: ArrayLike, with_state: bool = False) -> np.ndarray:
        """Newest values of ``ids`` as NumPy, without touching any cache state.

        Returns float32 (n, dim), or (n, dim + state_width) records with ``with_state``.
        """
        with self._res.lock:
            t = self._table(table)
            uids, inverse = plan.dedupe(table_ids(table, ids, t.cfg.num_rows))  # the LMDB read takes distinct ids
            return self._res.read_through(t, uids, inverse, t.cfg.record_width if with_state else t.cfg.dim)

    def lookup_pooled(self, table: str, bags: plan.BagPlan, backward: bool = True) -> Any:
        """Pooled rows of every bag of ``bags`` (:func:`tiered_emb.step.plan.plan_bags`): float32 (B, dim),
        host NumPy, or a CuPy array when the HBM tier is on a GPU.

        Bitwise equal to pooling ``lookup(table, bags.ids)`` bag by bag, with no gathered
        copy (see :func:`tiered_emb.step.gather.lookup_pooled`).  ``backward=False``
        (inference) lets a table held whole in HBM skip the dedupe.
        """
        return gather.lookup_pooled(self._res, self.window, self._table(table), bags, backward)

    def apply_pooled_gradients(self, table: str, bags: plan.BagPlan, grad_out: Any, nonfinite: str = "raise") -> None:
        """The fused backward of :meth:`lookup_pooled`: the table's optimizer once per unique id.

        ``grad_out``: float32 (B, dim), the gradient of the pooled output.  Bitwise equal to
        :meth:`apply_gradients` with each position's gradient row, and checked as strictly.
        """
        self.pooled_update(table, bags, grad_out, nonfinite)()

    def pooled_update(
        self, table: str, bags: plan.BagPlan, grad_out: Any, nonfinite: str = "raise"
    ) -> Callable[[], None]:
        """:meth:`apply_pooled_gradients` in two halves, as :meth:`gradient_update`."""
        return backward.pooled_update(self._res, self.window, self._table(table), bags, grad_out, nonfinite)

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
        self._check_open()
        if not isinstance(batch, dict):
            raise ConfigError(f"batch of type {type(batch).__name__} is invalid", "pass {table name: ids}")
        for name in batch:
            self._table(name)  # (a name that is not a table's, an int say, before sorting them)
        handed = {}
        for name in sorted(batch):  # checked here, deduped by the thread
            # a copy: the step is matched to its ticket by these ids
            handed[name] = np.array(self.check_ids(name, batch[name]), copy=True)
        return self.prefetcher.submit(handed, queue=bring_up)

    def bring_up(self, ticket: Ticket) -> None:
        """Queue a ticket made with ``prefetch(..., bring_up=False)`` for the background thread (once)."""
        self._check_open()
        self.prefetcher.bring_up(ticket)

    def read_ahead(self, ticket: Ticket) -> None:
        """Queue the LMDB reads of a ticket's batch for the background thread (once).

        The thread reads the records of the batch's rows that are neither in HBM nor in
        DDR, without holding the store's lock, and keeps them in host memory beside the
        tiers until the ticket is released; the step then finds them there instead of
        waiting on LMDB.  Where rows are placed is still decided by the step, so hit
        rates are those of the step alone.
        """
        self._check_open()
        self.prefetcher.read_ahead(ticket)

    def release(self, ticket: Ticket, check: bool = True) -> None:
        """Unpin a prefetched batch (after its update): queued on the background thread, after
        what it was given of the batch; raises its PrefetchError if bringing it up failed.
        The rows stay pinned until the thread gets there (:meth:`flush`, :meth:`checkpoint`
        and :meth:`close` wait for it)."""
        self._check_open()
        self.prefetcher.release(ticket, check)

    @contextmanager
    def stepping(self, ticket: Ticket) -> Iterator[None]:
        """Mark ``ticket``'s batch as the one whose step runs inside the block: a pooled step
        whose rows are all pinned for it then runs without the store's lock.

        ``ticket``: from this store's :meth:`prefetch`, not yet released (ConfigError otherwise).
        """
        self._check_open()
        self.prefetcher.check_own(ticket)
        if ticket.released:
            raise ConfigError(f"ticket {ticket.seq} is released", "step a batch before releasing its ticket")
        self.window.stepping = ticket
        try:
            yield
        finally:
            self.window.stepping = None

    def drain_prefetch(self) -> None:
        """Wait until the prefetch thread has done every job it was given (bring-ups, unpinnings)."""
        self.prefetcher.drain()

    # ------------------------------------------------------------------ durability
    def flush(self) -> int:
        """Write every dirty row to LMDB (durable; not a checkpoint). Returns rows written."""
        self._check_open()
        self.prefetcher.drain()
        with self._res.lock:
            counts: dict[str, int] = {}
            n = self.ssd.write_pending(self._res.dirty_chunks(counts))
            self._res.written(counts)
            return n

    def checkpoint(self, extra: bytes | None = None) -> int:
        """Flush and make this instant the store's durable point, atomically.

        After it returns, a crash at any instant loses nothing up to here, and
        :meth:`open` restores it bitwise.  ``extra`` (bytes, e.g. a trainer's step and
        dense weights) is saved in the same transaction; read it back as :attr:`extra`.
        Returns the checkpoint's number (its :attr:`epoch`); the rows it wrote are
        :attr:`last_checkpoint_rows`.
        """
        self._check_open()
        extra_bytes(extra)
        self.prefetcher.drain()
        with self._res.lock:
            counts: dict[str, int] = {}
            rates = {n: t.cfg.optimizer.lr for n, t in sorted(self._res.tables.items())}
            meta = dict(self._meta, epoch=self.epoch + 1, lr=rates)
            meta["step"] = self._res.step
            blobs, logs = self._res.admission_blobs(), self._checkpoint_logs(meta)
            try:
                self.last_checkpoint_rows = self.ssd.checkpoint(
                    self._res.dirty_chunks(counts), meta, extra, blobs, logs
                )
            except BaseException:
                self._res.hold_logs(logs)  # (kept for the next checkpoint)
                raise
            self._meta = meta
            self._res.written(counts)
            self.write_manifest()
            return self.epoch

    def _checkpoint_logs(self, meta: dict[str, Any]) -> tuple[dict[tuple[str, int], Any], dict[str, int]] | None:
        """The touch logs a checkpoint writes, and the step below which each table's may go:
        ``ttl_steps + 1`` before the oldest checkpoint kept once it is taken."""
        if not any(t.expiry for t in self._res.tables.values()):
            return None
        kept = [m for _, _, m in self.ssd.snapshots()] + [meta]
        oldest = int(kept[-max(1, self.tiers.keep_checkpoints or 1) :][0].get("step", 0))
        before = {n: oldest - t.expiry.ttl - 1 for n, t in self._res.tables.items() if t.expiry}
        return self._res.take_logs(), before

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
            self._check_open()
            self._res.advance()
            return self._res.step

    def snapshots(self) -> list[int]:
        """The numbers of the checkpoints this store keeps (``TierConfig.keep_checkpoints``),
        oldest first: each opens bitwise with ``open(path, snapshot=n)``."""
        with self._res.lock:
            self._check_open()
            return [epoch for epoch, _, _ in self.ssd.snapshots()]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, dict[str, Any]]:
        """Per table and tier: lookups, hits, misses, evictions, writebacks, rows and bytes held.

        ``lookups`` of a tier count the unique ids asked of it; ``ssd.misses`` are rows
        created by the initialiser (never written); ``ssd.rows`` counts LMDB records.
        The step's traffic is at the top level; what the prefetch thread moved is under
        ``"prefetch"`` (same keys), so the step's HBM hit rate shows what prefetch won.
        """
        with self._res.lock:
            self._check_open()
            return {name: t.stats(self.ssd.table_stats(name)) for name, t in sorted(self._res.tables.items())}

    def verify(self) -> dict[str, Any]:
        """Check every byte the SSD tier holds, a segment at a time (memory: one segment).

        Returns ``{"segments", "rows", "records", "damaged"}``: what was checked, and a list
        with each damaged segment or record (its table, segment number, ids, offset in
        ``data.mdb`` and what is wrong).  Rows in HBM and DDR are not read from disk."""
        with self._res.lock:
            self._check_open()
            return self.ssd.verify()

    def disk_bytes(self) -> int:
        """Bytes of the LMDB files on disk."""
        with self._res.lock:
            self._check_open()
            return self.ssd.file_bytes()


__all__ = ["TieredStore"]
