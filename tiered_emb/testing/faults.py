"""Fault injection and probes on an open store, for tests: the one place that reaches into the
SSD tier's parts to make them fail or to watch them, so that tests name the fault they want
instead of monkeypatching a tier's internals.

Each ``fail_*`` arms a :class:`Fault` on one point of ``store`` (a
:class:`~tiered_emb.TieredStore`): every call through that point is counted in
``fault.calls`` (the thread's name), and the calls for which ``fails(n)`` is true (``n``
counts from 1) raise :class:`~tiered_emb.errors.StoreFullError` as a full disk would,
before anything is written; the others go through.  :meth:`Fault.disarm` puts the point
back.  A fault lasts as long as the store (or until disarmed).

Points:

- :func:`fail_lmdb_writes`: every write transaction of the store's LMDB environment (rows,
  checkpoints, compaction), in this process;
- :func:`fail_segment_puts`: the write-backs' segments put in this process (the writer
  thread's and ``flush``'s, not the writer process's);
- :func:`full_disk_for` (in :mod:`tiered_emb.testing`): every write path at once, the
  writer process's included.

Probes: :func:`compactions` (the tables compacted, in order), :func:`lmdb_reads` (the
ids looked up in LMDB), :func:`hold_background_puts` (the writer thread's transactions
held until an event is set), :func:`staged_rows` (the rows read ahead, per batch and
table), :func:`snapshots_waiting` (write-backs handed over and not yet in LMDB),
:func:`lmdb_readers` (the reader table of the store's LMDB environment) and
:func:`in_lmdb_write` (a body run in one of the store's write transactions, its errors
translated as every write's).  Tests above the tiers use these instead of reaching
into a tier's parts (``tests/test_layout.py`` checks it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Fault:
    """A point of a store armed to fail (see the module's docstring)."""

    def __init__(self, owner: Any, name: str, fails: Callable[[int], bool]):
        self.calls: list[str] = []
        self._owner, self._name = owner, name
        self._real = getattr(owner, name)
        real = self._real

        def armed(*args: Any) -> Any:
            from tiered_emb.errors import StoreFullError

            self.calls.append(threading.current_thread().name)
            if fails(len(self.calls)):
                raise StoreFullError("no space left on device", "free disk space")
            return real(*args)

        setattr(owner, name, armed)

    def disarm(self) -> None:
        """Put the point back as it was."""
        setattr(self._owner, self._name, self._real)


def fail_lmdb_writes(store: Any, fails: Callable[[int], bool]) -> Fault:
    """Arm every LMDB write transaction of ``store`` (``fails(n)``: the n-th fails)."""
    return Fault(store.engine.ssd.lmdb, "write", fails)


def fail_segment_puts(store: Any, fails: Callable[[int], bool]) -> Fault:
    """Arm the puts of write-back segments made in this process (``fails(n)``: the n-th fails)."""
    return Fault(store.engine.ssd.segments, "put", fails)


def compactions(store: Any) -> list[str]:
    """A list that each compaction run of ``store`` appends its table's name to, as it runs."""
    compactor = store.engine.ssd.compactor
    real, seen = compactor.compact_run, []

    def run(table: str, stalest: bool = False) -> Any:
        seen.append(table)
        return real(table, stalest)

    compactor.compact_run = run
    return seen


def hold_background_puts(store: Any) -> threading.Event:
    """Make every segment put of ``store`` off the main thread (the writer thread's) wait
    until the returned event is set (10 s at most, then it fails the put's thread)."""
    segments = store.engine.ssd.segments
    real, go = segments.put, threading.Event()

    def put(txn: Any, batch: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            assert go.wait(10), "a held put was never released"
        return real(txn, batch)

    segments.put = put
    return go


def lmdb_reads(store: Any) -> list[tuple[str, int]]:
    """A list that each id ``store``'s SSD tier looks up in LMDB is appended to, as
    ``(table, id)``, in the order of its batched reads."""
    reader = store.engine.ssd.reader
    real, asked = reader.read_lmdb, []

    def read(table: str, ids: Any, *rest: Any) -> Any:
        asked.extend((table, int(i)) for i in ids)
        return real(table, ids, *rest)

    reader.read_lmdb = read
    return asked


def staged_rows(store: Any) -> dict[int, dict[str, int]]:
    """The rows read ahead and held for coming batches: ``{ticket number: {table: rows}}``
    (read between operations: nothing is changing them)."""
    staged = store.engine.ssd.held.staged
    return {key: {t: len(b) for t, b in sorted(staged[key].items())} for key in sorted(staged)}


def snapshots_waiting(store: Any) -> int:
    """Write-backs handed over to be written (snapshots) that are not in LMDB yet."""
    return len(store.engine.ssd.held.flushing)


def lmdb_readers(store: Any) -> str:
    """LMDB's reader table of ``store``'s environment, as text (a line per reader: its pid)."""
    return str(store.engine.ssd.lmdb.env.readers())


def in_lmdb_write(store: Any, body: Callable[[Any], Any]) -> Any:
    """``body(txn)`` in one write transaction of ``store``'s LMDB environment, as every write
    runs (a full disk or a failure raised as :class:`~tiered_emb.errors.StoreFullError` or
    :class:`~tiered_emb.errors.CorruptStoreError`)."""
    return store.engine.ssd.lmdb.write(body)
