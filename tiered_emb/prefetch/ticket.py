"""Ticket: one batch handed to the prefetch window ahead of its step, and what was pinned for it."""

from __future__ import annotations

import threading

import numpy as np

from tiered_emb.errors import PrefetchError


class Ticket:
    """One prefetched batch: ``{table: unique ids}`` and, once brought up, their pinned slots."""

    def __init__(self, seq: int, ids: dict[str, np.ndarray]):
        self.seq = seq
        self.owner = None  # the Prefetcher that made it
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
        self.entered_event = threading.Event()
        self.up_event = threading.Event()
        self.read_event = threading.Event()
        self.unpinned_event = threading.Event()

    @property
    def done(self) -> bool:
        """Whether the thread has finished bringing the batch's rows up (or failed to: :meth:`wait` raises)."""
        return self.up_event.is_set()

    def wait(self) -> None:
        """Block until the batch's rows are up; raise :class:`PrefetchError` if bringing them failed.

        A ticket whose bring-up was never queued (``prefetch(..., bring_up=False)`` and no
        :meth:`TieredStore.bring_up`) returns once the batch is in the window: the step brings
        up what is missing itself.
        """
        self.settle()
        if self.error is not None:
            raise PrefetchError(
                f"prefetch of batch {self.seq} failed: {type(self.error).__name__}: {self.error}",
                "the rows were not brought up; fix the cause (see __cause__) and retry the step",
            ) from self.error

    def wait_entered(self) -> None:
        """Block until the batch is in the window (its resident rows pinned, under a ``lookahead+`` policy)."""
        self._await(self.entered_event)

    def settle(self) -> None:
        """Wait for whatever the thread was given of this ticket."""
        self._await(self.entered_event)
        if self.staged:
            self._await(self.read_event)
        if self.queued:
            self._await(self.up_event)

    def _await(self, event: threading.Event) -> None:
        if self.owner is None:  # made by hand, never queued on a thread: nothing can set it later
            event.wait()
        else:
            self.owner.await_event(event)
