"""The engine under :class:`tiered_emb.TieredStore`: the store's state and the plumbing that
the torch front end, the apps and the tests use, behind one object (``store.engine``).

A user calls :class:`~tiered_emb.TieredStore`; :mod:`tiered_emb.torch`,
:mod:`tiered_emb.torchrec`, :mod:`tiered_emb.apps` and the tests call this.  Its interface
(docs/architecture.md, "The engine"):

- state: ``path``, ``tiers``, ``seed``, ``xp`` (the HBM backend), ``resolver`` (the
  tables' HBM and DDR tiers and the step's stages, :mod:`tiered_emb.step.resolve`), ``ssd``
  (the SSD tier), ``window`` and ``prefetcher`` (:mod:`tiered_emb.prefetch`), ``lock``,
  ``closed``, ``last_checkpoint_rows``;
- tables: :meth:`table` (its HBM and DDR tiers and counters), :meth:`table_config`, :meth:`check_ids`;
- the pooled step of the torch front end, as values: :meth:`plan_bags` (a batch of bags),
  :meth:`check_bags` (its ids checked against a table, once), :meth:`lookup_pooled` (the
  pooled rows and the immutable record of what was read, which the backward consumes),
  :meth:`apply_pooled_gradients`, and the backward in two halves, :meth:`gradient_update`
  and :meth:`pooled_update` (every check first, then the update), with
  :meth:`raise_failed_write`; the sums a held update keeps, :meth:`reduce_pooled` and
  :meth:`reduce_rows`;
- the prefetch thread: :meth:`bring_up`, :meth:`read_ahead`, :meth:`stepping`,
  :meth:`drain_prefetch`;
- on disk: :meth:`write_manifest`, :meth:`checkpoint_logs`, :meth:`disk_bytes`, :meth:`shut`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from tiered_emb import _directory
from tiered_emb._args import table_ids
from tiered_emb._backend import resolve_xp
from tiered_emb._version import __version__
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError, StoreClosedError
from tiered_emb.prefetch import Prefetcher, Ticket, Window
from tiered_emb.step import backward, gather, plan, reduce
from tiered_emb.step.plan import BagPlan, Forward
from tiered_emb.step.resolve import Resolver, Table
from tiered_emb.tiers import SsdTier
from tiered_emb.tiers.pool import shared_tiers


class Engine:
    """One open store's state and plumbing (see the module's docstring)."""

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
        #: the rows the last checkpoint wrote
        self.last_checkpoint_rows = 0
        #: the checkpoint's metadata the store stands on (epoch, step, learning rates)
        self.meta = meta
        self._lock_fd = lock_fd
        rates = meta.get("lr", {})  # the learning rates of the checkpoint opened (the manifest's before them)
        tables = [t.with_learning_rate(rates[t.name]) if t.name in rates else t for t in tables]
        #: The tables' HBM and DDR tiers and the step's stages over them.
        shares = shared_tiers(tables, tiers, self.xp) if tiers.shared else {}
        self.resolver = Resolver(
            {t.name: Table(t, tiers, self.xp, shares.get(t.name)) for t in tables},
            ssd,
            seed,
            self.xp,
            str(path),
            tiers.budget_bytes,
        )
        self.resolver.load_admission()  # (the counts of the checkpoint opened)
        self.resolver.step = int(meta.get("step", 0))
        for name, n in meta.get("updates", {}).items():  # (the rounding of narrow rows goes on from there)
            if name in self.resolver.tables:
                self.resolver.tables[name].updates = int(n)
        if any(t.expiry for t in self.resolver.tables.values()) and ssd.snapshots():
            ssd.checkpoints.drop_logs_from(self.resolver.step + 1)  # (the logs of steps after it)
        #: The prefetch window over this store's tables (see :mod:`tiered_emb.prefetch`).
        self.window = Window(self.resolver, tiers.policy)
        #: The prefetch thread that runs the window's jobs.
        self.prefetcher = Prefetcher(self.window)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ lifecycle
    def write_manifest(self) -> None:
        """Write ``manifest.json`` (format, seed, epoch, tables, tiers) atomically; every
        checkpoint does, and an open that moves a store to the current format."""
        _directory.write_manifest(
            self.path,
            {
                "format": _directory.FORMAT,
                "version": __version__,
                "seed": self.seed,
                "epoch": self.meta["epoch"],
                "tables": [t.cfg.to_dict() for t in self.resolver.tables.values()],
                "tiers": self.tiers.to_dict(),
            },
        )

    def shut(self) -> None:
        """Raise a failed unpinning of the prefetch thread, if any, and in any case release
        the tiers, the LMDB environment and the writer lock (the store's ``close`` checkpoints first)."""
        try:
            self.prefetcher.check()  # a failed unpinning on the thread, raised once the rows are safe
        finally:
            self.resolver.closed = True
            self.resolver.shutdown()
            self.ssd.close()
            os.close(self._lock_fd)

    @property
    def closed(self) -> bool:
        """Whether the store was closed."""
        return self.resolver.closed

    @property
    def epoch(self) -> int:
        """How many checkpoints this store has taken."""
        return int(self.meta["epoch"])

    @property
    def lock(self) -> threading.RLock:
        """The store's lock (re-entrant): every change to the tiers holds it, the prefetch
        thread's too, but for one: a pooled step whose rows are all pinned for it by the
        prefetch window reads and updates those rows without it (pinned slots are never
        victims).  Hold it to see the tiers still while you look at them."""
        return self.resolver.lock

    def check_open(self) -> None:
        """StoreClosedError once the store is closed."""
        if self.closed:
            raise StoreClosedError(f"store {str(self.path)!r} is closed", "open it again with TieredStore.open")

    # ------------------------------------------------------------------ tables
    def table(self, name: object) -> Table:
        """The HBM and DDR tiers and counters of table ``name``, to look at (change rows through
        the store); UnknownTableError with the names there are."""
        self.check_open()
        return self.resolver.table(name)

    def table_config(self, table: str) -> TableConfig:
        """The configuration of ``table``; UnknownTableError (with the names there are) if none."""
        return self.table(table).cfg

    def carry_counters(self, other: Engine) -> None:
        """Take ``other``'s step counter, its tables' updates in the step and their admission
        counts (this store holds ``other``'s rows converted: ``tiered-emb convert``)."""
        self.check_open()
        self.resolver.step = other.resolver.step
        for name, t in self.resolver.tables.items():
            src = other.resolver.tables[name]
            t.updates = src.updates
            if t.admission is not None and src.admission is not None:
                t.admission.load(src.admission.to_bytes(), f"table {name!r} of {other.path}")

    def check_ids(self, table: str, ids: ArrayLike) -> np.ndarray:
        """``ids`` of ``table`` checked (integers, 1-D, ``>= 0``, below ``num_rows``) as int64 (n,).

        Raises UnknownTableError, IdTypeError or IdRangeError; changes nothing.
        """
        t = self.table(table)
        return table_ids(t.cfg.name, ids, t.cfg.num_rows)

    def check_bags(self, table: str, bags: plan.BagPlan) -> plan.BagPlan:
        """``bags`` checked against ``table``: the plan the pooled step takes without checking
        again (a collection checks every feature before it reads any).  The same plan when it
        was checked for ``table`` already; IdRangeError / IdTypeError, nothing changed, else."""
        return plan.checked(self.table(table), bags)

    # ------------------------------------------------------------------ the pooled step
    @staticmethod
    def plan_bags(ids: Any, offsets: Any, weights: Any = None, mean: bool = False) -> plan.BagPlan:
        """A batch of bags, its shapes checked (:func:`tiered_emb.step.plan.plan_bags`); its ids
        are checked against a table by :meth:`check_bags` or the first lookup."""
        return plan.plan_bags(ids, offsets, weights, mean)

    def lookup_pooled(self, table: str, bags: plan.BagPlan, backward: bool = True) -> tuple[Any, plan.Forward]:
        """``(pooled, forward)``: the pooled rows of every bag of ``bags`` (float32 (B, dim), host
        NumPy, or a CuPy array when the HBM tier is on a GPU), and the record of what was read
        (:class:`tiered_emb.step.plan.Forward`) that its backward takes.

        Bitwise equal to pooling ``store.lookup(table, bags.ids)`` bag by bag, with no
        gathered copy (see :func:`tiered_emb.step.gather.lookup_pooled`).  ``backward=False``
        (inference) lets a table held whole in HBM skip the dedupe.
        """
        return gather.lookup_pooled(self.resolver, self.window, self.table(table), bags, backward)

    def descents_behind(self) -> contextlib.AbstractContextManager[None]:
        """A block (a forward over several tables, one after the other) in which each
        bring-up's descent runs on a helper thread while the next table is resolved
        (:mod:`tiered_emb.step.descend`): where every table has tiers of its own and no
        batch is in the prefetch window, else a block that changes nothing."""
        res = self.resolver
        own = all(not (t.hbm.owner.shape[0] or t.ddr.owner.shape[0]) for t in res.tables.values())
        return res.descents.behind(own and not self.window.tickets)

    def apply_pooled_gradients(self, table: str, step: Any, grad_out: Any, nonfinite: str = "raise") -> None:
        """The fused backward of :meth:`lookup_pooled`: the table's optimizer once per unique id.

        ``step``: the lookup's :class:`~tiered_emb.step.plan.Forward` (its rows updated in the
        slots it found), or a :class:`~tiered_emb.step.plan.BagPlan` no lookup read.
        ``grad_out``: float32 (B, dim), the gradient of the pooled output.  Bitwise equal to
        ``store.apply_gradients`` with each position's gradient row, and checked as strictly.
        """
        self.pooled_update(table, step, grad_out, nonfinite)()

    def gradient_update(self, table: str, ids: ArrayLike, grads: Any, nonfinite: str = "raise") -> Callable[[], None]:
        """``store.apply_gradients`` in two halves: every check and the reduction now (what
        it raises, it raises here, having changed nothing), the update when the returned
        callable is called (it takes the store's lock).  A backward through several tables
        checks them all before it updates any (:mod:`tiered_emb.torch`)."""
        return backward.gradient_update(self.resolver, self.table(table), ids, grads, nonfinite)

    def pooled_update(self, table: str, step: Any, grad_out: Any, nonfinite: str = "raise") -> Callable[[], None]:
        """:meth:`apply_pooled_gradients` in two halves, as :meth:`gradient_update`."""
        return backward.pooled_update(self.resolver, self.window, self.table(table), step, grad_out, nonfinite)

    def split_rows(self, table: str, step: Any, grad_out: Any, nonfinite: str = "raise") -> backward.SplitRows:
        """:meth:`pooled_update` of a row-wise Adagrad table holding some of its rows' columns
        (a column piece), in the halves that share one row state between the pieces
        (:class:`tiered_emb.step.backward.SplitRows`)."""
        return backward.SplitRows(self.resolver, self.window, self.table(table), step, grad_out, nonfinite)

    @staticmethod
    def reduce_pooled(step: Any, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(uids, summed)``: the gradient of each unique id of a batch of bags (``step`` its
        :class:`~tiered_emb.step.plan.Forward` or :class:`~tiered_emb.step.plan.BagPlan`),
        summed from ``grad_out`` (float32 (B, dim), host) in position order, as the fused
        update sums it: what a held update keeps (:class:`tiered_emb.torch.TieredOptimizer`)."""
        return step.uids, reduce.reduce_bag_grads(step, grad_out)[0]

    @staticmethod
    def reduce_rows(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(uids, summed)``: ``grads`` (float32 (n, dim), one a position of int64 ``ids``)
        summed per unique id in position order, uids in first-occurrence order (the sums
        ``apply_gradients`` makes)."""
        uids, inverse = plan.dedupe(ids)
        return uids, reduce.reduce_grads(grads, inverse, uids.shape[0])

    def raise_failed_write(self) -> None:
        """Raise the failure of an earlier write-back of evicted rows (a full disk), once, if
        there is one; its rows still wait in memory, and the next write retries them.  The
        checks of :meth:`gradient_update` end with it."""
        with self.resolver.lock:
            self.ssd.raise_failed_write()

    # ------------------------------------------------------------------ the prefetch thread
    def bring_up(self, ticket: Ticket) -> None:
        """Queue a ticket made with ``store.prefetch(..., bring_up=False)`` for the background thread (once)."""
        self.check_open()
        self.prefetcher.bring_up(ticket)

    def read_ahead(self, ticket: Ticket) -> None:
        """Queue the LMDB reads of a ticket's batch for the background thread (once).

        The thread reads the records of the batch's rows that are neither in HBM nor in
        DDR, without holding the store's lock, and keeps them in host memory beside the
        tiers until the ticket is released; the step then finds them there instead of
        waiting on LMDB.  Where rows are placed is still decided by the step, so hit
        rates are those of the step alone.
        """
        self.check_open()
        self.prefetcher.read_ahead(ticket)

    @contextmanager
    def stepping(self, ticket: Ticket) -> Iterator[None]:
        """Mark ``ticket``'s batch as the one whose step runs inside the block: a pooled step
        whose rows are all pinned for it then runs without the store's lock.

        ``ticket``: from this store's ``prefetch``, not yet released (ConfigError otherwise).
        """
        self.check_open()
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

    # ------------------------------------------------------------------ on disk
    def checkpoint_logs(self, meta: dict[str, Any]) -> tuple[dict[tuple[str, int], Any], dict[str, int]] | None:
        """The touch logs a checkpoint writes, and the step below which each table's may go:
        ``ttl_steps + 1`` before the oldest checkpoint kept once it is taken."""
        if not any(t.expiry for t in self.resolver.tables.values()):
            return None
        kept = [m for _, _, m in self.ssd.snapshots()] + [meta]
        oldest = int(kept[-max(1, self.tiers.keep_checkpoints or 1) :][0].get("step", 0))
        before = {n: oldest - t.expiry.ttl - 1 for n, t in self.resolver.tables.items() if t.expiry}
        return self.resolver.take_logs(), before

    def disk_bytes(self) -> int:
        """Bytes of the LMDB files on disk."""
        with self.resolver.lock:
            self.check_open()
            return self.ssd.file_bytes()


__all__ = ["BagPlan", "Engine", "Forward"]
