"""Slow, obviously-right references and helpers for tests (no Numba in the references)."""
from __future__ import annotations

import os


def crash(store) -> None:
    """Drop ``store`` as a killed process would: nothing flushed, no checkpoint; the LMDB
    environment and the writer lock are released so the same process can reopen it."""
    store._prefetcher.close()
    store._closed = True
    store._ssd.close()
    os.close(store._lock_fd)
