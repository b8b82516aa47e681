"""``tiered-emb bench policies``, ``bench mrc`` and ``bench lookahead``: the simulator from the shell.

Which policy, how big a tier, on my id stream?  For example::

    tiered-emb bench policies --trace zipf:1.0 --rows 10M --requests 20M \\
        --cache 0.1%,1%,10% --policies lru,lfu,sieve,s3fifo,arc,belady \\
        --compare libcachesim --json out.json --plot out.png
    tiered-emb bench mrc --trace txt:../shared/data/amazon_video_user_item.txt:1 \\
        --cache 0.1%,1%,10% --json mrc.json --plot mrc.png
    tiered-emb bench lookahead --trace zipf:0.9 --cache 1%,10% --step-requests 1024 --window 4
"""

from __future__ import annotations

import logging
import time

from tiered_emb._options import STDOUT, add_alias, add_command, count, require
from tiered_emb.errors import ConfigError
from tiered_emb.sim import bench
from tiered_emb.sim.engine import SIM_POLICIES, check_policy

LOG = logging.getLogger(__name__)
#: ``--requests`` of a synthetic trace when it is not given (a file is read whole then).
SYNTHETIC_REQUESTS = 2_000_000


def _common(p) -> None:
    p.add_argument(
        "--trace",
        default="zipf:1.0",
        help="zipf:ALPHA | drift:ALPHA | tables:A1,A2,.. | npy:PATH | csv:PATH[:COL] | "
        "tsv:PATH[:COL] | txt:PATH[:COL] | criteo:PATH | oracle:PATH",
    )
    p.add_argument(
        "--rows", type=count, default="1M", help="rows per table of synthetic traces: ids are drawn below it"
    )
    add_alias(p, "--ids", "rows", type=count)
    p.add_argument(
        "--requests",
        type=count,
        help=f"requests of a synthetic trace (default: {SYNTHETIC_REQUESTS:,}); for a file, the first this "
        "many are simulated (default: the whole file)",
    )
    p.add_argument(
        "--cache",
        default="0.1%,1%,10%",
        help="cache sizes: percentages of the rows (of the distinct ids for a file) or object counts",
    )
    p.add_argument("--seed", type=count, default=0, help="seed of synthetic traces")
    p.add_argument("--drift-period", type=count, default="1M", help="drift: requests between two moves of the ranking")
    p.add_argument(
        "--batch", type=count, default=512, help="tables: samples per batch; each looks up --pooling ids in every table"
    )
    p.add_argument("--pooling", default="1", help="tables: ids per sample, one value or one per table")
    p.add_argument("--repeats", type=count, default=3, help="timed runs per measurement; medians are reported")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib, in the bench extra)")
    add_alias(p, "--no-progress", "quiet", action="store_true")


def add_parser(sub) -> None:
    what = "cache-policy simulator: policies and miss-ratio curves on an id stream"
    # the shared options go to each bench command, after its name: argparse would let the
    # subcommand's defaults overwrite them if given before it (`bench --quiet mrc`)
    b = sub.add_parser("bench", help=what, description=what)
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    p = add_command(bsub, "policies", "hit ratio and speed of each policy at each cache size")
    _common(p)
    p.add_argument(
        "--policies", default="lru,lfu,fifo,sieve,s3fifo,arc,belady", help="comma-separated: " + ",".join(SIM_POLICIES)
    )
    p.add_argument(
        "--compare", choices=["libcachesim"], help="run the same trace through libCacheSim too (needs libcachesim)"
    )
    p.add_argument(
        "--libcachesim-table",
        choices=["sized", "default"],
        default="sized",
        help="libCacheSim's hash tables: sized to each cache (its best setting) or its binding's default (16M buckets)",
    )
    p.set_defaults(func=run_policies_cmd)
    m = add_command(bsub, "mrc", "exact LRU miss-ratio curve (every size, one pass) and Belady's")
    _common(m)
    m.add_argument("--no-opt", action="store_true", help="skip Belady at the --cache sizes")
    m.set_defaults(func=run_mrc_cmd)
    la = add_command(bsub, "lookahead", "HBM hit ratio with a prefetch window against windowed and full Belady")
    _common(la)
    la.add_argument("--step-requests", type=count, default=1024, help="requests per training batch")
    la.add_argument("--window", type=count, default=4, help="lookahead window k, in batches")
    la.add_argument(
        "--load-ahead",
        type=count,
        default=0,
        help="batches ahead whose rows are brought up (0: the window only protects)",
    )
    la.set_defaults(func=run_lookahead_cmd)


