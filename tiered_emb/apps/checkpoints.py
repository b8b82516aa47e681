"""Checkpoints on a schedule, for the jobs (``tiered-emb stream`` and ``tiered-emb train``).

``--checkpoint-every N`` takes a checkpoint every N steps (0: none on the way) and the
job takes one at the end whatever N is; each leaves a record in the job's report: the
step, the seconds it took and the rows it wrote.  A checkpoint is a durable point a run
can be resumed from (where the job resumes); how often is a trade of the work a crash
loses against the time and the disk writes each one costs.
"""

from __future__ import annotations

import time
from typing import Any


def checkpoint_due(done: int, every: int, steps: int) -> bool:
    """Whether a scheduled checkpoint follows once ``done`` steps of a run of ``steps`` are
    done: every ``every`` steps (0: never), and never after the last step, whose checkpoint
    the job takes anyway.

    >>> [done for done in range(1, 8) if checkpoint_due(done, every=3, steps=7)]
    [3, 6]
    >>> [done for done in range(1, 7) if checkpoint_due(done, every=3, steps=6)]
    [3]
    """
    return every > 0 and done % every == 0 and done < steps


def timed_checkpoint(store: Any, step: int, extra: bytes | None = None) -> dict[str, Any]:
    """``store.checkpoint(extra)`` and its record for the report: ``{"step": step,
    "seconds": float, "rows_written": int}``.  The seconds differ from run to run, so they
    go to the report only, never into ``extra`` or the rows (which are bitwise reproducible)."""
    t0 = time.perf_counter()
    store.checkpoint(extra)
    rows_written = store.engine.last_checkpoint_rows
    return {"step": step, "seconds": time.perf_counter() - t0, "rows_written": rows_written}


def format_checkpoints(records: list[dict[str, Any]]) -> str:
    """One line on the checkpoints of a run's :func:`timed_checkpoint` records."""
    if not records:
        return "no checkpoint"
    steps = ", ".join(str(r["step"]) for r in records[:3]) + (", ..." if len(records) > 4 else "")
    if len(records) > 3:
        steps += f", {records[-1]['step']}"
    seconds = sum(r["seconds"] for r in records)
    rows = sum(r["rows_written"] for r in records)
    return f"checkpoints {len(records)} (steps {steps}) in {seconds:.2f} s, {rows:,} rows written"
