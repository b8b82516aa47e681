"""``tiered-emb bench policies``, ``bench mrc`` and ``bench lookahead``: the simulator from the shell.

Which policy, how big a tier, on my id stream?  For example::

    tiered-emb bench policies --trace zipf:1.0 --ids 10M --requests 20M \\
        --cache 0.1%,1%,10% --policies lru,lfu,sieve,s3fifo,arc,belady \\
        --compare libcachesim --json out.json --plot out.png
    tiered-emb bench mrc --trace txt:../shared/data/amazon_video_user_item.txt:1 \\
        --cache 0.1%,1%,10% --json mrc.json --plot mrc.png
    tiered-emb bench lookahead --trace zipf:0.9 --cache 1%,10% --step-requests 1024 --window 4
"""

from __future__ import annotations

import time

from tiered_emb.errors import ConfigError, MissingExtraError
from tiered_emb.sim import bench
from tiered_emb.sim.engine import check_policy


def _common(p) -> None:
    p.add_argument(
        "--trace",
        default="zipf:1.0",
        help="zipf:ALPHA | drift:ALPHA | tables:A1,A2,.. | npy:PATH | csv:PATH[:COL] | "
        "tsv:PATH[:COL] | txt:PATH[:COL] | criteo:PATH | oracle:PATH (default zipf:1.0)",
    )
    p.add_argument("--ids", default="1M", help="distinct ids of synthetic traces, per table (default 1M)")
    p.add_argument(
        "--requests", default="2M", help="requests of synthetic traces; a cap for files, 0 for none (default 2M)"
    )
    p.add_argument(
        "--cache",
        default="0.1%,1%,10%",
        help="cache sizes: percentages of the ids (of distinct ids for files) or object counts",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drift-period", default="1M", help="drift: requests between two moves of the ranking")
    p.add_argument("--batch", type=int, default=512, help="tables: samples per batch")
    p.add_argument("--pooling", default="1", help="tables: ids per sample, one value or one per table")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; medians are reported")
    p.add_argument("--json", help="write the results here (machine, versions, seed included)")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib, in the bench extra)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="cache-policy simulator: policies and miss-ratio curves on an id stream")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("policies", help="hit ratio and speed of each policy at each cache size")
    _common(p)
    p.add_argument(
        "--policies",
        default="lru,lfu,fifo,sieve,s3fifo,arc,belady",
        help="comma-separated: "
        + ",".join(__import__("tiered_emb.sim.engine", fromlist=["SIM_POLICIES"]).SIM_POLICIES),
    )
    p.add_argument("--compare", choices=["libcachesim"], help="run the same trace through libCacheSim too")
    p.add_argument(
        "--libcachesim-table",
        choices=["sized", "default"],
        default="sized",
        help="libCacheSim's hash tables: sized to each cache (default; its best setting) or its "
        "binding's default (16M buckets)",
    )
    p.set_defaults(func=run_policies_cmd)
    m = bsub.add_parser("mrc", help="exact LRU miss-ratio curve (every size, one pass) and Belady's")
    _common(m)
    m.add_argument("--no-opt", action="store_true", help="skip Belady at the --cache sizes")
    m.set_defaults(func=run_mrc_cmd)
    la = bsub.add_parser("lookahead", help="HBM hit ratio with a prefetch window against windowed and full Belady")
    _common(la)
    la.add_argument("--step-requests", type=int, default=1024, help="requests per training batch (default 1024)")
    la.add_argument("--window", type=int, default=4, help="lookahead window k, in batches (default 4)")
    la.add_argument(
        "--load-ahead",
        type=int,
        default=0,
        help="batches ahead whose rows are brought up (default 0: the window only protects)",
    )
    la.set_defaults(func=run_lookahead_cmd)


def _check_args(args) -> None:
    """The arguments a run would fail on, checked before the trace is built or read."""
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} is invalid", "give at least 1 run per measurement")
    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed} is negative", "give a seed >= 0")
    for flag, value in (("--ids", args.ids), ("--requests", args.requests), ("--drift-period", args.drift_period)):
        n = bench.parse_count(value)
        if n < (0 if flag == "--requests" else 1):
            raise ConfigError(
                f"{flag} {value} is invalid",
                "give a count >= 0 (0: all of a file)" if flag == "--requests" else "give a count >= 1",
            )
    bench.parse_sizes(args.cache, 1)  # the syntax (percentages need the trace's universe)
    for flag in ("json", "plot"):
        if getattr(args, flag):
            bench.check_output(getattr(args, flag), f"--{flag}")
    if getattr(args, "bench_command", None) == "lookahead":
        if args.step_requests < 1:
            raise ConfigError(f"--step-requests {args.step_requests} is invalid", "give at least 1 request per batch")
        if args.window < 0 or not 0 <= args.load_ahead <= args.window:
            raise ConfigError(
                f"--window {args.window} --load-ahead {args.load_ahead} are invalid",
                "give --window >= 0 and 0 <= --load-ahead <= --window",
            )


