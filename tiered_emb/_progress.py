"""The progress bar of the commands' long loops (tqdm), shared by the apps and the simulator.

It lives apart from both so that :mod:`tiered_emb.sim` can draw it without importing the
apps, which import the store (the simulator stands alone: DESIGN.md, "Layout").

The bar goes to standard error, with a rate and an ETA, and only when standard error is a
terminal: redirected to a file or a pipe (a log, CI), it writes nothing at all, so no
``\\r``-rewritten lines end up in the log.  ``--quiet`` turns it off everywhere.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


def progress_bar(total: int, unit: str, quiet: bool = False, stream: TextIO | None = None) -> Any:
    """A :class:`tqdm.tqdm` bar for ``total`` ``unit``s (use it as a context manager, then
    ``bar.update(n)`` and ``bar.set_postfix_str(text)``): on ``stream`` (standard error by
    default), off when ``quiet`` or when ``stream`` is not a terminal.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()  # not a terminal: no bar, nothing written
    >>> with progress_bar(4, "steps", stream=out) as bar:
    ...     bar.update(4)
    >>> out.getvalue()
    ''
    """
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream  # looked up now: it may have been replaced since import
    # disable=None: tqdm draws only on a terminal
    return tqdm(total=total, unit=unit, file=stream, disable=True if quiet else None, dynamic_ncols=True, leave=True)
