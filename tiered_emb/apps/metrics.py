"""Metrics of the DLRM job: model quality (log loss, AUC), the tiers' counters summed over
tables, and the CPU time each thread (and the SSD tier's writer process) spent a step."""

from __future__ import annotations

import os
import threading

import numpy as np


# --------------------------------------------------------------------------- metrics
def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of ``probs`` (clipped to [1e-7, 1 - 1e-7])."""
    p = np.clip(probs.astype(np.float64), 1e-7, 1 - 1e-7)
    y = labels.astype(np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (rank statistic, ties averaged); 0.5 when one class is missing.

    >>> auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    0.75
    """
    y = labels.astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    order = np.argsort(scores, kind="stable")
    s = scores[order]
    ranks = np.empty(s.shape[0], dtype=np.float64)
    i = 0
    while i < s.shape[0]:  # average ranks over ties
        j = i
        while j + 1 < s.shape[0] and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    r = np.empty_like(ranks)
    r[order] = ranks
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def aggregate_stats(stats: dict) -> dict:
    """Per-tier counters summed over every table of ``store.stats()``, hit rates recomputed."""
    total = {}
    for s in stats.values():
        for tier in ("hbm", "ddr", "ssd"):
            t = total.setdefault(tier, {})
            for k, v in s[tier].items():
                if k != "hit_rate" and isinstance(v, (int, float)):
                    t[k] = t.get(k, 0) + v
    for c in total.values():
        c["hit_rate"] = c["hits"] / c["lookups"] if c.get("lookups") else 0.0
    return total


def proc_cpu_s(stat_path: str) -> float | None:
    """CPU seconds (user + system) of a thread or process from its ``/proc/.../stat``."""
    try:
        with open(stat_path) as f:
            stat = f.read()
    except OSError:
        return None  # ended meanwhile
    fields = stat[stat.rindex(")") + 2 :].split()  # utime and stime: fields 14 and 15 of stat
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(store=None) -> tuple[float, dict[int, float], float] | None:
    """``(process CPU seconds, {native thread id: CPU seconds}, CPU seconds of the store's
    LMDB writer process)`` from ``/proc`` (Linux; None elsewhere)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    threads = {}
    for tid in tids:
        cpu = proc_cpu_s(f"/proc/self/task/{tid}/stat")
        if cpu is not None:
            threads[int(tid)] = cpu
    t = os.times()
    writer = store.engine.ssd.writer_pid() if store is not None else None
    return t.user + t.system, threads, (proc_cpu_s(f"/proc/{writer}/stat") or 0.0) if writer else 0.0


def thread_cpu_per_step(before, after, steps: int) -> dict[str, float] | None:
    """CPU milliseconds a step of each thread between two :func:`thread_cpu_s`, by thread
    name (``main``; the store's ``tiered_emb-prefetch``; ``other native threads``: torch's
    and Numba's pools; ``ended threads``: those gone by the end, the write-back writers
    among them; ``writer process``: the store's LMDB writer, a process of its own, started
    at the first write-back).  Why: on a host with few cores the step, the lookahead thread
    and the writer share them, and these shares say which one a run waits on (docs/tuning.md)."""
    if before is None or after is None or steps <= 0:
        return None

    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "main"
    out: dict[str, float] = {}
    for tid, cpu in sorted(after[1].items()):
        name = names.get(tid, "other native threads")
        out[name] = out.get(name, 0.0) + cpu - before[1].get(tid, 0.0)
    out["ended threads"] = max(after[0] - before[0] - sum(out.values()), 0.0)
    out["writer process"] = max(after[2] - before[2], 0.0)  # (0 before its first write: not started)
    return {name: round(1e3 * cpu / steps, 2) for name, cpu in sorted(out.items())}
