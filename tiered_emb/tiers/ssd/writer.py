"""The SSD tier's writes into ``p:``: write-backs through the buffer and the writer thread, and flushes.

Evicted rows (``durable=False``) wait in memory (:mod:`.held`) until ``writeback_rows``
are waiting; then every waiting row becomes a snapshot, cut into segments and appended
to ``p:`` in one transaction: on a writer thread with ``background_writes`` (the step
goes on at once), which hands it to the writer process where one can start
(:mod:`.writer_client`).  A durable write (a flush) writes its rows and every waiting
row now, in this thread.  A failed write's rows stay waiting in memory and are written
again by the next write; its error is raised once, before the next change of rows.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import warnings

import numba
import numpy as np

from tiered_emb.errors import CorruptStoreError, StoreFullError
from tiered_emb.tiers.ssd.compaction import Compactor
from tiered_emb.tiers.ssd.context import SsdContext
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.rowbuf import SortedRows
from tiered_emb.tiers.ssd.segments import SegmentLog
from tiered_emb.tiers.ssd.writer_client import (
    WRITER_PROCESS,
    WriterProcess,
    WriterStartError,
)
from tiered_emb.tiers.ssd.writer_main import tune_allocator

#: The writer process starts once ``writeback_rows // EARLY_START_FRACTION`` rows wait (:meth:`Writer._start_early`).
EARLY_START_FRACTION = 4


class _Commits:
    """A durable write's transactions, committed in order on a thread while this one cuts,
    encodes and indexes (py-lmdb lets the GIL go in its puts and commits, Numba and numpy in
    the encoding): the disk and a core busy at once.  One transaction waits while one
    commits, so this thread runs on through the next part's gathering and sorting with the
    disk still busy.  The first failure is raised, by :meth:`write` or on leaving the
    ``with``, and nothing after it is written; what committed before it is indexed."""

    def __init__(self, lmdb_env: LmdbEnv, segments: SegmentLog, lock: threading.Lock):
        self._lmdb, self._segments, self._lock = lmdb_env, segments, lock
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: list = []  # (table, number, ids, None) of the transactions committed, not yet indexed
        self._done_lock = threading.Lock()

    def write(self, groups: list[list]) -> None:
        for group in filter(None, groups):
            values = self._segments.encoded(group)
            self._raise_failed()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered_emb-commit", daemon=True)
                self._thread.start()
            self._queue.put(values)  # (waits while one waits and one commits)
            del values  # (the thread's now: freed once committed)
            self._index()  # (while the next ones commit)

    def _run(self) -> None:
        while (values := self._queue.get()) is not None:
            if self._error is not None:
                continue  # (after a failure nothing is written)
            try:
                self._lmdb.write(lambda txn, values=values: self._segments.put(txn, values))
            except BaseException as err:
                self._error = err
                continue
            with self._done_lock:
                self._done += [(t, seq, ids, None) for t, seq, ids, _ in values]

    def _raise_failed(self) -> None:
        if self._error is not None:
            self._stop()
            self._index()
            err, self._error = self._error, None
            raise err

    def _stop(self) -> None:
        """Wait for every transaction handed over (or skipped after a failure)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _index(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
        if done:
            self._segments.locate(done)
            found = self._segments.found(done)
            with self._lock:
                self._segments.indexed(done, found)
            self._segments.merge_due()

    def __enter__(self) -> _Commits:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        self._index()
        if exc[0] is None:
            self._raise_failed()
        else:
            self._error = None  # (failing already: that error is the one raised)


class Writer:
    """Writes into ``p:`` of one tier; one write at a time (a write-back waits until the
    thread's is indexed, every other write for the thread to end)."""

    def __init__(
        self,
        ctx: SsdContext,
        segments: SegmentLog,
        compactor: Compactor,
        writeback_rows: int,
        background_writes: bool,
        malloc_trim: int = 0,
    ):
        self._lmdb = ctx.lmdb
        self._tables = ctx.tables
        self._compression = ctx.compression
        self._held = ctx.held
        self._segments = segments
        self._written = ctx.written
        self._compactor = compactor
        self._lock = ctx.lock
        self.writeback_rows = int(writeback_rows)
        self.budget_bytes = int(ctx.budget_bytes)
        self.background_writes = bool(background_writes)
        # free memory the allocator keeps for the next write, this process's and the writer
        # process's (0: the allocator left alone), set at the first write (:meth:`_tune`)
        self._malloc_trim = int(malloc_trim)
        self._tuned = False
        # The writer thread hands each transaction to a writer process (its own GIL; see
        # :mod:`.writer_main`); False from the first time one cannot start.
        self.writer_process = self.background_writes and WRITER_PROCESS
        self.process: WriterProcess | None = None
        # the process being started ahead of the first write-back (:meth:`_start_early`)
        self._starting: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._started: WriterProcess | BaseException | None = None
        self._thread: threading.Thread | None = None
        self._indexed = threading.Event()  # set once the writer thread's write-back is indexed
        # the snapshots the writer thread is writing, numbered already (None: it numbers them)
        self._in_flight: list | None = []
        self.failed: BaseException | None = None  # a write-back's failure, not yet raised

    def _tune(self) -> None:
        """Set the process's allocator for large writes (:func:`.writer_main.tune_allocator`),
        once, at the first write: a store that only opens and reads leaves it alone."""
        if self._malloc_trim and not self._tuned:
            self._tuned = True
            tune_allocator(self._malloc_trim)

    def write_pending(self, batches, durable: bool = True, defer_errors: bool = False) -> int:
        """Write ``{table: (ids, rows)}`` into the since-checkpoint databases; returns rows written.

        ``durable=False`` (write-backs of evicted rows): the rows wait in memory with the
        others until ``writeback_rows`` are waiting, then all go out in one transaction
        (on the writer thread with ``background_writes``); reads see them at once; a failed
        write is raised, or with ``defer_errors`` kept for :meth:`raise_failed_write`.
        ``durable=True`` writes every waiting row and ``batches`` (one such dict, or an
        iterable of them taken one at a time, each newer than the one before) now, in
        transactions of an eighth of ``budget_bytes`` (committed in order on a thread, one
        waiting while one commits, as the next is encoded), each indexed once committed.
        """
        self._tune()
        if not durable:
            batches = {t: b for t, b in sorted(batches.items()) if b[0].shape[0]}
            with self._lock:
                for t, (ids, rows) in batches.items():
                    self._written.set(t, ids)  # first: a read that finds the bit clear will not look
                    self._held.put(t, ids, rows)
                waiting = self._held.buffered_rows()
            if waiting >= self.writeback_rows:
                self._write_behind(defer_errors)
            elif waiting >= self.writeback_rows // EARLY_START_FRACTION:
                self._start_early()
            return sum(b[0].shape[0] for b in batches.values())
        self.wait_writes()
        with self._lock:
            snaps = self._held.waiting()
        n = 0
        # the waiting rows with the first part: ``batches`` are newer (a row in both: the
        # part's copy is kept, or found in a later segment); what committed stays indexed when
        # a later transaction fails (those rows are also still dirty or waiting: written again)
        commits = _Commits(self._lmdb, self._segments, self._lock)
        with commits:
            for part in [batches] if isinstance(batches, dict) else batches:
                part = {t: b for t, b in sorted(part.items()) if b[0].shape[0]}
                n += sum(b[0].shape[0] for b in part.values())
                commits.write(self._groups(self._segments.cut(snaps, part)))  # (the waiting rows: with the first)
                snaps = []
            commits.write(self._groups(self._segments.cut(snaps)))  # (none given: the waiting rows alone)
        with self._lock:
            self._held.committed()
            self.failed = None
            self._held.written(None)
        return n

    def _groups(self, segments: list) -> list[list]:
        """``segments`` in groups of at most an eighth of ``budget_bytes`` of rows (at least one
        each): the transactions of a durable write (LMDB holds a transaction's pages in
        memory; three are in memory at once, and small ones keep the disk and the encoding
        busy side by side)."""
        groups: list[list] = [[]]
        size = 0
        for seg in segments:
            nbytes = seg[3].nbytes + seg[2].nbytes
            if groups[-1] and size + nbytes > self.budget_bytes // 8:
                groups.append([])
                size = 0
            groups[-1].append(seg)
            size += nbytes
        return groups

    def write_sorted(self, table: str, ids: np.ndarray, rows: np.ndarray, defer_errors: bool = False) -> None:
        """A bulk write of ``rows`` under ``ids`` (distinct, increasing) of ``table``, and every
        waiting write-back, in one transaction: on the writer thread with ``background_writes``
        (the caller goes on; reads find the rows in memory until the commit), else now.  One
        such write is in flight at a time; an earlier failure is raised first (with
        ``defer_errors`` kept for :meth:`raise_failed_write`).

        With the writer thread busy, the rows are cut into segments and encoded here while
        its transaction commits, so that the disk is not idle while the next one is encoded.
        """
        self._tune()
        if not defer_errors:
            self.wait_writes()
            self.raise_failed_write()
        if self._in_flight is None:  # (the thread numbers its own segments: it goes first)
            self.wait_writes()
        with self._lock:
            self._written.set(table, ids)  # first: a read that finds the bit clear will not look
            in_flight = self._in_flight or []
            snaps = self._held.waiting_with(table, SortedRows(ids, rows))
        # the write-backs that are not in the transaction in flight, and these rows: numbered
        # above it, as they are newer
        mine = [snap for snap in snaps if not any(snap is x for x in in_flight)]
        segments = self._segments.encoded(self._segments.cut(mine)) if self.background_writes else None
        self.wait_writes()
        if self.failed is not None:
            # the transaction before failed: its rows are older than these and go first, with
            # them (the numbers taken above are a gap)
            mine, segments = snaps, None
        # in this process: a few large segments hold the GIL little (py-lmdb drops it around
        # each put and the commit), and the rows need not cross a pipe
        self._commit(mine, defer_errors, by_process=False, segments=segments)

    def raise_failed_write(self) -> None:
        """Raise the failure of an earlier write-back, once (its rows still wait in memory)."""
        if self.failed is not None:
            err, self.failed = self.failed, None
            raise err

    def forget_failure(self) -> None:
        """Every waiting row was written since (by a durable write): drop the failure."""
        self.failed = None

    @property
    def writing(self) -> bool:
        """Whether the writer thread is busy now: a write-back (through its process) or the
        index's merge that follows one."""
        return self._thread is not None and self._thread.is_alive()

    def wait_writes(self) -> None:
        """Wait for the writer thread; its error, if any, is raised by the next durable write."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._in_flight = []

    def _write_behind(self, defer_errors: bool = False) -> None:
        """Hand every waiting write-back to the writer thread, once the previous one is indexed
        (a merge of the index it began may go on beside the new one; a compaction waits for
        it here).

        A failed write's rows stay waiting in memory, retried by the next write.  The failure
        is raised here, or with ``defer_errors`` kept for :meth:`raise_failed_write`: an
        operation that is changing rows goes on to its end, and the next one raises it
        before it changes anything (all or nothing).
        """
        if self._thread is not None:  # (indexed: a merge of the index it began may go on)
            self._indexed.wait()
        if self.failed is not None:
            if defer_errors:
                return
            self.raise_failed_write()
        if self._compactor.due():
            self.wait_writes()
            try:
                self._compactor.step()
            except Exception as err:  # (the rows wait in memory, the next write tries again)
                if not defer_errors:
                    raise
                self.failed = err
                return
        with self._lock:
            snaps = self._held.waiting()
        self._commit(snaps, defer_errors)

    def _commit(self, snaps, defer_errors: bool, by_process: bool = True, segments: list | None = None) -> None:
        """Write ``snaps`` on the writer thread with ``background_writes`` (through the writer
        process where ``by_process``), else now: a failure raised, or with ``defer_errors`` kept.
        ``segments``: ``snaps`` cut and encoded already (:meth:`.SegmentLog.encoded`)."""
        if not self.background_writes:
            try:
                self._commit_waiting(snaps, segments=segments)
            except Exception as err:
                if not defer_errors:
                    raise
                self.failed = err
            self._segments.merge_due()
            return
        # (None: the thread cuts and numbers them itself, so nothing may be numbered meanwhile)
        self._in_flight = snaps if segments is not None else None
        self._indexed = threading.Event()
        self._thread = threading.Thread(
            target=self._behind,
            args=(snaps, by_process, segments, self._thread, self._indexed),
            name="tiered_emb-writer",
            daemon=True,
        )
        self._thread.start()

    def _behind(self, snaps, by_process: bool, segments: list | None, after, indexed: threading.Event) -> None:
        """The writer thread: :meth:`_commit_waiting` (indexed while ``after``, the thread
        before or None, may still be merging the index: the index takes the changes aside
        meanwhile); then, once ``after`` ended, the index's merges that are due, a slice at
        a time (:meth:`.SegmentLog.merge_due`), while the next write-back may already be cut,
        written and indexed.  Joining this thread joins every one before it."""
        numba.set_num_threads(1)  # (one: see tiered_emb.prefetch.worker, the same for its thread)
        try:
            self._commit_waiting(snaps, True, by_process, segments, after)
        finally:
            indexed.set()
            if after is not None:
                after.join()
        self._segments.merge_due()

    def _commit_waiting(
        self, snaps, on_thread: bool = False, by_process: bool = True, segments: list | None = None, after=None
    ) -> None:
        try:
            if segments is None:
                segments = self._segments.cut(snaps)
                if on_thread and by_process and self.writer_process:
                    segments = self._segments.encoded(segments)
            if not (on_thread and by_process and self.writer_process and self.write_by_process(segments)):
                # (also where the writer process cannot start)
                self._lmdb.write(lambda txn: self._segments.put(txn, segments))
            self._segments.locate(segments)
            # (searched with the lock let go only when no other thread may change the index:
            # else under the lock, as it is changed)
            found = None if after is not None and after.is_alive() else self._segments.found(segments)
        except BaseException as err:
            if not on_thread:
                raise
            self.failed = err
            return
        with self._lock:
            self._segments.indexed(segments, found)  # before the snapshots leave the read path: reads then look in p:
            self._held.committed(snaps)
            self._held.written([(t, ids) for t, _, ids, _ in segments])  # (the snapshots' ids, each once)

    def _start_early(self) -> None:
        """Start the writer process on a thread of its own, ahead of the first write-back that
        needs it: its start (an interpreter, its imports, the environment opened: a third
        of a second) then overlaps the steps that fill the buffer, instead of holding up
        the writer thread's first write, and with it the next write-back."""
        if not self.writer_process or self.process is not None:  # (the case of every put once it runs)
            return
        with self._start_lock:
            if not self.writer_process or self.process is not None or self._starting is not None:
                return

            def start() -> None:
                try:
                    self._started = self._new_process()
                except BaseException as err:  # (raised on the thread that takes it)
                    self._started = err

            self._starting = threading.Thread(target=start, name="tiered_emb-writer-start", daemon=True)
            self._starting.start()

    def _new_process(self) -> WriterProcess:
        return WriterProcess(
            self._lmdb,
            self._compression,
            self._tables,
            self._malloc_trim,
            self._segments.dtypes,
            shared_max=self.budget_bytes // 4,
        )

    def _take_started(self) -> None:
        """The process :meth:`_start_early` started, once it is up, as :attr:`process` (its
        failure raised).  On the writer thread, or with it ended."""
        starting = self._starting
        if starting is None:
            return
        starting.join()
        with self._start_lock:  # (the process set before the thread is cleared: no second start)
            started, self._started = self._started, None
            if isinstance(started, WriterProcess):
                self.process = started
            self._starting = None
        if isinstance(started, BaseException):
            raise started

    def write_by_process(self, segments: list) -> bool:
        """Append ``segments`` (:meth:`.SegmentLog.cut`) to ``p:`` in one transaction of the writer
        process; False (nothing written) when the process cannot start: this store's writes
        stay in this process from then on.  Grows the map and sends the write again when
        the map is full; a failure is rolled back (the rows stay waiting in memory) and
        raised as :class:`StoreFullError` or :class:`CorruptStoreError`."""
        if not segments:
            return True
        if hasattr(signal, "pthread_sigmask"):
            # A write into a dead process's pipe raises here (EPIPE), instead of a SIGPIPE
            # that kills the trainer when it runs with SIGPIPE's default action.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        while True:
            if self.process is None:
                try:
                    self._start_early()  # (unless started already)
                    self._take_started()
                except WriterStartError as err:  # (no python with lmdb here: a frozen or embedded app)
                    self.writer_process = False
                    try:  # told once; under -W error it must not fail the write
                        warnings.warn(
                            f"{err}; this store's write-backs are written by its writer thread from now on",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    except Warning:
                        pass
                    return False
            try:
                reply = self.process.write(segments, self._lmdb.map_size())
            except CorruptStoreError:
                self.process.close()
                self.process = None  # the next write starts another one
                raise
            if reply.get("error") == "map_full":
                self._lmdb.grow_map()
                continue
            path = self._lmdb.path
            if reply.get("error") == "full":
                raise StoreFullError(
                    f"the disk under {path} is full ({reply['message']}); the write was rolled back",
                    "free disk space or move the store, then call flush()/checkpoint() again",
                )
            if "error" in reply:
                raise CorruptStoreError(
                    f"writing to {path} failed ({reply['message']}); the write was rolled back",
                    "check the disk and the store directory",
                )
            return True

    def close(self) -> None:
        """Wait for the writer thread and end the writer process (waiting write-backs are not written)."""
        self.wait_writes()
        with contextlib.suppress(WriterStartError):
            self._take_started()
        if self.process is not None:
            self.process.close()
            self.process = None
