"""Slow, obviously-right references and helpers for tests (no Numba in the references)."""

from __future__ import annotations

import threading
from pathlib import Path


class AnonPeak:
    """The high-water mark of this process's anonymous memory (``RssAnon``: what it holds
    itself; pages of a mapped file are the page cache's), sampled every ``every`` seconds
    on a daemon thread, for tests and benches that bound an operation's memory."""

    def __init__(self, every: float = 0.002):
        self.high = self.now()
        self._every = every
        threading.Thread(target=self._sample, daemon=True, name="tiered_emb-anon-peak").start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def _sample(self) -> None:
        import time

        while True:
            self.high = max(self.high, self.now())
            time.sleep(self._every)

    def restart(self) -> int:
        """Start the mark again from now; returns it."""
        import time

        time.sleep(5 * self._every)
        self.high = self.now()
        return self.high

    def peak(self) -> int:
        """The mark since :meth:`restart` (or since sampling began), now included."""
        import time

        time.sleep(5 * self._every)
        self.high = max(self.high, self.now())
        return self.high


def crash(store) -> None:
    """Drop ``store`` as a killed process would: nothing flushed, no checkpoint; the LMDB
    environment and the writer lock are released so the same process can reopen it."""
    from tiered_emb.errors import PrefetchError

    try:
        store.close(checkpoint=False)
    except PrefetchError:  # a failed unpinning on the thread: the store is closed all the same
        pass


def full_disk_for(store, writes: int = 1) -> list[str]:
    """Make the next ``writes`` LMDB write-back transactions of ``store`` fail as on a full
    disk (:class:`~tiered_emb.errors.StoreFullError`, rolled back), the later ones succeed.
    Returns the list the attempts append their thread's name to."""
    from tiered_emb.errors import StoreFullError

    ssd, attempts = store.engine.ssd, []
    real_put, real_segments, real_by_process = (
        ssd.checkpoints.put_meta,
        ssd.segments.put,
        ssd.writer.write_by_process,
    )

    def attempt():
        attempts.append(threading.current_thread().name)
        if len(attempts) <= writes:
            raise StoreFullError("no space left on device", "free some")

    def put(txn, *args):  # a checkpoint's own transaction (its meta record and mark)
        attempt()
        real_put(txn, *args)

    def put_segments(txn, segments):  # a write into p: in this process (flush, no writer process)
        attempt()
        real_segments(txn, segments)

    def by_process(segments):  # a background write through the writer process
        attempt()
        return real_by_process(segments)

    ssd.checkpoints.put_meta, ssd.segments.put, ssd.writer.write_by_process = put, put_segments, by_process
    return attempts


def random_updates(stores, tables, steps: int, seed: int = 0, n: int = 64, ids_below: int = 300) -> None:
    """``steps`` rounds of ``n`` random ids (below ``ids_below``) and standard-normal
    gradients per table of ``tables``, applied alike to every store of ``stores`` (a
    :class:`~tiered_emb.TieredStore` and a reference, say; None entries are skipped).
    Seeded: the same call makes the same updates."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for t in tables:
            ids = rng.integers(0, ids_below, n)
            g = rng.standard_normal((n, t.dim)).astype(np.float32)
            for s in stores:
                if s is not None:
                    s.apply_gradients(t.name, ids, g)


def flip_bit(path, table: str, row_id: int | None = None, region: str = "row") -> int:
    """Flip one bit in ``data.mdb`` of the store at ``path``: of the row of ``row_id`` of
    ``table`` (``region="row"``), of its id (``"ids"``), or in the middle of the first segment's
    compressed rows (``"compressed"``); returns the byte offset flipped."""
    import lmdb
    import numpy as np

    from tiered_emb.tiers.ssd import codec
    from tiered_emb.tiers.ssd.mapped import value_offset

    path = Path(path)
    env = lmdb.open(str(path / "lmdb"), max_dbs=16, readonly=True)
    at = -1
    with env.begin(buffers=True) as txn:
        for _, value in txn.cursor(db=env.open_db(b"p:" + table.encode(), txn=txn, create=False)):
            n = codec.SEGMENT_HEADER.unpack_from(value)[3]
            ids = np.frombuffer(value, "<i8", n, codec.SEGMENT_HEADER.size)
            start = value_offset(value, env.stat()["psize"])
            if start >= 0 and (row_id is None or row_id in ids):  # (a segment on pages of its own)
                k = 0 if row_id is None else int(np.searchsorted(ids, row_id))
                width = codec.SEGMENT_HEADER.unpack_from(value)[4]
                head = codec.SEGMENT_HEADER.size
                if region == "ids":
                    at = start + head + 8 * k + 1
                elif region == "compressed":
                    at = start + head + 8 * n + len(value[head + 8 * n :]) // 2
                else:
                    at = start + head + 8 * n + 4 * (width + 1) * k + 5
                break
    env.close()
    if at < 0:
        raise ValueError(f"no segment of table {table!r} on pages of its own holds that row")
    with open(path / "lmdb" / "data.mdb", "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    return at
