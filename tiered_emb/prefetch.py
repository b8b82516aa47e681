"""Lookahead prefetch: bring the rows of the next batches up the tiers on a background thread.

The trainer's loader already knows batches t+1..t+k.  :meth:`TieredStore.prefetch`
hands one of them to the store and returns a :class:`Ticket`; a single background
thread per store takes tickets in order and, per table, brings the batch's rows up
(LMDB -> DDR -> HBM) and *pins* them.  A pinned slot is detached from its policy, so it
cannot be evicted until :meth:`TieredStore.release` (after the batch's update) unpins it.
The step then finds its rows in HBM.

Eviction by next use follows from the pins.  A batch *enters the window* when it is
handed over (``depth`` batches ahead): with a ``lookahead+`` policy the thread pins its
resident rows first thing, and, as each batch enters, the rows that came up since for the
window's later batches (where a step brought them up for its own batch), so victims are always
rows not needed within the window, ordered by the tier's own policy.  Its missing rows
can be *brought up* later, ``load_ahead`` batches ahead (default 0: by the step): a row
brought up early is pinned until its batch is done, so loading the whole window at once
would shrink the room left to the policy by k batches; measured in ``bench/bench_prefetch.py`` that costs more hits than the window
wins.  When pins would exceed the tier (each ticket may pin at most ``capacity -
reserve`` rows) the rows of the *farthest* batches are the ones left below.  The
step's own spill path answers whatever was not brought up.  Or the thread can *read
ahead* (``read_ahead`` batches ahead, default 0): the LMDB records of the rows the tiers
do not hold, read without the store's lock and kept beside the tiers for the step
(:meth:`TieredStore.read_ahead`).

Safety: the worker and the step share the store's lock for every change to the tiers
(they never race on them; a read-ahead's LMDB reads hold only the SSD tier's own
lock for their bookkeeping, see docs/architecture.md).  One exception, by design: a
step whose rows are all pinned for it pools and updates them without the lock
(:meth:`TieredStore._pinned_batch`): pinned slots are never victims, so the worker,
placing other rows meanwhile, never moves them nor reads or writes their records or
dirty flags (it may pin them again for a later batch, which touches only policy state).
A backward run after its batch's step has moved on takes the locked path.  The step's
own window bookkeeping (a batch entering the window, a batch's pins released after its
update) is queued on the worker too, in order, so the step takes the lock only on the
rows it must place itself.  ``checkpoint`` and ``close`` drain the queue first; an
exception on the worker is kept in its ticket and raised as
:class:`~tiered_emb.errors.PrefetchError` by ``Ticket.wait`` / ``release`` (the step
that needs those rows); ``close`` joins the thread.
Prefetch changes where rows are, never their values.
"""
from __future__ import annotations

import queue
import threading

import numba
import numpy as np

from tiered_emb.errors import ConfigError, PrefetchError

_STOP = object()


