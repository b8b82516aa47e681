"""The checkpoint's walk over the cache tiers: every dirty row of HBM and DDR handed to the
SSD tier in chunks of a bounded size, and every row clean once they are written.

A flush or checkpoint holds one chunk at a time, whatever the tiers hold (the store's
``flush`` and ``checkpoint`` write each chunk before they take the next).
"""

from __future__ import annotations

import numpy as np

from tiered_emb._jit import move_rows
from tiered_emb._order import stable_argsort
from tiered_emb.step.resolve import Resolver


def dirty_chunks(res: Resolver, counts: dict[str, int]):
    """Every dirty row of HBM and DDR as ``{table: (ids, records)}`` chunks of about a
    quarter of the budget's bytes each, the first an eighth of that (tables in name order,
    HBM before DDR, slots in order, each piece of them in id order; small pieces share a
    chunk; the caller writes each before it takes the next: a flush or checkpoint holds
    one chunk, whatever the tiers hold); ``counts[table]`` adds up the rows yielded.

    Every chunk's records lie in one buffer of a quarter of the budget, gathered into
    again for the next chunk: memory touched once, not once a chunk (fresh pages are
    zeroed by the kernel, as long again as the gather itself)."""
    quarter = max(1, min(res.budget_bytes, 1 << 40) // 4)
    # The first chunk is an eighth of the others: its rows reach the disk while the next
    # are gathered, so the disk is not idle for a whole chunk's gather, sort and encoding.
    chunk = max(1, quarter // 8)
    widest = max((t.cfg.record_width for t in res.tables.values()), default=1)
    buf = np.empty(max(quarter // 4, widest), dtype=np.float32)  # (untouched pages cost nothing)
    parts: dict[str, list] = {}  # table -> [ids pieces, first word in buf, end]
    held = 0  # words of buf in parts
    res.descents.wait()
    for name, t in sorted(res.tables.items()):
        width = t.cfg.record_width
        for tier in (t.hbm, t.ddr):
            a = 0
            while a < tier.slot_ids.shape[0]:
                step = max(1, chunk // (4 * width))
                slots = a + np.flatnonzero((tier.dirty[a : a + step] != 0) & tier.held(a, a + step))
                a += step
                if not slots.shape[0]:
                    continue
                words = slots.shape[0] * width
                alone = 4 * words >= chunk // 2  # (large enough to be a chunk by itself)
                if parts and (alone or held + words > buf.shape[0]):
                    yield _chunk(res, parts, buf, counts)  # (those before it first: in order)
                    parts, held, chunk = {}, 0, quarter
                ids = tier.slot_ids[slots]
                # in id order, as segments hold them: a piece written alone is not sorted again
                order = stable_argsort(ids)
                slots = slots[order]
                out = buf[held : held + words].reshape(-1, width)
                if tier is t.hbm:
                    out[:] = t.hbm.rows_at(slots)
                else:
                    move_rows(tier.records, slots, out, None, width)
                part = parts.setdefault(name, [[], held, held])
                part[0].append(ids[order])
                part[2] = held = held + words
                if alone or 4 * held >= chunk:
                    yield _chunk(res, parts, buf, counts)
                    parts, held, chunk = {}, 0, quarter
    if parts:
        yield _chunk(res, parts, buf, counts)


def _chunk(res: Resolver, parts: dict[str, list], buf: np.ndarray, counts: dict[str, int]) -> dict:
    out = {}
    for name, (ids, a, b) in parts.items():
        counts[name] = counts.get(name, 0) + sum(x.shape[0] for x in ids)
        rows = buf[a:b].reshape(-1, res.tables[name].cfg.record_width)
        out[name] = (ids[0] if len(ids) == 1 else np.concatenate(ids), rows)
    return out


def written(res: Resolver, counts: dict[str, int]) -> None:
    """The rows of :func:`dirty_chunks` (``counts`` of each table) reached LMDB: every
    row is clean now."""
    res.descents.wait()
    flags = {id(tier.dirty): tier.dirty for t in res.tables.values() for tier in (t.hbm, t.ddr)}
    for dirty in flags.values():  # (a shared tier's once)
        dirty[:] = 0
    for name, n in counts.items():
        res.tables[name].counters["ssd"]["writebacks"] += n


__all__ = ["dirty_chunks", "written"]
