"""Policy benchmarks: run policies x cache sizes over a trace, time them, tabulate, plot.

The machinery behind ``tiered-emb bench policies`` / ``bench mrc`` and
``bench/bench_policies.py``.  Timings are medians of ``repeats`` runs of
:func:`tiered_emb.sim.simulate` (the trace is built once, outside the timer; inside it:
the id range, the index, the kernel, and for Belady its next-use pass, which libCacheSim
instead reads from the trace file).  With a peer engine (libCacheSim), each of our runs is
followed at once by the peer's run of the same policy and size, and the speedup is the
median of the per-pair ratios: on a shared machine the load drifts, and a pair sees the
same load.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from tiered_emb._args import as_ids, int_arg, parse_count
from tiered_emb._options import STDOUT, print_json
from tiered_emb._progress import progress_bar
from tiered_emb.errors import ConfigError, MissingExtraError, TraceFileError
from tiered_emb.sim import traces
from tiered_emb.sim.compare import libcachesim_hashpower
from tiered_emb.sim.engine import check_policy, simulate
from tiered_emb.sim.mrc import lru_curve, opt_curve

#: The trace specs that read a file (``KIND:PATH``); the others are synthetic.
FILE_TRACES = ("npy", "csv", "tsv", "txt", "criteo", "oracle")


def parse_sizes(text: str, universe: int) -> list[tuple[str, int]]:
    """Cache sizes ``"0.1%,1%,10%,5000"``: percentages of ``universe`` ids, or object counts.

    A percentage must be positive and finite; one that rounds to no object gives one.
    Counts must be >= 1.  Sizes above the trace's length run as that length (the same hits).
    """
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if part.endswith("%"):
            try:
                frac = float(part[:-1]) / 100.0
            except ValueError:
                raise ConfigError(f"bad cache size {part!r}", "write e.g. 1% or 5000") from None
            if not (math.isfinite(frac) and frac > 0):
                raise ConfigError(f"cache size {part!r} is not a positive percentage", "write e.g. 0.1% or 10%")
            n = max(1, round(universe * frac))  # a positive percentage is at least one object
        else:
            n = parse_count(part)
        if n < 1:
            raise ConfigError(f"cache size {part!r} is below one object", "give a positive size")
        out.append((part, n))
    if not out:
        raise ConfigError(f"no cache size in {text!r}", "write e.g. --cache 0.1%,1%,10%")
    return out


def load_trace(
    spec: str,
    ids: int,
    requests: int,
    seed: int,
    *,
    drift_period: int = 1_000_000,
    batch: int = 512,
    pooling: str = "1",
) -> tuple[np.ndarray, int, str]:
    """Build or read the trace of ``spec``; returns ``(trace, universe, description)``.

    Specs: ``zipf:ALPHA``, ``drift:ALPHA`` (ranking moves every ``drift_period``),
    ``tables:A1,A2,...`` (one table per skew, ``batch`` x ``pooling`` ids per table per
    batch), ``npy:PATH``, ``csv:PATH[:COL]``, ``tsv:PATH[:COL]``, ``txt:PATH[:COL]``
    (whitespace-separated), ``criteo:PATH``, ``oracle:PATH`` (libCacheSim oracleGeneral).
    ``universe`` is ``ids`` for synthetic traces (cache percentages refer to it), the number
    of distinct ids for files.  ``requests`` (>= 0) is the length of a synthetic trace
    (>= 1) and a cap for a file (0: all of it); a file with no ids is a :class:`TraceFileError`.
    """
    kind, _, rest = str(spec).partition(":")
    kind = kind.lower()
    if requests < 0:
        raise ConfigError(
            f"requests={requests} is negative", "give a number of requests >= 0 (for a file, 0 reads it all)"
        )
    if kind in ("zipf", "drift", "tables"):
        try:
            alphas = [float(a) for a in (rest or "1.0").split(",")]
        except ValueError:
            raise ConfigError(f"bad skew in trace {spec!r}", "write e.g. zipf:1.0 or tables:1.2,0.9") from None
        if not all(math.isfinite(a) and a >= 0 for a in alphas):
            raise ConfigError(
                f"bad skew in trace {spec!r}: skews are finite and >= 0", "write e.g. zipf:1.0 or tables:1.2,0.9"
            )
        if ids < 1:
            raise ConfigError(f"ids={ids} is invalid for trace {spec!r}", "give at least 1 id, e.g. --ids 1M")
        if requests < 1:
            raise ConfigError(
                f"requests={requests} is invalid for trace {spec!r}", "give at least 1 request, e.g. --requests 2M"
            )
        if kind == "zipf":
            return traces.zipf_ids(ids, alphas[0], requests, seed), ids, f"Zipf({alphas[0]}) over {ids:,} ids"
        if kind == "drift":
            return (
                traces.drift_ids(ids, alphas[0], requests, seed, period=drift_period),
                ids,
                f"drifting Zipf({alphas[0]}) over {ids:,} ids, moving every {drift_period:,}",
            )
        try:
            pf = [int(p) for p in str(pooling).split(",")]
        except ValueError:
            raise ConfigError(
                f"bad pooling {pooling!r}", "write one count of ids per sample, or one per table: 1 or 2,1"
            ) from None
        pf = pf * len(alphas) if len(pf) == 1 else pf
        if len(pf) != len(alphas) or min(pf) < 1:
            raise ConfigError(
                f"pooling {pooling!r} is invalid for {len(alphas)} tables", "give one count >= 1, or one per table"
            )
        if batch < 1:
            raise ConfigError(f"batch={batch} is invalid", "give at least 1 sample per batch")
        per_batch = batch * sum(pf)
        n_batches = max(1, requests // per_batch)
        tr = traces.table_batches([ids] * len(alphas), alphas, batch, pf, n_batches, seed)
        return tr, ids * len(alphas), f"{len(alphas)} tables (skews {alphas}), batch {batch}, pooling {pf}"
    if kind in FILE_TRACES:
        path, col = rest, 0
        if kind in ("csv", "tsv", "txt") and ":" in rest:
            head, _, tail = rest.rpartition(":")
            if tail.isdigit():
                path, col = head, int(tail)
        if kind == "npy":
            tr = traces.read_npy(path)
        elif kind == "criteo":
            tr = traces.read_criteo(path)
        elif kind == "oracle":
            tr = traces.read_oracle_general(path)
        else:
            delim = {"csv": ",", "tsv": "\t", "txt": None}[kind]
            tr = traces.read_column(path, col, delimiter=delim)
        if requests and requests < tr.shape[0]:
            tr = tr[:requests]
        if tr.shape[0] == 0:
            raise TraceFileError(f"trace file {path!r} holds no ids", "check the file and the column")
        tr = np.ascontiguousarray(tr)
        return tr, int(np.unique(tr).shape[0]), f"{kind} file {Path(path).name}"
    raise ConfigError(
        f"unknown trace {spec!r}",
        "use zipf:ALPHA, drift:ALPHA, tables:A1,A2, npy:PATH, csv:PATH[:COL], "
        "tsv:PATH[:COL], txt:PATH[:COL], criteo:PATH or oracle:PATH",
    )


def machine_info() -> dict:
    """Machine, versions: what a result needs to be compared with another."""
    import numba

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__}
    try:
        from importlib.metadata import version

        versions["tiered_emb"] = version("tiered-emb")
    except Exception:  # not installed as a distribution
        versions["tiered_emb"] = "unknown"
    try:
        from importlib.metadata import version

        versions["libcachesim"] = version("libcachesim")
    except Exception:
        versions["libcachesim"] = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "loadavg": load, "versions": versions}


def _warm_up(policies: list[str]) -> None:
    """Compile (or load from cache) every kernel before anything is timed."""
    tiny = np.array([1, 2, 1, 3, 1, 2, 4, 5], dtype=np.int64)
    for p in policies:
        simulate(tiny, 2, p)


def run_policies(
    trace: np.ndarray,
    sizes: list[tuple[str, int]],
    policies: list[str],
    repeats: int = 3,
    show_progress: bool = True,
    peer=None,
) -> list[dict]:
    """Hits and medians of time for each policy and size; one dict per pair (and engine).

    ``peer``, optional, is a callable ``(policy, capacity) -> (seconds, hits)`` or None
    (no such policy there) that runs another engine, e.g.
    :func:`tiered_emb.sim.compare.libcachesim_peer`; it runs right after each of ours, and
    our row gets ``speedups`` (peer seconds / ours, per pair) and their median.
    """
    if not policies:
        raise ConfigError("no policy to run", "give at least one, e.g. --policies lru,belady")
    for p in policies:
        check_policy(p)
    repeats = int_arg("repeats", repeats, 1, hint="give at least 1 run per measurement")
    _check_sizes(sizes)
    _warm_up(policies)
    n = int(trace.shape[0])
    rows = []
    with progress_bar(len(policies) * len(sizes) * repeats, "runs", quiet=not show_progress) as bar:
        for p in policies:
            for label, cap in sizes:
                secs, hits, peer_secs, peer_hits = [], None, [], None
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    h = simulate(trace, cap, p)
                    secs.append(time.perf_counter() - t0)
                    if hits is not None and h != hits:  # a kernel must be deterministic
                        raise RuntimeError(f"{p} gave {h} then {hits} hits on the same trace")
                    hits = h
                    got = peer(p, cap) if peer is not None else None
                    if got is not None:
                        if peer_hits is not None and got[1] != peer_hits:
                            raise RuntimeError(f"the peer's {p} gave {got[1]} then {peer_hits} hits on the same trace")
                        peer_secs.append(got[0])
                        peer_hits = got[1]
                    bar.set_postfix_str(f"{p}, {label}", refresh=False)
                    bar.update(1)
                row = _result("tiered_emb", p, label, cap, hits, n, secs)
                if check_policy(p).offline:
                    row["includes_next_use"] = True
                rows.append(row)
                if peer_secs:
                    row["speedups"] = [b / a for a, b in zip(secs, peer_secs, strict=False)]
                    row["speedup_median"] = statistics.median(row["speedups"])
                    peer_row = _result("libcachesim", p, label, cap, peer_hits, n, peer_secs)
                    peer_row["hashpower"] = libcachesim_hashpower(cap, getattr(peer, "table", "sized"))
                    peer_row["same_hits"] = peer_hits == hits
                    rows.append(peer_row)
    return rows


def _result(engine: str, policy: str, label: str, cap: int, hits: int, n: int, secs: list) -> dict:
    """One row of :func:`run_policies`: an engine's hits and timings of ``policy`` at one size."""
    med = statistics.median(secs)
    return {
        "engine": engine,
        "policy": policy,
        "cache": label,
        "cache_objects": cap,
        "hits": hits,
        "requests": n,
        "hit_ratio": hits / max(n, 1),
        "seconds": secs,
        "median_s": med,
        "mreq_per_s": n / med / 1e6,
    }


