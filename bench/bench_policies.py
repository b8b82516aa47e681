"""Cache-policy benchmark: our kernels against libCacheSim on Zipf 1.0, 10M ids, 20M requests.

Exact command (the numbers in docs/policies.md)::

    python bench/bench_policies.py --repeats 5 --json bench/results/policies.json \
        --plot docs/img/policies_zipf.png --mrc-plot docs/img/mrc_zipf.png

It runs the machinery of ``tiered-emb bench policies`` (and ``bench mrc``) at the issue's
sizes: caches of 0.1 %, 1 % and 10 % of the ids; every policy of ours, the shared ones
through libCacheSim's Python binding (``process_trace`` over an oracleGeneral file), each
libCacheSim run right after ours of the same policy and size; medians of ``--repeats``
runs, speedups as medians of the paired ratios; Belady's time includes its next-use pass;
then the one-pass LRU curve timed against one LRU run (interleaved, ``--mrc-repeats``
pairs, median of ratios).
Writes JSON (machine, versions, seed, every timing) and prints a table.
"""

from __future__ import annotations

import argparse
import sys

from tiered_emb.sim import bench


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--ids", default="10M")
    ap.add_argument("--requests", default="20M")
    ap.add_argument("--cache", default="0.1%,1%,10%")
    ap.add_argument("--policies", default="lru,lfu,fifo,clock,sieve,s3fifo,arc,belady")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--mrc-repeats",
        type=int,
        default=7,
        help="curve / LRU-run pairs (the curve runs on both cores: a busy neighbour shows as outliers)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-libcachesim", action="store_true")
    ap.add_argument(
        "--libcachesim-table",
        choices=["sized", "default"],
        default="sized",
        help="libCacheSim's hash tables: sized to each cache, or its binding's default (16M buckets)",
    )
    ap.add_argument("--no-mrc", action="store_true")
    ap.add_argument("--json", default="bench/results/policies.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--mrc-plot", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    ids, requests = bench.parse_count(args.ids), bench.parse_count(args.requests)
    trace, universe, desc = bench.load_trace(f"zipf:{args.alpha}", ids, requests, args.seed)
    sizes = bench.parse_sizes(args.cache, universe)
    policies = args.policies.split(",")
    if args.no_libcachesim:
        rows = bench.run_policies(trace, sizes, policies, args.repeats, show_progress=not args.quiet)
    else:
        from tiered_emb.sim.compare import libcachesim_peer

        with libcachesim_peer(trace, table=args.libcachesim_table) as peer:  # each run right after ours: paired
            rows = bench.run_policies(trace, sizes, policies, args.repeats, show_progress=not args.quiet, peer=peer)
    print(bench.format_table(rows))
    payload = {
        "trace": f"zipf:{args.alpha}",
        "description": desc,
        "requests": requests,
        "universe_ids": universe,
        "seed": args.seed,
        "repeats": args.repeats,
        "machine": bench.machine_info(),
        "libcachesim_table": None if args.no_libcachesim else args.libcachesim_table,
        "results": rows,
    }
    if not args.no_mrc:
        mrc = bench.run_mrc(trace, sizes, args.mrc_repeats, opt=False, show_progress=not args.quiet)
        payload["mrc"] = mrc
        print(
            f"LRU curve (every size): {mrc['lru_curve_median_s']:.2f} s; one LRU run at "
            f"{mrc['one_lru_run']['cache']}: {mrc['one_lru_run']['median_s']:.2f} s; "
            f"ratio (median of pairs) {mrc['curve_over_one_lru_median']:.2f}"
        )
        if args.mrc_plot:
            bench.plot_mrc(mrc, args.mrc_plot, f"{desc}, {requests:,} requests")
    bench.write_json(args.json, payload)
    if args.plot:
        bench.plot_policies(rows, args.plot, f"{desc}, {requests:,} requests", payload.get("mrc"))
    differ = [f"{r['policy']} at {r['cache']}" for r in rows if r["engine"] == "libcachesim" and not r["same_hits"]]
    if differ:  # every shared policy is defined as libCacheSim's (docs/policies.md): a difference is a bug
        print(f"hit counts differ from libCacheSim's: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