class Ticket:
    """One prefetched batch: ``{table: unique ids}`` and, once brought up, their pinned slots."""

    def __init__(self, seq: int, ids: dict[str, np.ndarray]):
        self.seq = seq
        self._owner = None  # the Prefetcher that made it
        # Per table: the ids as handed over.  The thread sets the rest when the batch
        # enters the window: the batch (ids, unique ids, inverse), the unique ids still to
        # bring up, the slots pinned for the batch so far, the pinned slot of each unique
        # id (-1: not pinned) and where ``uids`` sit among the unique ids.
        self.ids = ids
        self.batch: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.uids: dict[str, np.ndarray] = {}
        self.slots: dict[str, np.ndarray] = {}
        self.aligned: dict[str, np.ndarray] = {}
        self.todo_at: dict[str, np.ndarray] = {}
        self.error: BaseException | None = None
        self.released = False
        self.queued = False  # its bring-up handed to the thread
        self.staged = False  # its LMDB reads handed to the thread
        self._entered = threading.Event()
        self._done = threading.Event()
        self._read = threading.Event()
        self._unpinned = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the batch's rows are up; raise :class:`PrefetchError` if bringing them failed.

        A ticket whose bring-up was never queued (``prefetch(..., bring_up=False)`` and no
        :meth:`TieredStore.bring_up`) returns once the batch is in the window: the step brings
        up what is missing itself.
        """
        self._settle()
        if self.error is not None:
            raise PrefetchError(f"prefetch of batch {self.seq} failed: {type(self.error).__name__}: {self.error}",
                                "the rows were not brought up; fix the cause (see __cause__) and retry the step") \
                from self.error

    def _settle(self) -> None:
        """Wait for whatever the thread was given of this ticket."""
        self._entered.wait()
        if self.staged:
            self._read.wait()
        if self.queued:
            self._done.wait()


class Prefetcher:
    """The background thread of one store (started on the first ticket, joined by :meth:`close`)."""

    def __init__(self, store):
        self._store = store
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._outstanding: list[Ticket] = []
        self._releasing: list[Ticket] = []  # released, their unpinning queued
        # Entered and not yet unpinned, oldest first: kept by the thread's own jobs
        # (TieredStore._enter_ticket / _unpin_ticket), so it follows their order, not the step's.
        self.window: list[Ticket] = []
        self.stepping: Ticket | None = None  # the batch whose step runs now (see TieredStore._pinned_batch)
        self._unpin_error: BaseException | None = None  # the thread's first failed unpinning, until raised
        self._unpin_error_lock = threading.Lock()  # the thread sets it while the step may take it

    def submit(self, batch: dict[str, np.ndarray], queue: bool = True) -> Ticket:
        """A batch entering the window (``{table: ids}``, checked).

        The thread pins its resident rows first (:meth:`TieredStore._enter_ticket`), then,
        with ``queue``, brings up the rest; otherwise :meth:`bring_up` queues that later.
        """
        ticket = Ticket(self._seq, batch)
        ticket._owner = self
        self._seq += 1
        self._outstanding.append(ticket)
        self._put(ticket._entered, self._store._enter_ticket, ticket)
        if queue:
            self.bring_up(ticket)
        return ticket

    def bring_up(self, ticket: Ticket) -> None:
        """Queue ``ticket`` for the thread (tickets are brought up in the order they are queued)."""
        self._check_own(ticket)
        if ticket.queued or ticket.released:
            return
        ticket.queued = True
        self._put(ticket._done, self._store._bring_up_ticket, ticket)

    def read_ahead(self, ticket: Ticket) -> None:
        """Queue ``ticket``'s LMDB reads for the thread (rows staged in host memory, tiers untouched)."""
        self._check_own(ticket)
        if ticket.staged or ticket.released:
            return
        ticket.staged = True
        self._put(ticket._read, self._store._stage_ticket, ticket)

    def _check_own(self, ticket) -> None:
        """ConfigError, before anything changes, unless ``ticket`` came from this store's prefetch()."""
        if getattr(ticket, "_owner", None) is not self:
            what = "a ticket of another store" if isinstance(ticket, Ticket) else f"a {type(ticket).__name__}"
            raise ConfigError(f"{what} was given to this store",
                              "pass the Ticket this store's prefetch() returned, to the same store")

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
        self._check_own(ticket)
        if ticket.released:
            return
        ticket._settle()
        ticket.released = True
        self._outstanding.remove(ticket)
        self._releasing = [t for t in self._releasing if not t._unpinned.is_set()] + [ticket]
        self._put(ticket._unpinned, self._unpin, ticket)
        ticket.wait()
        if check:
            self.check()

    def _unpin(self, ticket: Ticket) -> None:
        """Thread side of :meth:`release`: a failure is kept for :meth:`check` (the ticket's
        step is over; no step waits on this job)."""
        try:
            self._store._unpin_ticket(ticket)
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
            raise PrefetchError(f"unpinning a released batch's rows failed: {type(err).__name__}: {err}",
                                "its rows may stay pinned, leaving HBM fewer slots; values are unaffected. "
                                "Checkpoint, close and reopen the store") from err

    def drain(self) -> None:
        """Wait until every submitted ticket has been brought up (or failed) and every released one unpinned."""
        for t in list(self._outstanding):
            t._settle()
        for t in self._releasing:
            t._unpinned.wait()
        self._releasing.clear()

    def close(self) -> None:
        """Drain, unpin what is still pinned, stop and join the thread (whatever fails: a failed
        unpinning is kept for :meth:`check`)."""
        try:
            self.drain()
            for t in list(self._outstanding):
                try:
                    self._store._unpin_ticket(t)
                except BaseException as err:
                    self._keep(err)
                t.released = True
            self._outstanding.clear()
        finally:
            if self._thread is not None:
                self._queue.put(_STOP)
                self._thread.join()
                self._thread = None


