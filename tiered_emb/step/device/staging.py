"""A launch's host index arrays sent to the GPU in one copy, through page-locked buffers.

Each kernel launch of the step takes a few host arrays (slots, positions, offsets, the
reduce's grouping, the optimizer's parameters).  Copied one by one from pageable memory
each is a synchronous ``cudaMemcpy`` through the driver's own bounce buffer, a sizeable
part of a resident step (figures: docs/gpu.md).  :class:`Stager`
packs them into one page-locked buffer and issues one asynchronous copy on the current
stream, so the host goes on while the bytes travel.

A buffer is reused only after the event recorded behind its copy has completed; a ring of
them lets the host pack the next launch's arrays while the last copy is in flight.
"""

from __future__ import annotations

import threading

import numpy as np

_ALIGN = 256  # every array starts on a 256-byte boundary: any dtype's view of the device bytes is aligned
_RING = 4


class _Buffer:
    def __init__(self, cupy, nbytes: int):
        self.mem = cupy.cuda.alloc_pinned_memory(nbytes)
        self.host = np.frombuffer(self.mem, dtype=np.uint8, count=nbytes)
        self.event = None  # recorded behind the last copy out of it


class Stager:
    """Host arrays to the device of ``cupy``'s current stream, one page-locked copy per call."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.buffers: list[_Buffer | None] = [None] * _RING
        self.turn = 0
        self.lock = threading.Lock()  # the trainer and a prefetch thread may both launch

    def put(self, arrays: list[tuple[np.ndarray, np.dtype]]) -> list:
        """Device copies of ``arrays`` (host array, dtype to send it as), in order."""
        cupy = self.cupy
        spans, total = [], 0
        for a, dtype in arrays:
            nbytes = a.size * np.dtype(dtype).itemsize
            spans.append((total, nbytes))
            total += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        stream = cupy.cuda.get_current_stream()
        with self.lock:
            buf = self._buffer(total)
            for (a, dtype), (start, nbytes) in zip(arrays, spans, strict=True):
                buf.host[start : start + nbytes].view(dtype).reshape(a.shape)[...] = a
            dev = cupy.empty(total, dtype=cupy.uint8)
            dev.data.copy_from_host_async(buf.mem.ptr, total, stream)
            buf.event = stream.record()
        return [
            dev[start : start + nbytes].view(dtype).reshape(a.shape)
            for (a, dtype), (start, nbytes) in zip(arrays, spans, strict=True)
        ]

    def _buffer(self, nbytes: int) -> _Buffer:
        """The ring's next buffer, its last copy complete, at least ``nbytes`` long."""
        i = self.turn
        self.turn = (i + 1) % _RING
        buf = self.buffers[i]
        if buf is not None and buf.event is not None:
            buf.event.synchronize()
        if buf is None or buf.host.shape[0] < nbytes:
            buf = _Buffer(self.cupy, max(nbytes, 2 * (buf.host.shape[0] if buf else 0), 1 << 20))
            self.buffers[i] = buf
        return buf


__all__ = ["Stager"]
