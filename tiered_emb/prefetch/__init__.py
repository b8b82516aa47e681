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
would shrink the room left to the policy by k batches, which costs more hits than the window
wins (docs/benchmarks.md).  When pins would exceed the tier (each ticket may pin at most ``capacity -
reserve`` rows) the rows of the *farthest* batches are the ones left below.  The
step's own spill path answers whatever was not brought up.  Or the thread can *read
ahead* (``read_ahead`` batches ahead, default 0): the LMDB records of the rows the tiers
do not hold, read without the store's lock and kept beside the tiers for the step
(:meth:`TieredStore.read_ahead`).

Safety: the worker and the step share the store's lock for every change to the tiers
(they never race on them; a read-ahead's LMDB reads hold only the SSD tier's own
lock for their bookkeeping, see docs/architecture.md).  One exception, by design: a
step whose rows are all pinned for it pools and updates them without the lock
(:meth:`Window.pinned_batch`): pinned slots are never victims, so the worker,
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

from tiered_emb.prefetch.lookahead import lookahead
from tiered_emb.prefetch.ticket import Ticket
from tiered_emb.prefetch.window import Window
from tiered_emb.prefetch.worker import Prefetcher

__all__ = ["Prefetcher", "Ticket", "Window", "lookahead"]
