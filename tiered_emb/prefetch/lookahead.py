"""The loop a trainer writes: iterate its batches with the next ones handed to the store ahead."""

from __future__ import annotations

import sys

from tiered_emb.errors import ConfigError, PrefetchError

_STOP = object()


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

    Yields
    ------
    batch
        Each batch after its rows are up (a failure to bring them up is raised here, as
        PrefetchError, in the step that needs them).  An error fetching a batch (from
        ``batches``, from ``ids_of`` or its ids' checks) is raised when the loop reaches
        that batch, after the batches fetched before it have run, as without lookahead.
        Control returning to the generator means the batch's update is applied: its pins
        are released then.  Closing the generator early (break, exception) releases every
        outstanding pin.

    Examples
    --------
    >>> for batch in lookahead(store, loader, lambda b: {"t": b}, depth=4):  # doctest: +SKIP
    ...     store.apply_gradients("t", batch, grads_for(batch))
    """
    for name, v in (("depth", depth), ("load_ahead", load_ahead), ("read_ahead", read_ahead)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
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
                            window[-1][1].wait_entered()
                except Exception as err:  # the loader, ids_of or the batch's ids: the batches
                    exhausted, failed = True, err  # before it still run first, as without lookahead
            j = t + read - base  # batch t + read: its LMDB rows are read on the thread
            if read > 0 and 0 <= j < len(window):
                store.engine.read_ahead(window[j][1])
            j = t + load - base  # batch t + load comes up on the thread
            if load > 0 and 0 <= j < len(window):
                store.engine.bring_up(window[j][1])
            if t >= 0:
                if not window:
                    if failed is not None:
                        raise failed
                    return
                batch, ticket = window.pop(0)
                base += 1
                try:
                    ticket.wait()
                    with store.engine.stepping(ticket):
                        yield batch
                finally:
                    # (close() during the step released every ticket; an exiting interpreter
                    # runs no prefetch thread to release it)
                    if not store.engine.closed and not sys.is_finalizing():
                        store.release(ticket)
            t += 1
    finally:
        for _, ticket in window:
            if store.engine.closed or sys.is_finalizing():
                break  # close() released them all; or the process is exiting
            try:  # without check(): a failed unpinning is left for the next release or close()
                store.release(ticket, check=False)
            except PrefetchError:
                pass  # its batch never ran; the error belongs to no step
        if not store.engine.closed and not sys.is_finalizing():
            store.engine.drain_prefetch()  # every pin of the loop is gone when it ends