def _load(args):
    _check_args(args)
    t0 = time.perf_counter()
    trace, universe, desc = bench.load_trace(
        args.trace,
        bench.parse_count(args.ids),
        bench.parse_count(args.requests),
        args.seed,
        drift_period=bench.parse_count(args.drift_period),
        batch=args.batch,
        pooling=args.pooling,
    )
    sizes = bench.parse_sizes(args.cache, universe)
    if not args.no_progress:
        bench.print_err(f"trace: {desc}, {trace.shape[0]:,} requests ({time.perf_counter() - t0:.1f} s)")
    return trace, universe, desc, sizes


def _header(args, trace, universe, desc) -> dict:
    return {
        "command": vars(args).get("bench_command"),
        "trace": args.trace,
        "description": desc,
        "requests": int(trace.shape[0]),
        "universe_ids": universe,
        "seed": args.seed,
        "repeats": args.repeats,
        "machine": bench.machine_info(),
    }


def _plot(fn, *a) -> None:
    try:
        fn(*a)
    except MissingExtraError as err:
        bench.print_err(f"no plot: {err}")


def run_policies_cmd(args) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError(f"--policies {args.policies!r} names no policy", "give e.g. --policies lru,lfu,belady")
    for p in policies:
        check_policy(p)
    trace, universe, desc, sizes = _load(args)
    show = not args.no_progress
    rows = None
    if args.compare == "libcachesim":
        from tiered_emb.sim.compare import libcachesim_peer

        try:
            with libcachesim_peer(trace, table=args.libcachesim_table) as peer:  # each run right after ours
                rows = bench.run_policies(trace, sizes, policies, args.repeats, show_progress=show, peer=peer)
        except MissingExtraError as err:
            bench.print_err(f"no comparison: {err}")
    if rows is None:
        rows = bench.run_policies(trace, sizes, policies, args.repeats, show_progress=show)
    print(bench.format_table(rows))
    if args.json:
        bench.write_json(args.json, {**_header(args, trace, universe, desc), "results": rows})
    if args.plot:
        _plot(bench.plot_policies, rows, args.plot, f"{desc}, {trace.shape[0]:,} requests")
    return 0


def run_lookahead_cmd(args) -> int:
    from tiered_emb.sim.lookahead import compare_lookahead

    trace, universe, desc, sizes = _load(args)
    rows = compare_lookahead(trace, args.step_requests, sizes, args.window, args.load_ahead)
    head = f"{'cache':>8} {'objects':>10}  {'policy':<36} {'HBM hit':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['cache']:>8} {r['cache_objects']:>10,}  {r['policy']:<36} {r['hit_ratio']:>8.4f}")
    if args.json:
        bench.write_json(
            args.json,
            {
                **_header(args, trace, universe, desc),
                "step_requests": args.step_requests,
                "window": args.window,
                "load_ahead": args.load_ahead,
                "results": rows,
            },
        )
    return 0


def run_mrc_cmd(args) -> int:
    trace, universe, desc, sizes = _load(args)
    mrc = bench.run_mrc(trace, sizes, args.repeats, opt=not args.no_opt, show_progress=not args.no_progress)
    one = mrc["one_lru_run"]
    print(
        f"LRU curve, every size up to {mrc['distinct_ids']:,} objects: {mrc['lru_curve_median_s']:.2f} s "
        f"(one LRU run at {one['cache']}: {one['median_s']:.2f} s)"
    )
    head = f"{'cache':>8} {'objects':>10} {'LRU hit':>8} {'OPT hit':>8}"
    print(head + "\n" + "-" * len(head))
    for r in mrc["sizes"]:
        opt = f"{r['opt_hit_ratio']:>8.4f}" if "opt_hit_ratio" in r else f"{'-':>8}"
        print(f"{r['cache']:>8} {r['cache_objects']:>10,} {r['lru_hit_ratio']:>8.4f} {opt}")
    if args.json:
        bench.write_json(args.json, {**_header(args, trace, universe, desc), "mrc": mrc})
    if args.plot:
        _plot(bench.plot_mrc, mrc, args.plot, f"{desc}, {trace.shape[0]:,} requests")
    return 0
