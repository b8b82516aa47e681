"""Victims sent down behind the caller: a bring-up's descent on a thread of its own.

A bring-up (:meth:`~tiered_emb.step.resolve.Resolver.bring_up`) ends with its *descent*:
HBM's victims admitted into DDR and DDR's dirty victims handed to the SSD tier's
write-back buffer.  The caller needs none of it: its rows are up once the descent
starts.  Within :meth:`Descents.behind` (a forward over many tables, one after the other)
each descent runs on one helper thread while the caller resolves the next table, so a
second core takes a part of the step's moves.

Nothing depends on it: the helper runs the descents in the order they were handed, so
each DDR tier makes the same decisions in the same order, and the write-back buffer gets
the same rows in the same order, as when each bring-up runs its own.  A bring-up (on any
thread) first waits for the descents into its DDR tier, so no DDR tier is read or changed
by two threads; the block ends when every descent has landed, and raises the first error
one raised.  A write-back that fails is kept for the next operation, as a bring-up's own
is (``defer_errors``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from tiered_emb._jit import one_thread


def _on_one_thread(fn: Callable[..., None], args: tuple) -> None:
    """``fn(*args)`` with Numba's kernels on this thread alone (the caller's kernels hold the other cores)."""
    with one_thread():
        fn(*args)


class Descents:
    """The descents handed off and not yet waited for, keyed by the DDR tier they go into."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        # id of a DDR tier's state -> the last descent into it (the helper runs them in order)
        self._pending: dict[int, Future] = {}
        self._owner: threading.Thread | None = None  # the thread in a ``behind`` block

    @property
    def on(self) -> bool:
        """Whether the calling thread is in a :meth:`behind` block (its descents are handed off)."""
        return self._owner is threading.current_thread()

    @contextmanager
    def behind(self, allowed: bool = True) -> Iterator[None]:
        """A block in which the calling thread's bring-ups hand their descents to the helper;
        every descent has landed when it ends.  ``allowed`` false (or a block already open):
        the bring-ups run their own, as outside it."""
        if not allowed or self._owner is not None:
            yield
            return
        self._owner = threading.current_thread()
        try:
            yield
        except BaseException:
            self._owner = None
            self.wait(quiet=True)  # (the caller's error is the one raised)
            raise
        self._owner = None
        self.wait()

    def hand(self, ddr: Any, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)``, the descent into DDR tier ``ddr``, on the helper, after every
        descent handed before it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered_emb-descend")
        self._pending[id(ddr.state.keys)] = self._pool.submit(_on_one_thread, fn, args)

    def wait(self, ddr: Any = None, quiet: bool = False) -> None:
        """Wait for the descents into DDR tier ``ddr`` (None: all of them) and raise the first
        error of those (none with ``quiet``)."""
        if not self._pending:
            return
        if ddr is None:
            done = list(self._pending.values())
            self._pending.clear()
        else:
            last = self._pending.pop(id(ddr.state.keys), None)
            done = [] if last is None else [last]
        errors = [e for e in (f.exception() for f in done) if e is not None]
        if errors and not quiet:
            raise errors[0]

    def shutdown(self) -> None:
        """Let every descent land and the helper go (the store is closing)."""
        self.wait(quiet=True)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


__all__ = ["Descents"]
