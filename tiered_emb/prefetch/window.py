"""The prefetch window: batches handed to the store ahead of their step, their rows pinned in HBM.

A batch *enters* the window when the trainer hands it over (``depth`` batches ahead):
with a ``lookahead+`` policy its resident rows are pinned at once, so the policy's
victims are always rows no batch of the window needs.  Its missing rows are *brought
up* later (``load_ahead`` batches ahead) and stay pinned until its step is done, or its
LMDB records are *read ahead* into host memory beside the tiers.  Each batch may pin at
most its table's pin budget (HBM less an eighth, kept for the step's own misses).

The rules that decide what is pinned (:func:`pin_budget`, :func:`repin_due`) are
Numba functions that the simulator's batch loop calls too (:mod:`tiered_emb.sim.lookahead`),
so the simulator's hit rates are those of this code.  Prefetch changes where rows are,
never their values.
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb.cache.policies import LRU, POLICIES
from tiered_emb.prefetch.ticket import Ticket
from tiered_emb.step.plan import dedupe


@numba.njit(cache=True)
def pin_budget(capacity_rows: int, pinned_rows: int) -> int:
    """Rows a batch of the window may still pin in a tier of ``capacity_rows`` with
    ``pinned_rows`` pinned: the window leaves 1/8 of the tier (at least one row) to the
    step's own misses."""
    return capacity_rows - pinned_rows - max(1, capacity_rows // 8)


@numba.njit(cache=True, nogil=True)
def pins_recorded(todo, uids, at, slots, aligned):
    """:meth:`Window.record_pins` in one pass: ``aligned[todo[at]] = slots``; returns
    ``todo`` and ``uids`` without the entries ``at`` (increasing), as new arrays."""
    n, m = todo.shape[0], at.shape[0]
    left_todo = np.empty(n - m, dtype=todo.dtype)
    left_uids = np.empty(n - m, dtype=uids.dtype)
    j = k = 0
    for i in range(n):
        if j < m and at[j] == i:
            aligned[todo[i]] = slots[j]
            j += 1
        else:
            left_todo[k] = todo[i]
            left_uids[k] = uids[i]
            k += 1
    return left_todo, left_uids


@numba.njit(cache=True)
def repin_due(policy_code: int, step_placed: bool) -> bool:
    """Whether, as a batch enters the window, the later batches' rows that came up since
    are pinned for them.  Under an LRU base only where a step placed rows since the last
    time: the rows the window brings up are the most recent when unpinned, evicted after
    every older row, so re-pinning them changes next to nothing and costs a probe of every
    later batch's ids.  Under LFU they are newcomers (one use), evicted first: always."""
    return step_placed or policy_code != LRU


class Window:
    """The window of one store, over its tables (a :class:`~tiered_emb.step.resolve.Resolver`).

    Every method but :meth:`pinned_batch` and :meth:`still_pinned` runs on the prefetch
    thread (:class:`~tiered_emb.prefetch.worker.Prefetcher`), in the order of its jobs;
    each takes the resolver's lock table by table, so the step waits for one table at most.
    """

    def __init__(self, res, policy: str):
        self.res = res
        self.lookahead = POLICIES[policy].lookahead
        self.policy_code = POLICIES[policy].code
        self.tickets: list = []  # entered and not yet unpinned, oldest first
        self.stepping: Ticket | None = None  # the ticket whose step runs now (see pinned_batch)

    def enter(self, ticket) -> None:
        """A batch enters the window; with a ``lookahead+`` policy its resident rows are pinned,
        after the rows that came up for the window's later batches since they entered (:meth:`repin`)."""
        if self.lookahead:
            self.repin()
        self.tickets.append(ticket)
        for name, ids in sorted(ticket.ids.items()):
            u, inverse = dedupe(ids)
            ticket.aligned[name] = np.full(u.shape[0], -1, dtype=np.int64)
            ticket.todo_at[name] = np.arange(u.shape[0])
            ticket.uids[name] = u
            with self.res.lock:
                if self.res.closed:
                    return
                if self.lookahead:
                    self.pin_resident(ticket, name)
            ticket.batch[name] = (ids, u, inverse)  # last: pinned_batch reads it, then the rest

    def repin(self) -> None:
        """Pin, for each batch of the window but the oldest (nearest first), its rows that came
        up since it entered and are not yet pinned for it, within the pin budget, in the
        tables :func:`repin_due` names.  The oldest batch is left alone: its step may be running.

        Why: a batch's resident rows are pinned when it enters, but a row a later step
        brings up would otherwise be left to the policy until its own batch, and a policy
        evicts a newcomer first (LFU: one use).  With this, ``lookahead+lfu`` equals offline
        Belady knowing the same window (LFU ties) at every point measured (docs/benchmarks.md).
        """
        with self.res.lock:
            if self.res.closed:
                return
            placed = {name for name, t in self.res.tables.items() if repin_due(self.policy_code, t.step_placed)}
            for name in placed:
                self.res.tables[name].step_placed = False
            if not placed:
                return
            for ticket in self.tickets[1:]:
                if ticket.error is not None:  # (released or not: its unpinning, queued after, takes every pin)
                    continue
                for name in sorted(ticket.uids):
                    if name in placed and ticket.todo_at[name].shape[0]:
                        self.pin_resident(ticket, name)

    def pin_resident(self, ticket, name: str) -> None:
        """Under the lock: pin for ``ticket`` the rows of table ``name`` that are resident and
        not yet pinned for it (the first ones, within the pin budget)."""
        t = self.res.tables[name]
        got, slots = t.hbm.pin_found(ticket.uids[name], self.budget(t))
        self.record_pins(ticket, name, got, slots)

    @staticmethod
    def budget(t) -> int:
        """:func:`pin_budget` of table ``t``'s HBM tier."""
        return pin_budget(t.hbm.capacity_rows, t.hbm.capacity_rows - t.hbm.unpinned_capacity)

    @staticmethod
    def record_pins(ticket, name: str, at: np.ndarray, slots: np.ndarray) -> None:
        """``slots`` are pinned for ``ticket`` now, for the entries ``at`` (increasing) of its ids
        of table ``name`` still to place (``ticket.uids[name]``), which leave that list."""
        prev = ticket.slots.get(name)
        ticket.slots[name] = slots if prev is None else np.concatenate([prev, slots])
        ticket.todo_at[name], ticket.uids[name] = pins_recorded(
            ticket.todo_at[name], ticket.uids[name], at, slots, ticket.aligned[name]
        )

    def bring_up(self, ticket) -> None:
        """Bring a ticket's rows up and leave them pinned (nearest batches first), table by table."""
        if ticket.error is not None:  # it failed to enter the window
            return
        for name in sorted(ticket.uids):
            with self.res.lock:
                if self.res.closed:
                    return
                t = self.res.tables[name]
                take = ticket.uids[name][: max(self.budget(t), 0)]
                if take.shape[0]:
                    slots, _ = self.res.bring_up(t, take, t.prefetch_counters, force_pin=True)
                    self.record_pins(ticket, name, np.arange(take.shape[0]), slots)

    def stage(self, ticket) -> None:
        """Read ahead: the LMDB records of the ticket's rows that no tier holds, read outside
        the lock and held by the SSD tier until the ticket is unpinned."""
        if ticket.error is not None:  # it failed to enter the window
            return
        batch = {}
        with self.res.lock:
            if self.res.closed:
                return
            for name in sorted(ticket.uids):
                t = self.res.tables[name]
                u = ticket.uids[name]
                self.res.descents.wait(t.ddr)
                batch[name] = u[(t.hbm.find(u) < 0) & (t.ddr.find(u) < 0)]
        self.res.ssd.stage(ticket.seq, batch)

    def unpin(self, ticket) -> None:
        """The ticket's step is done: release its pins and its staged reads."""
        if ticket in self.tickets:
            self.tickets.remove(ticket)
        with self.res.lock:
            for name, slots in sorted(ticket.slots.items()):
                self.res.tables[name].hbm.release(slots)
            ticket.slots = {}
            ticket.ids, ticket.batch, ticket.aligned = {}, {}, {}  # nothing pinned for it any more (the arrays go)
            self.res.ssd.unstage(ticket.seq)

    def pinned_batch(self, table: str, ids: np.ndarray):
        """``(ticket, uids, inverse, slots)`` when ``ids`` are the stepping batch's ids of ``table`` and
        every one of its rows is pinned in HBM for it; else None.

        Pinned rows stay in their slots until the ticket is released after the step, and
        nothing else reads or writes them meanwhile (the thread only places other rows),
        so the step may pool and update them without the lock.
        """
        ticket = self.stepping
        if ticket is None or ticket.error is not None:
            return None
        handed = ticket.batch.get(table)
        if handed is None or handed[0].shape != ids.shape or not np.array_equal(handed[0], ids):
            return None
        slots = ticket.aligned[table]
        if slots.shape[0] and slots.min() < 0:
            return None
        return ticket, handed[1], handed[2], slots

    def still_pinned(self, ticket) -> bool:
        """True while ``ticket``'s step runs (its pins hold): it is the stepping one and not released."""
        return ticket is self.stepping and not ticket.released