def _check_args(args) -> None:
    """Every argument a run would fail on, and the packages it needs, checked before the
    trace is built or read."""
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} is invalid", "give at least 1 run per measurement")
    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed} is negative", "give a seed >= 0")
    if args.rows < 1:
        raise ConfigError(f"--rows {args.rows} is invalid", "give a count >= 1")
    if args.drift_period < 1:
        raise ConfigError(f"--drift-period {args.drift_period} is invalid", "give a count >= 1")
    if args.requests is not None and args.requests < 0:
        raise ConfigError(f"--requests {args.requests} is invalid", "give a count >= 0 (0: all of a file)")
    bench.parse_sizes(args.cache, 1)  # the syntax (percentages need the trace's universe)
    for flag in ("json", "plot"):
        if getattr(args, flag) not in (None, STDOUT):
            bench.check_output(getattr(args, flag), f"--{flag}")
    if getattr(args, "bench_command", None) == "lookahead":
        if args.step_requests < 1:
            raise ConfigError(f"--step-requests {args.step_requests} is invalid", "give at least 1 request per batch")
        if args.window < 0 or not 0 <= args.load_ahead <= args.window:
            raise ConfigError(
                f"--window {args.window} --load-ahead {args.load_ahead} are invalid",
                "give --window >= 0 and 0 <= --load-ahead <= --window",
            )
    if args.plot:
        require("matplotlib", "--plot", "pip install 'tiered-emb[bench]' (or drop --plot)")
    if getattr(args, "compare", None) == "libcachesim":
        require("libcachesim", "--compare libcachesim", "pip install 'tiered-emb[bench]' (or drop --compare)")


def _load(args):
    _check_args(args)
    t0 = time.perf_counter()
    is_file = str(args.trace).partition(":")[0].lower() in bench.FILE_TRACES
    if args.requests is None:
        requests = 0 if is_file else SYNTHETIC_REQUESTS  # 0: a file whole
    else:
        requests = args.requests
    trace, universe, desc = bench.load_trace(
        args.trace,
        args.rows,
        requests,
        args.seed,
        drift_period=args.drift_period,
        batch=args.batch,
        pooling=args.pooling,
    )
    if is_file and requests:
        desc += f", its first {trace.shape[0]:,} requests (--requests)"
    sizes = bench.parse_sizes(args.cache, universe)
    LOG.info("trace: %s, %s requests (%.1f s)", desc, f"{trace.shape[0]:,}", time.perf_counter() - t0)
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


def _output(args, payload: dict, table: str) -> None:
    """The results: JSON alone on stdout (``--json``), or the table there and JSON in the file."""
    if not bench.emit_json(args.json, payload):
        print(table)


def run_policies_cmd(args) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError(f"--policies {args.policies!r} names no policy", "give e.g. --policies lru,lfu,belady")
    for p in policies:
        check_policy(p)
    trace, universe, desc, sizes = _load(args)
    show = not args.quiet
    if args.compare == "libcachesim":
        from tiered_emb.sim.compare import libcachesim_peer

        with libcachesim_peer(trace, table=args.libcachesim_table) as peer:  # each run right after ours
            rows = bench.run_policies(trace, sizes, policies, args.repeats, show_progress=show, peer=peer)
    else:
        rows = bench.run_policies(trace, sizes, policies, args.repeats, show_progress=show)
    _output(args, {**_header(args, trace, universe, desc), "results": rows}, bench.format_table(rows))
    if args.plot:
        bench.plot_policies(rows, args.plot, f"{desc}, {trace.shape[0]:,} requests")
    return 0


def run_lookahead_cmd(args) -> int:
    from tiered_emb.sim.lookahead import compare_lookahead

    trace, universe, desc, sizes = _load(args)
    rows = compare_lookahead(trace, args.step_requests, sizes, args.window, args.load_ahead)
    head = f"{'cache':>8} {'objects':>10}  {'policy':<36} {'HBM hit':>8}"
    table = [head, "-" * len(head)]
    table += [f"{r['cache']:>8} {r['cache_objects']:>10,}  {r['policy']:<36} {r['hit_ratio']:>8.4f}" for r in rows]
    payload = {
        **_header(args, trace, universe, desc),
        "step_requests": args.step_requests,
        "window": args.window,
        "load_ahead": args.load_ahead,
        "results": rows,
    }
    _output(args, payload, "\n".join(table))
    if args.plot:
        lines = [dict(r, engine="tiered_emb") for r in rows]  # one line per policy, as `bench policies` draws
        bench.plot_policies(lines, args.plot, f"{desc}, batches of {args.step_requests:,} requests")
    return 0


def run_mrc_cmd(args) -> int:
    trace, universe, desc, sizes = _load(args)
    mrc = bench.run_mrc(trace, sizes, args.repeats, opt=not args.no_opt, show_progress=not args.quiet)
    one = mrc["one_lru_run"]
    head = f"{'cache':>8} {'objects':>10} {'LRU hit':>8} {'OPT hit':>8}"
    table = [
        (
            f"LRU curve, every size up to {mrc['distinct_ids']:,} objects: {mrc['lru_curve_median_s']:.2f} s "
            f"(one LRU run at {one['cache']}: {one['median_s']:.2f} s)"
        ),
        head,
        "-" * len(head),
    ]
    for r in mrc["sizes"]:
        opt = f"{r['opt_hit_ratio']:>8.4f}" if "opt_hit_ratio" in r else f"{'-':>8}"
        table.append(f"{r['cache']:>8} {r['cache_objects']:>10,} {r['lru_hit_ratio']:>8.4f} {opt}")
    _output(args, {**_header(args, trace, universe, desc), "mrc": mrc}, "\n".join(table))
    if args.plot:
        bench.plot_mrc(mrc, args.plot, f"{desc}, {trace.shape[0]:,} requests")
    return 0