def run_mrc(
    trace: np.ndarray, sizes: list[tuple[str, int]], repeats: int = 3, opt: bool = True, show_progress: bool = True
) -> dict:
    """The one-pass LRU curve (timed, median of ``repeats``), Belady at ``sizes``, and one LRU
    run at the median size for the time comparison, right after each curve (the ratio is the
    median of the per-pair ratios)."""
    repeats = int_arg("repeats", repeats, 1, hint="give at least 1 run per measurement")
    _check_sizes(sizes)
    trace = as_ids(trace)
    _warm_up(["lru"])
    lru_curve(trace[:16])
    mid = sizes[len(sizes) // 2]
    secs, one, curve = [], [], None
    with progress_bar(repeats, "LRU curves", quiet=not show_progress) as bar:
        for _ in range(repeats):
            t0 = time.perf_counter()
            curve = lru_curve(trace)
            secs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            h = simulate(trace, mid[1], "lru")
            one.append(time.perf_counter() - t0)
            bar.update(1)
    if h != int(curve.hits[min(mid[1], curve.distinct_ids)]):
        raise RuntimeError("the LRU curve disagrees with the LRU simulation")  # tested; never expected
    caps = [c for _, c in sizes]
    out = {
        "requests": int(trace.shape[0]),
        "distinct_ids": curve.distinct_ids,
        "lru_curve_seconds": secs,
        "lru_curve_median_s": statistics.median(secs),
        "one_lru_run": {"cache": mid[0], "cache_objects": mid[1], "seconds": one, "median_s": statistics.median(one)},
        "curve_over_one_lru_median": statistics.median(a / b for a, b in zip(secs, one, strict=False)),
        "sizes": [
            {"cache": lab, "cache_objects": c, "lru_hit_ratio": float(curve.hit_ratio[min(c, curve.distinct_ids)])}
            for lab, c in sizes
        ],
        "lru_curve_sampled": _sample_curve(curve),
    }
    if opt:
        t0 = time.perf_counter()
        oc = opt_curve(trace, caps)
        out["opt_seconds"] = time.perf_counter() - t0
        for row, hits in zip(out["sizes"], oc.at([c for _, c in sizes]), strict=False):
            row["opt_hit_ratio"] = float(hits / max(oc.requests, 1))
    return out


def _sample_curve(curve, points: int = 200) -> dict:
    """The LRU curve at ``points`` log-spaced sizes (the full curve has one entry per id)."""
    top = max(curve.distinct_ids, 1)
    sizes = np.unique(np.geomspace(1, top, points).astype(np.int64))
    sizes = sizes[sizes <= curve.distinct_ids]  # none for an empty trace
    return {"cache_objects": sizes.tolist(), "hit_ratio": curve.hit_ratio[sizes].tolist()}


def format_table(rows: list[dict]) -> str:
    """Hit ratio and M requests/s per policy and size; libCacheSim's beside ours when present,
    with the speedup as the median of per-pair ratios where the runs were paired."""
    ours = [r for r in rows if r["engine"] == "tiered_emb"]
    theirs = {(r["policy"], r["cache_objects"]): r for r in rows if r["engine"] == "libcachesim"}
    head = f"{'policy':<10} {'cache':>8} {'objects':>10} {'hit ratio':>9} {'Mreq/s':>7}"
    if theirs:
        head += f" | {'libCacheSim':>11} {'Mreq/s':>7} {'speedup':>7} {'same hits':>9}"
    lines = [head, "-" * len(head)]
    for r in ours:
        line = (
            f"{r['policy']:<10} {r['cache']:>8} {r['cache_objects']:>10,} {r['hit_ratio']:>9.4f} "
            f"{r['mreq_per_s']:>7.1f}"
        )
        t = theirs.get((r["policy"], r["cache_objects"]))
        if t is not None:
            speedup = r.get("speedup_median", r["mreq_per_s"] / t["mreq_per_s"])
            line += (
                f" | {t['hit_ratio']:>11.4f} {t['mreq_per_s']:>7.1f} "
                f"{speedup:>6.1f}x {('yes' if t['hits'] == r['hits'] else 'no'):>9}"
            )
        elif theirs:
            line += f" | {'-':>11} {'-':>7} {'-':>7} {'-':>9}"
        lines.append(line)
    return "\n".join(lines)


def _check_sizes(sizes) -> None:
    if not sizes:
        raise ConfigError("no cache size", "give at least one, e.g. --cache 0.1%,1%,10%")
    for label, cap in sizes:
        int_arg(f"cache size {label!r}", cap, 1, hint="give a cache of at least 1 object")


def check_output(path, flag: str) -> None:
    """A :class:`ConfigError` now, not after the run, when ``path`` cannot be written:
    a directory, or under something that is not a writable directory (what does not exist
    yet is created at the end)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {str(p)!r} is a directory", f"give {flag} a file name")
    a = p.parent
    while not a.exists() and a != a.parent:
        a = a.parent
    if not a.is_dir() or not os.access(a, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {str(p)!r} cannot be written ({str(a)!r} is not a writable directory)",
            f"give {flag} a path in a writable directory",
        )


def _write(path: Path, write, flag: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except (OSError, ValueError) as err:  # ValueError: an image format matplotlib does not know
        raise ConfigError(
            f"cannot write {flag} {str(path)!r}: {getattr(err, 'strerror', None) or err}",
            f"give {flag} a path in a writable directory",
        ) from None


def write_json(path, payload: dict) -> None:
    text = json.dumps(payload, indent=1) + "\n"
    _write(Path(path), lambda p: p.write_text(text, encoding="utf-8"), "--json")


def emit_json(json_arg: str | None, payload: dict) -> bool:
    """A command's results as ``--json`` asks: alone on stdout (``--json`` bare: True, the
    caller prints nothing else), or into the file it names; False but for the bare flag."""
    if json_arg == STDOUT:
        print_json(payload)
        return True
    if json_arg:
        write_json(json_arg, payload)
    return False


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MissingExtraError(
            "plotting needs matplotlib, which is not installed", "pip install 'tiered-emb[bench]' (or drop --plot)"
        ) from err
    return plt


def plot_policies(rows: list[dict], path, title: str, mrc: dict | None = None) -> None:
    """Hit ratio against cache size (log x), one line per policy (ours; libCacheSim dashed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if mrc is not None:
        s = mrc["lru_curve_sampled"]
        ax.plot(s["cache_objects"], s["hit_ratio"], color="0.6", lw=1, label="LRU (exact curve)")
    for engine, marker in (("tiered_emb", "o"), ("libcachesim", "x")):
        sel = [r for r in rows if r["engine"] == engine]
        for p in dict.fromkeys(r["policy"] for r in sel):
            pts = sorted((r["cache_objects"], r["hit_ratio"]) for r in sel if r["policy"] == p)
            label = p if engine == "tiered_emb" else f"{p} (libCacheSim)"
            ax.plot(
                [a for a, _ in pts],
                [b for _, b in pts],
                marker=marker,
                ms=4,
                label=label,
                ls="-" if engine == "tiered_emb" else "none",
            )
    ax.set_xscale("log")
    ax.set_xlabel("cache size (objects)")
    ax.set_ylabel("hit ratio")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    try:
        _write(Path(path), lambda p: fig.savefig(p, dpi=120), "--plot")
    finally:
        plt.close(fig)


def plot_mrc(mrc: dict, path, title: str) -> None:
    """Miss ratio against cache size: the exact LRU curve and Belady at the measured sizes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    s = mrc["lru_curve_sampled"]
    ax.plot(s["cache_objects"], 1 - np.asarray(s["hit_ratio"]), label="LRU (one pass, every size)")
    opt = [(r["cache_objects"], 1 - r["opt_hit_ratio"]) for r in mrc["sizes"] if "opt_hit_ratio" in r]
    if opt:
        ax.plot([a for a, _ in opt], [b for _, b in opt], "o--", label="Belady (OPT)")
    ax.set_xscale("log")
    ax.set_xlabel("cache size (objects)")
    ax.set_ylabel("miss ratio")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        _write(Path(path), lambda p: fig.savefig(p, dpi=120), "--plot")
    finally:
        plt.close(fig)
