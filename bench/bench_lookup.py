"""Lookup throughput of TieredStore against ``numpy.take``, and the Numba policy kernels alone.

Command (the figures in docs/benchmarks.md)::

    python bench/bench_lookup.py --json bench/results/lookup.json

Workload: batches of 65,536 Zipf(1.05) ids over 10M ids, dim 64 and 128.

- *resident*: HBM holds every row the batches touch; two peers, with the same ids:
  ``numpy.take`` on a plain (10M, dim) float32 array holding the same rows (the hot rows
  scattered over the table, as a full embedding table holds them), and ``numpy.take`` on
  a *compact* array of only the touched rows through an id -> row map (the map's lookup
  timed too), which is what our HBM is: a packed cache of the touched rows.  Ours gathers
  on Numba's threads (all cores), numpy on one.  Timed in pairs (ours, then the peer,
  per repeat); ratios are medians of the per-pair ratios.
- *hbm 10% / 1%*: HBM holds 10% / 1% of the touched rows, DDR the rest (rows move
  HBM <-> DDR every batch); reported relative to resident.
- *policy kernels*: the decisions of each store policy (LRU, LFU, FIFO, CLOCK, SIEVE) on a
  20M-request Zipf(1.05) trace over 10M ids with a cache of 1% of the ids, one request at
  a time (index probe + policy update); libCacheSim's LRU on the same trace when it is
  installed.

Medians of ``--repeats`` runs; ratios are ours / peer (higher is better for us).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, timed, write_json

from tiered_emb import TableConfig, TierConfig, TieredStore
from tiered_emb.cache.policies import BASE_POLICIES
from tiered_emb.cache.slots import simulate
from tiered_emb.sim.compare import libcachesim_hashpower
from tiered_emb.sim.traces import zipf_ids


def bench_dim(dim: int, n_ids: int, batch: int, n_batches: int, repeats: int, seed: int) -> dict:
    batches = [zipf_ids(n_ids, 1.05, batch, seed=seed + b) for b in range(n_batches)]
    touched = np.unique(np.concatenate(batches))
    plain = np.empty((n_ids, dim), dtype=np.float32)
    res = {"dim": dim, "touched_rows": int(touched.shape[0])}
    with tempfile.TemporaryDirectory() as d:
        tcfg = [TableConfig("t", dim=dim, num_rows=n_ids)]
        with TieredStore.create(Path(d) / "r", tcfg, TierConfig(hbm_rows=int(touched.shape[0]), device="cpu")) as s:
            plain[touched] = s.peek("t", touched)
            for b in batches:
                s.lookup("t", b)
            assert np.array_equal(s.lookup("t", batches[0]), np.take(plain, batches[0], axis=0))

            def ours():
                for b in batches:
                    s.lookup("t", b)

            def peer():
                for b in batches:
                    np.take(plain, b, axis=0)  # noqa: F821 (deleted below, once the timings are done)

            compact = np.ascontiguousarray(plain[touched])
            row_of = np.full(n_ids, -1, dtype=np.int64)
            row_of[touched] = np.arange(touched.shape[0])
            assert np.array_equal(
                np.take(compact, np.take(row_of, batches[0]), axis=0), np.take(plain, batches[0], axis=0)
            )

            def peer_compact():
                for b in batches:
                    np.take(compact, np.take(row_of, b), axis=0)  # noqa: F821 (deleted below, as above)

            rows = batch * n_batches
            pairs = _paired(ours, (peer, peer_compact), repeats)
            t_ours = [rows / x[0] for x in pairs]
            res["resident_rows_per_s"] = median(t_ours)
            res["numpy_take_rows_per_s"] = median([rows / x[1] for x in pairs])
            res["numpy_take_compact_rows_per_s"] = median([rows / x[2] for x in pairs])
            res["resident_vs_take"] = median([x[1] / x[0] for x in pairs])
            res["resident_vs_take_compact"] = median([x[2] / x[0] for x in pairs])
            res["seconds_ours_take_compact"] = pairs
            assert s.stats()["t"]["hbm"]["misses"] == touched.shape[0]
            del compact, row_of
        for frac in (0.10, 0.01):
            hbm = max(1, int(frac * touched.shape[0]))
            tiers = TierConfig(hbm_rows=hbm, ddr_rows=int(touched.shape[0]), device="cpu")
            with TieredStore.create(Path(d) / f"h{frac}", tcfg, tiers) as s:

                def ours_small():
                    for b in batches:
                        s.lookup("t", b)

                t = [rows / x for x in timed(ours_small, repeats)]
                st = s.stats()["t"]
                res[f"hbm{int(frac * 100)}pct_rows_per_s"] = median(t)
                res[f"hbm{int(frac * 100)}pct_vs_resident"] = median(t) / res["resident_rows_per_s"]
                res[f"hbm{int(frac * 100)}pct_hbm_hit_rate"] = st["hbm"]["hit_rate"]
    del plain
    return res


def _paired(ours, peers, repeats: int) -> list[list[float]]:
    """Seconds of ``ours`` and each of ``peers`` (a warm-up call each first), one after the
    other in each of ``repeats`` rounds, so a busy moment of the machine hits a pair alike."""
    for fn in (ours, *peers):
        fn()
    out = []
    for _ in range(repeats):
        row = []
        for fn in (ours, *peers):
            t0 = time.perf_counter()
            fn()
            row.append(time.perf_counter() - t0)
        out.append(row)
    return out


#: The store's policies, each timed through its own kernel one request at a time.
STORE_POLICIES = BASE_POLICIES


def bench_policies(n_ids: int, requests: int, cache_frac: float, repeats: int, seed: int) -> dict:
    trace = zipf_ids(n_ids, 1.05, requests, seed=seed)
    cap = int(cache_frac * n_ids)
    out = {"requests": requests, "cache_rows": cap}
    for policy in STORE_POLICIES:
        hits = simulate(trace[:1000], cap, policy)  # compile
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            hits = simulate(trace, cap, policy)
            ts.append(time.perf_counter() - t0)
        out[policy] = {"decisions_per_s": requests / median(ts), "hit_ratio": hits / requests}
    try:
        import libcachesim as lcs
    except ImportError:
        return out
    out["libcachesim"] = _libcachesim_lru(lcs, trace, cap)
    out["lru_vs_libcachesim"] = out["lru"]["decisions_per_s"] / out["libcachesim"]["requests_per_s"]
    return out


def _libcachesim_lru(lcs, trace: np.ndarray, cap: int) -> dict:
    """libCacheSim's C LRU through its Python binding, fed the same trace as an oracleGeneral file."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.oracleGeneral.bin"
        rec = np.zeros(trace.shape[0], dtype=[("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
        rec["id"] = trace
        rec["size"] = 1
        rec["t"] = np.arange(trace.shape[0]) // 1000
        rec["next"] = -1
        rec.tofile(path)
        reader = lcs.TraceReader(trace=str(path), trace_type=lcs.TraceType.ORACLE_GENERAL_TRACE)
        cache = lcs.LRU(cache_size=cap, hashpower=libcachesim_hashpower(cap))
        t0 = time.perf_counter()
        miss_ratio, _ = cache.process_trace(reader)
        dt = time.perf_counter() - t0
    return {"requests_per_s": trace.shape[0] / dt, "hit_ratio": 1.0 - float(miss_ratio)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ids", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--dims", default="64,128")
    p.add_argument("--requests", type=int, default=20_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench/results/lookup.json")
    a = p.parse_args(argv)
    result = {"machine": machine(), "seed": a.seed, "args": vars(a), "lookup": [], "policies": None}
    for dim in [int(x) for x in a.dims.split(",")]:
        r = bench_dim(dim, a.ids, a.batch, a.batches, a.repeats, a.seed)
        result["lookup"].append(r)
        print(
            f"dim {dim:>4}: resident {r['resident_rows_per_s'] / 1e6:7.1f} M rows/s  numpy.take "
            f"{r['numpy_take_rows_per_s'] / 1e6:7.1f} M rows/s  ratio {r['resident_vs_take']:.2f}x, "
            f"compact {r['numpy_take_compact_rows_per_s'] / 1e6:7.1f} M rows/s ratio "
            f"{r['resident_vs_take_compact']:.2f}x | "
            f"HBM 10%: {r['hbm10pct_vs_resident']:.2f}x of resident (hit {r['hbm10pct_hbm_hit_rate']:.2f}), "
            f"HBM 1%: {r['hbm1pct_vs_resident']:.2f}x (hit {r['hbm1pct_hbm_hit_rate']:.2f})"
        )
    pol = bench_policies(a.ids, a.requests, 0.01, max(1, a.repeats // 2), a.seed)
    result["policies"] = pol
    for name in STORE_POLICIES:
        print(
            f"policy {name}: {pol[name]['decisions_per_s'] / 1e6:6.1f} M decisions/s, "
            f"hit ratio {pol[name]['hit_ratio']:.4f}"
        )
    if "libcachesim" in pol:
        print(
            f"libCacheSim LRU: {pol['libcachesim']['requests_per_s'] / 1e6:6.1f} M requests/s, hit ratio "
            f"{pol['libcachesim']['hit_ratio']:.4f}; ours/libCacheSim {pol['lru_vs_libcachesim']:.1f}x"
        )
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