def lookahead(store, batches, ids_of, depth: int, load_ahead: int = 0, read_ahead: int = 0):
    """Iterate ``batches`` with the ids of the next ``depth`` batches handed to the store.

    Parameters
    ----------
    store : TieredStore
    batches : iterable of anything (the trainer's batches)
    ids_of : callable, ``ids_of(batch) -> {table: ids}``
    depth : int >= 0, lookahead window k; 0 turns prefetch off
    load_ahead : int >= 0, how many batches ahead rows are *brought up* into HBM and
        pinned (at most ``depth``).  Before step t, batch t + depth enters the window (the
        thread pins its resident rows under a ``lookahead+`` policy, so they are not
        evicted before use; with ``load_ahead`` 0 the step waits for that, since it then
        places rows itself; otherwise it runs in the thread's order, after the bring-ups
        queued before it) and batch t + load_ahead is queued for the background thread.
        Rows brought up early hold HBM room until their batch is done, which costs hits
        (see docs/benchmarks.md); what they buy is a step that finds all its rows pinned
        for it and runs without the store's lock.  Default here 0 (the step places its
        missing rows itself); :class:`tiered_emb.torch.TrainPipeline` uses 1.
    read_ahead : int >= 0, how many batches ahead the thread *reads* the rows the tiers
        do not hold from LMDB into host memory (at most ``depth``): the step finds them
        there instead of waiting on LMDB, and the tiers' decisions stay the step's.  It
        pays where LMDB reads wait on the disk; where they are CPU work (records in the
        page cache) on a host whose cores the step already uses, the thread's work slows
        the step more than it saves (docs/benchmarks.md), hence the default 0.

    Yields each batch after its rows are up (a failure to bring them up is raised here,
    as PrefetchError, in the step that needs them).  An error fetching a batch (from
    ``batches``, from ``ids_of`` or its ids' checks) is raised when the loop reaches that
    batch, after the batches fetched before it have run, as without lookahead.  Control
    returning to the generator means the batch's update is applied: its pins are released
    then.  Closing the generator early (break, exception) releases every outstanding pin.

    Examples
    --------
    >>> for batch in lookahead(store, loader, lambda b: {"t": b}, depth=4):  # doctest: +SKIP
    ...     store.apply_gradients("t", batch, grads_for(batch))
    """
    for name, v in (("depth", depth), ("load_ahead", load_ahead), ("read_ahead", read_ahead)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            from tiered_emb.errors import ConfigError
            raise ConfigError(f"{name}={v!r} is invalid", "use an int >= 0 (depth 0: no prefetch)")
    if depth == 0:
        yield from batches
        return
    load = min(load_ahead, depth)
    read = min(read_ahead, depth)
    it = iter(batches)
    window: list = []  # (batch, ticket) of batches base, base + 1, ...
    base = 0
    exhausted = False
    failed: Exception | None = None  # fetching a batch failed: raised when the loop reaches it
    t = -depth
    try:
        while True:
            if not exhausted:
                try:
                    nxt = next(it, _STOP)
                    if nxt is _STOP:
                        exhausted = True
                    else:  # batch t + depth enters the window
                        window.append((nxt, store.prefetch(ids_of(nxt), bring_up=False)))
                        if load == 0:
                            # The step places its own rows: let the window's pins come first, as
                            # they always do with load-ahead (the thread's work runs in order).
                            window[-1][1]._entered.wait()
                except Exception as err:  # the loader, ids_of or the batch's ids: the batches
                    exhausted, failed = True, err  # before it still run first, as without lookahead
            j = t + read - base  # batch t + read: its LMDB rows are read on the thread
            if read > 0 and 0 <= j < len(window):
                store.read_ahead(window[j][1])
            j = t + load - base  # batch t + load comes up on the thread
            if load > 0 and 0 <= j < len(window):
                store.bring_up(window[j][1])
            if t >= 0:
                if not window:
                    if failed is not None:
                        raise failed
                    return
                batch, ticket = window.pop(0)
                base += 1
                try:
                    ticket.wait()
                    store._prefetcher.stepping = ticket
                    yield batch
                finally:
                    store._prefetcher.stepping = None
                    if not store._closed:  # (close() during the step released every ticket)
                        store.release(ticket)
            t += 1
    finally:
        for _, ticket in window:
            if store._closed:
                break  # close() released them all
            try:  # without check(): a failed unpinning is left for the next release or close()
                store._prefetcher.release(ticket, check=False)
            except PrefetchError:
                pass  # its batch never ran; the error belongs to no step
        if not store._closed:
            store._prefetcher.drain()  # every pin of the loop is gone when it ends
