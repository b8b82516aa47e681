"""A one-line progress bar on stderr, shared by the apps and the simulator's benchmarks.

It lives apart from both so that :mod:`tiered_emb.sim` can draw it without importing the
apps, which import the store (the simulator stands alone: DESIGN.md, "Layout").
"""

from __future__ import annotations

import sys
import time


def progress(i: int, n: int, t0: float, extra: str = "", width: int = 30, stream=None) -> None:
    """One-line progress bar (rewritten in place): ``i`` of ``n`` done since ``t0``
    (a :func:`time.perf_counter` reading), then ``extra``; a newline once ``i >= n``.
    ``stream``: standard error by default.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()
    >>> progress(2, 4, time.perf_counter(), "steps", width=4, stream=out)
    >>> out.getvalue().startswith("\\r[##..] 2/4 ")
    True
    """
    stream = sys.stderr if stream is None else stream  # looked up now: it may have been replaced since import
    done = int(width * i / max(n, 1))
    rate = i / max(time.perf_counter() - t0, 1e-9)
    stream.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {rate:,.1f}/s {extra}")
    if i >= n:
        stream.write("\n")
    stream.flush()
