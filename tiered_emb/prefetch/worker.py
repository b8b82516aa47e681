"""The prefetch thread: one per store, it runs the window's jobs in the order they are queued.

Jobs are a batch entering the window, its rows brought up, its LMDB records read ahead,
and its pins released after its step (:class:`~tiered_emb.prefetch.window.Window`).  An
exception on the thread is kept in its ticket and raised as
:class:`~tiered_emb.errors.PrefetchError` by ``Ticket.wait`` / ``release`` (the step
that needs those rows); ``close`` joins the thread.
"""

from __future__ import annotations

import queue
import sys
import threading

import numba
import numpy as np

from tiered_emb.errors import ConfigError, PrefetchError
from tiered_emb.prefetch.ticket import Ticket

_STOP = object()
# How often a wait on the thread looks whether the thread can still answer it.
_POLL_S = 0.05


class Prefetcher:
    """The background thread of one store (started on the first ticket, joined by :meth:`close`)."""

    def __init__(self, window):
        self._window = window
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._outstanding: list[Ticket] = []
        self._releasing: list[Ticket] = []  # released, their unpinning queued
        self._unpin_error: BaseException | None = None  # the thread's first failed unpinning, until raised
        self._unpin_error_lock = threading.Lock()  # the thread sets it while the step may take it

    def submit(self, batch: dict[str, np.ndarray], queue: bool = True) -> Ticket:
        """A batch entering the window (``{table: ids}``, checked).

        The thread pins its resident rows first (:meth:`Window.enter`), then,
        with ``queue``, brings up the rest; otherwise :meth:`bring_up` queues that later.
        """
        ticket = Ticket(self._seq, batch)
        ticket.owner = self
        self._seq += 1
        self._outstanding.append(ticket)
        self._put(ticket.entered_event, self._window.enter, ticket)
        if queue:
            self.bring_up(ticket)
        return ticket

    @property
    def outstanding(self) -> list[Ticket]:
        """The tickets submitted and not yet released, oldest first."""
        return list(self._outstanding)

    def bring_up(self, ticket: Ticket) -> None:
        """Queue ``ticket`` for the thread (tickets are brought up in the order they are queued)."""
        self.check_own(ticket)
        if ticket.queued or ticket.released:
            return
        ticket.queued = True
        self._put(ticket.up_event, self._window.bring_up, ticket)

    def read_ahead(self, ticket: Ticket) -> None:
        """Queue ``ticket``'s LMDB reads for the thread (rows staged in host memory, tiers untouched)."""
        self.check_own(ticket)
        if ticket.staged or ticket.released:
            return
        ticket.staged = True
        self._put(ticket.read_event, self._window.stage, ticket)

    def check_own(self, ticket) -> None:
        """ConfigError, before anything changes, unless ``ticket`` came from this store's prefetch()."""
        if getattr(ticket, "owner", None) is not self:
            what = "a ticket of another store" if isinstance(ticket, Ticket) else f"a {type(ticket).__name__}"
            raise ConfigError(
                f"{what} was given to this store", "pass the Ticket this store's prefetch() returned, to the same store"
            )

    def _put(self, event, job, ticket) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiered_emb-prefetch", daemon=True)
            self._thread.start()
        self._queue.put((event, job, ticket))

    def _run(self) -> None:
        # Numba's thread count is per calling thread.  One here: a parallel kernel on this
        # thread would start an OpenMP team of its own, whose idle workers spin on the
        # cores the step is using.
        numba.set_num_threads(1)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            event, job, ticket = item
            try:
                job(ticket)
            except BaseException as err:  # kept for the step that needs the rows
                ticket.error = err
            finally:
                event.set()

    def release(self, ticket: Ticket, check: bool = True) -> None:
        """Queue the unpinning of the ticket's rows (after what the thread was given of it);
        raises its error, if any, then (with ``check``) a failed earlier unpinning (:meth:`check`).

        The thread unpins them in order with its other work, so the step never waits for
        the store's lock here; :meth:`drain` waits for it.
        """
        self.check_own(ticket)
        if ticket.released:
            return
        ticket.settle()
        ticket.released = True
        self._outstanding.remove(ticket)
        self._releasing = [t for t in self._releasing if not t.unpinned_event.is_set()] + [ticket]
        self._put(ticket.unpinned_event, self._unpin, ticket)
        ticket.wait()
        if check:
            self.check()

    def _unpin(self, ticket: Ticket) -> None:
        """Thread side of :meth:`release`: a failure is kept for :meth:`check` (the ticket's
        step is over; no step waits on this job)."""
        try:
            self._window.unpin(ticket)
        except BaseException as err:
            self._keep(err)

    def _keep(self, err: BaseException) -> None:
        """Keep a failed unpinning for :meth:`check` (the first one, if several)."""
        with self._unpin_error_lock:
            if self._unpin_error is None:
                self._unpin_error = err

    def check(self) -> None:
        """Raise, once, a failure of the thread to unpin a released batch: the next release
        (the next step) raises it, or :meth:`TieredStore.close` after its checkpoint."""
        with self._unpin_error_lock:
            err, self._unpin_error = self._unpin_error, None
        if err is not None:
            raise PrefetchError(
                f"unpinning a released batch's rows failed: {type(err).__name__}: {err}",
                "its rows may stay pinned, leaving HBM fewer slots; values are unaffected. "
                "Checkpoint, close and reopen the store",
            ) from err

    def await_event(self, event: threading.Event) -> None:
        """Wait for ``event``, which the thread sets.  PrefetchError at once when the thread can
        no longer set it: the interpreter is exiting (its daemon threads run no more) or the
        thread has stopped.  So a training loop that crashed exits instead of waiting forever."""
        while not event.wait(_POLL_S):
            if sys.is_finalizing() or self._thread is None or not self._thread.is_alive():
                if event.is_set():
                    return
                raise PrefetchError(
                    "the prefetch thread no longer runs (the process is exiting, or the store was closed)",
                    "nothing was lost: a store's rows are safe up to its last checkpoint",
                )

    def drain(self) -> None:
        """Wait until every submitted ticket has been brought up (or failed) and every released one unpinned."""
        for t in list(self._outstanding):
            t.settle()
        for t in self._releasing:
            self.await_event(t.unpinned_event)
        self._releasing.clear()

    def close(self) -> None:
        """Drain, unpin what is still pinned, stop and join the thread (whatever fails: a failed
        unpinning is kept for :meth:`check`)."""
        try:
            self.drain()
            for t in list(self._outstanding):
                try:
                    self._window.unpin(t)
                except BaseException as err:
                    self._keep(err)
                t.released = True
            self._outstanding.clear()
        finally:
            if self._thread is not None:
                self._queue.put(_STOP)
                self._thread.join()
                self._thread = None
