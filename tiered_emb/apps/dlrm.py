"""The main job: train a DLRM on click data whose embedding tables are larger than memory.

``tiered-emb train`` runs it.  The model is Naumov et al. 2019's DLRM: a bottom MLP on
the 13 dense features, one embedding table per categorical feature (26, held in a
:class:`~tiered_emb.TieredStore` with tables together >= 10x the HBM + DDR capacity, so
rows really live in LMDB), pairwise dot interaction, a top MLP.  The embedding rows are
updated by the store's row-wise optimizer in the backward (fused); the MLPs by a torch
optimizer.  The run directory holds the store; every checkpoint saves, atomically with
the rows, the step, the dense weights and their optimizer state, so ``--resume``
continues bitwise as if never interrupted (batches are a pure function of the step).

torch is imported when the job runs, not when the CLI is built.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from tiered_emb._options import (
    STDOUT,
    add_command,
    byte_size,
    check_run_dir,
    count,
    make_run_dir,
    require,
    reservation,
)
from tiered_emb._progress import progress_bar
from tiered_emb.apps import warm
from tiered_emb.apps.checkpoints import checkpoint_due, format_checkpoints, timed_checkpoint
from tiered_emb.apps.clicks import CARDINALITIES, NUM_DENSE, CriteoTSV, SyntheticClicks, table_rows
from tiered_emb.apps.dlrm_config import (
    EMB_OPTIMIZERS,
    ROWS_PER_TABLE,
    SCHEDULES,
    check_model,
    check_run_flags,
    distinct_ids,
    feature_names,
    flag_conflicts,
    lr_factor,
    mlp_sizes,
    read_run_config,
    rows_held,
    run_config,
    run_tiers,
    table_configs,
    window_depth,
)
from tiered_emb.apps.metrics import aggregate_stats, auc, log_loss, thread_cpu_per_step, thread_cpu_s
from tiered_emb.apps.stream import format_tier_table
from tiered_emb.cache.policies import POLICIES
from tiered_emb.errors import (
    ConfigError,
    DeviceError,
    StoreNotFoundError,
    TieredEmbError,
)
from tiered_emb.sim.bench import check_output, emit_json
from tiered_emb.store import TieredStore

LOG = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "train",
        "train a DLRM whose embedding tables are 12x larger than HBM+DDR",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--run-dir",
        default="runs/dlrm",
        help="run directory: the store, config.json, report.json (an earlier run of `tiered-emb train` "
        "there is replaced unless --resume; any other non-empty directory is refused)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the store's last checkpoint in --run-dir (the model and data flags are "
        "the run's; giving one that differs is an error)",
    )
    p.add_argument("--steps", type=count, default=200, help="train steps in total (a resumed run stops here too)")
    p.add_argument("--batch", type=count, help="samples per step; each looks up one id in every table (default: 2048)")
    p.add_argument("--rows", type=count, help="rows per table (its num_rows; 26 tables; default: 100000)")
    p.add_argument("--dim", type=count, help="embedding dimension (default: 16)")
    p.add_argument("--alpha", type=float, help="Zipf skew of the synthetic ids (0: uniform; default: 1.05)")
    p.add_argument(
        "--cardinalities",
        choices=CARDINALITIES,
        help="ids of each table: uniform (--rows each, the default) or criteo (the sizes of Criteo's "
        "Kaggle set, 3 to 10M, at most --rows)",
    )
    p.add_argument(
        "--hbm-rows",
        type=count,
        help=f"HBM rows per table (default: {2 * ROWS_PER_TABLE} on the CPU, where DDR is the same memory, "
        f"{ROWS_PER_TABLE} with --device cuda)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="HBM tier and MLPs on a GPU (docs/gpu.md)")
    p.add_argument(
        "--ddr-rows",
        type=count,
        help=f"DDR rows per table (default: 0 on the CPU, {ROWS_PER_TABLE} with --device cuda)",
    )
    p.add_argument(
        "--hbm-bytes",
        "--hbm",
        type=byte_size,
        help="one HBM tier of this many bytes shared by the 26 tables, e.g. 64MiB: rows of every table "
        "compete for it (replaces --hbm-rows and --ddr-rows; DDR then 0 unless --ddr-bytes)",
    )
    p.add_argument(
        "--ddr-bytes", "--ddr", type=byte_size, help="one DDR tier shared by the 26 tables, with --hbm-bytes"
    )
    p.add_argument(
        "--reserve",
        type=reservation,
        action="append",
        metavar="NAME=HBM[:DDR]",
        help="with --hbm-bytes: set bytes of the budgets apart for table NAME, as tiers of its own "
        "(its floor and cap), e.g. C3=16MiB:64MiB; repeat for more tables",
    )
    p.add_argument(
        "--dtype",
        help="precision of the embedding rows in every tier and on disk: float32 (the default), "
        "float16 / fp16, bfloat16 / bf16 or int8; updates round stochastically (docs/tuning.md)",
    )
    p.add_argument(
        "--policy", default="lookahead+lru", help=f"eviction policy of the tiers: {', '.join(sorted(POLICIES))}"
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(EMB_OPTIMIZERS),
        help="the store's optimizer for the embedding rows (default: rowwise_adagrad)",
    )
    p.add_argument("--lr", type=float, help="embedding learning rate (default: 0.05)")
    p.add_argument("--dense-lr", type=float, help="learning rate of the MLPs (torch Adagrad; default: 0.05)")
    p.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        help="how --lr and --dense-lr change over the run after the warm-up: constant (the default), "
        "cosine or poly (quadratic) decay to 0 over --decay-steps",
    )
    p.add_argument("--warmup-steps", type=count, help="steps of linear warm-up of both rates (default: 0)")
    p.add_argument(
        "--decay-steps", type=count, help="steps of the decay after the warm-up (default: the rest of --steps)"
    )
    p.add_argument("--weight-decay", type=float, help="L2 weight decay of the embedding rows (default: 0)")
    p.add_argument(
        "--min-count", type=int, help="admit an id's row after this many batches held it (1..255; default: 1)"
    )
    p.add_argument("--bottom", help="bottom MLP hidden sizes, comma separated (then dim; default: 64)")
    p.add_argument("--top", help="top MLP hidden sizes, comma separated (then 1; default: 64)")
    p.add_argument("--eval-batches", type=count, default=8, help="held-out (and train) batches for the report")
    p.add_argument(
        "--checkpoint-every",
        type=count,
        default=100,
        help="steps between checkpoints, each one --resume can continue from (0: only the "
        "one at the end, which every run takes)",
    )
    p.add_argument("--data", default=None, help="a Criteo-format TSV instead of synthetic data")
    p.add_argument("--seed", type=count, help="seed of the rows, the MLPs and the synthetic data (default: 0)")
    p.add_argument(
        "--model",
        choices=["dlrm", "torchrec"],
        help="dlrm: the built-in model (the default); torchrec: torchrec.models.dlrm.DLRM over the tiered "
        "collection, from the same weights (needs torchrec, see docs/torchrec.md)",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        default=None,
        help="batches handed to the store ahead of the step (the window; 0: no pipeline; default: 4 "
        "where a table's HBM can pin the distinct ids of two batches (counted in the run's first "
        "batches), else 0: a window that cannot pin a whole batch ahead only cuts the step's chunks "
        "smaller; the model is the same either way)",
    )
    p.add_argument(
        "--load-ahead",
        type=int,
        default=1,
        help="of the window, how many batches ahead the background thread brings rows up and pins "
        "them (1: the step then finds every row pinned for it and runs without the "
        "store's lock; 0: the window only protects rows, the step places its own; see "
        "docs/training.md)",
    )
    p.add_argument(
        "--read-ahead",
        type=int,
        default=0,
        help="of the window, how many batches ahead the background thread reads rows from LMDB into "
        "host memory (0: the step reads LMDB itself; reading ahead did not pay on 2 CPU "
        "cores with LMDB in the page cache, see docs/benchmarks.md)",
    )
    p.add_argument(
        "--step-threads",
        type=int,
        default=None,
        help="torch and Numba threads of the training step (default: the cores but one, at least 1, "
        "with or without lookahead, so the lookahead thread has a core and every --lookahead "
        "gives the same model; torch's dense sums may differ from one thread count to another)",
    )
    p.add_argument(
        "--world-size",
        type=count,
        default=None,
        help="ranks of a sharded run, started on this machine (gloo): "
        "the tables sharded by --plan, the MLPs data-parallel (docs/distributed.md; default 1: one "
        "process; with --resume of a sharded run: its world size, another reshards it)",
    )
    p.add_argument(
        "--disk-limit",
        type=count,
        default=None,
        help="bytes of LMDB rows one rank may hold, for the planner of a sharded run (64M, 2G...)",
    )
    p.add_argument("--plan", default=None, help="a sharding plan (JSON) for --world-size; default: the planner's")
    p.add_argument(
        "--comm-dtype",
        choices=("fp32", "fp16", "bf16"),
        default="fp32",
        help="the type rows and gradients cross ranks in (fp32: bitwise one process's rows)",
    )
    p.add_argument(
        "--sync-writes",
        action="store_true",
        help="write evicted rows to LMDB on the step's thread (without it: on a writer thread)",
    )
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- model
def _mlp(torch, sizes: list[int], last_relu: bool):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def build_model(store, features: list[str], dim: int, bottom: list[int], top: list[int], sharded=None):
    """A DLRM over ``store``'s tables (one per feature): ``model(dense, feats) -> logits (B,)``;
    with ``sharded`` (a :class:`tiered_emb.distributed.Shards`) over the job's sharded tables."""
    import torch

    from tiered_emb.torch import TieredEmbeddingBagCollection

    class DLRM(torch.nn.Module):
        """Bottom MLP, embeddings, pairwise dot interaction, top MLP (Naumov et al. 2019)."""

        def __init__(self):
            super().__init__()
            self.bottom = _mlp(torch, [NUM_DENSE, *bottom, dim], last_relu=True)
            if sharded is not None:
                self.embeddings = sharded.collection(features, mode="sum")
            else:
                self.embeddings = TieredEmbeddingBagCollection(store, features, mode="sum")
            n = len(features) + 1
            self.register_buffer("_li", torch.tril_indices(n, n, offset=-1)[0], persistent=False)
            self.register_buffer("_lj", torch.tril_indices(n, n, offset=-1)[1], persistent=False)
            self.top = _mlp(torch, [dim + n * (n - 1) // 2, *top, 1], last_relu=False)

        def forward(self, dense, feats):
            x = self.bottom(dense)
            pooled = self.embeddings(feats)
            t = torch.stack([x, *pooled.values()], dim=1)  # (B, 27, dim)
            z = torch.bmm(t, t.transpose(1, 2))[:, self._li, self._lj]
            return self.top(torch.cat([x, z], dim=1)).squeeze(1)

    return DLRM()


# --------------------------------------------------------------------------- the job
def _data(cfg: dict):
    rows = table_rows(cfg["rows"], cfg["cardinalities"])
    if cfg["data"]:
        return CriteoTSV(cfg["data"], rows, cfg["batch"])
    return SyntheticClicks(rows, cfg["batch"], alpha=cfg["alpha"], seed=cfg["seed"])


def to_torch(torch, dense, cats, device="cpu"):
    """The batch as the model takes it: dense features on ``device``, ids on the host (the store plans there)."""
    lengths = torch.ones(cats.shape[0], dtype=torch.int64)
    feats = {f: (torch.from_numpy(np.ascontiguousarray(cats[:, i])), lengths) for i, f in enumerate(feature_names())}
    return torch.from_numpy(dense).to(device), feats


def _save_state(torch, store, step: int, model, opt) -> dict:
    """A checkpoint of the rows with the step and the dense state; returns its record for the report."""
    buf = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return timed_checkpoint(store, step, buf.getvalue())


def _set_rates(store, opt, cfg: dict, step: int) -> None:
    """The rows' and the MLPs' learning rates for ``step`` (the run's schedule, :func:`lr_factor`)."""
    if cfg["lr_schedule"] == "constant" and not cfg["warmup_steps"]:
        return
    f = lr_factor(cfg, step)
    store.set_learning_rate(None, cfg["lr"] * f)
    for group in opt.param_groups:
        group["lr"] = cfg["dense_lr"] * f


def _step_threads(args, cfg: dict | None = None) -> int:
    """The step's torch and Numba threads: ``--step-threads``, else the run's (``cfg``, its
    config.json), else every core but one (at least 1)."""
    n = getattr(args, "step_threads", None)
    if n is not None:
        return n
    if cfg is not None and cfg.get("step_threads") is not None:
        return cfg["step_threads"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def load_data(cfg: dict):
    """The run's batches; a --data file that cannot be read is a ConfigError."""
    try:
        return _data(cfg)
    except TieredEmbError:
        raise
    except (OSError, ValueError) as err:  # unreadable file, a bad label or hex id, not UTF-8
        raise ConfigError(
            f"--data {cfg['data']!r} cannot be read ({err})",
            "give a Criteo-format TSV: label, 13 ints, 26 hex ids, tab separated",
        ) from err


def train(args) -> dict:
    """Run the job described by the parsed ``args``; returns the report as a dict.

    The run directory is checked first (only an empty one or an earlier run of this command
    is replaced), then the run's own flags (and a small job is started beside a first run to
    compile kernels: :mod:`tiered_emb.apps.warm`), then that torch imports, then every
    other flag, all before anything on disk changes.  A step that fails (or a Ctrl-C)
    closes the store without a checkpoint, so the rows stay those of the last checkpoint,
    saved with the step and dense weights of that instant: ``--resume`` continues from
    there as if never interrupted.
    """
    run_dir = Path(args.run_dir)
    store_dir = run_dir / "store"
    config_path = run_dir / "config.json"
    helper, cfg = None, None
    if not args.resume:
        check_run_dir(run_dir, "train")
        # the small job that compiles the kernels beside a first run (apps/warm.py), started
        # first: it compiles while this process imports torch and makes its data
        cfg = run_config(args)
        tables = table_configs(cfg)
        hbm_rows, ddr_rows = rows_held(tables, run_tiers(args, tables))
        depth = window_depth(getattr(args, "lookahead", None), cfg["batch"], hbm_rows // len(tables))
        helper = warm.start(cfg, args, depth, ddr_rows > 0)
    try:
        return _train(args, run_dir, store_dir, config_path, cfg, helper)
    finally:
        warm.stop(helper)


def _train(args, run_dir: Path, store_dir: Path, config_path: Path, cfg: dict | None, helper) -> dict:
    """:func:`train` once its run directory is checked: ``cfg`` the new run's config (None for
    ``--resume``: the run's own is read), ``helper`` the small job beside it, or None."""
    torch = require("torch", "tiered-emb train", "pip install 'tiered-emb[torch]' (on CPU: pip install torch==2.13.0)")
    check_run_flags(args)
    if args.json not in (None, STDOUT):
        check_output(args.json, "--json")
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():  # before the run dir is touched
        raise DeviceError("--device cuda was given but torch sees no CUDA GPU", "drop --device cuda (docs/gpu.md)")
    if args.resume:
        if not config_path.is_file():
            raise StoreNotFoundError(f"no run to resume in {str(run_dir)!r}", "drop --resume to start a new run")
        cfg = read_run_config(config_path)
        check_model(cfg)
        conflicts = flag_conflicts(args, cfg)
        given, had = getattr(args, "step_threads", None), cfg.get("step_threads")
        if given is not None and had is not None and given != had:  # (a run from before it was kept has none)
            conflicts.append(
                f"--step-threads {given!r} (the run's: {had!r}; torch sums in another order on "
                "another thread count, so the run would not be the one an uninterrupted run gives)"
            )
        if had is None and not conflicts:  # a run kept before the count was: it keeps this resume's from now on
            cfg["step_threads"] = _step_threads(args)
            config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        if conflicts:
            raise ConfigError(
                f"--resume with flags that differ from the run's config.json: {', '.join(conflicts)}",
                "drop them to continue the run as it was started, or start a new run "
                "(without --resume, or in another --run-dir)",
            )
        data = load_data(cfg)
        store = TieredStore.open(store_dir, tiers=run_tiers(args, table_configs(cfg)))
    else:
        # Kept with the run: torch's results depend on its thread count (docs/determinism.md),
        # so a resume on another machine, whose default differs, goes on as the run began.
        cfg["step_threads"] = _step_threads(args)
        tables = table_configs(cfg)
        tiers = run_tiers(args, tables)
        data = load_data(cfg)
        make_run_dir(run_dir, "train")
        config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        store = TieredStore.create(store_dir, tables, tiers, seed=cfg["seed"])
    try:
        report = _train_loop(torch, args, cfg, store, data)
    except BaseException:
        # Give up the rows since the last checkpoint: they and the trainer state saved with
        # it (step, dense weights) must come from the same instant for --resume.
        store.close(checkpoint=False)
        raise
    warm.stop(helper)  # (done by now, or no longer of use: the last checkpoint has the cores)
    store.close()
    return report


def _train_loop(torch, args, cfg: dict, store, data) -> dict:
    from tiered_emb.torch import TrainPipeline

    torch.manual_seed(cfg["seed"])
    build = build_model
    if cfg["model"] == "torchrec":
        from tiered_emb.apps.torchrec_dlrm import build_torchrec_model as build
    dev = torch.device(getattr(args, "device", "cpu"))
    model = build(store, feature_names(), cfg["dim"], mlp_sizes(cfg["bottom"]), mlp_sizes(cfg["top"])).to(dev)
    dense_params = list(model.parameters())
    opt = torch.optim.Adagrad(dense_params, lr=cfg["dense_lr"])
    start = 0
    saved = store.extra if args.resume else None
    if saved:
        state = torch.load(io.BytesIO(saved), weights_only=True, map_location=dev)
        start = int(state["step"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    cpu0 = thread_cpu_s(store)
    t0 = time.perf_counter()
    ema = None
    features = feature_names()

    def ids_of(batch):
        cats = batch[1]
        return {f: cats[:, i] for i, f in enumerate(features)}

    def loss_of(model, batch):
        dense, cats, labels = batch
        x, feats = to_torch(torch, dense, cats, dev)
        return loss_fn(model(x, feats), torch.from_numpy(labels).to(dev))  # backward updates the rows in the store

    batches = (data.batch(step, "train") for step in range(start, args.steps))
    tables = [store.engine.table_config(f) for f in feature_names()]
    hbm_rows = rows_held(tables, store.engine.tiers)[0] // len(tables)
    lookahead = window_depth(getattr(args, "lookahead", None), cfg["batch"], hbm_rows, distinct_ids(data, start))
    pipeline = TrainPipeline(
        store,
        model,
        opt,
        ids_of,
        loss_of,
        lookahead_batches=lookahead,
        load_ahead=getattr(args, "load_ahead", 1),
        read_ahead=getattr(args, "read_ahead", 0),
        step_threads=_step_threads(args, cfg),
    )
    checkpoints = []  # this run's, one record each: step, seconds, rows written
    _set_rates(store, opt, cfg, start)
    with progress_bar(max(args.steps - start, 0), "steps", args.quiet) as bar:
        for step, loss in enumerate(pipeline.run(batches), start=start):
            _set_rates(store, opt, cfg, step + 1)  # (the pipeline starts the next step when asked for it)
            ema = loss if ema is None else 0.98 * ema + 0.02 * loss
            if checkpoint_due(step + 1, args.checkpoint_every, args.steps):
                checkpoints.append(_save_state(torch, store, step + 1, model, opt))
            bar.set_postfix_str(f"loss {ema:.4f}", refresh=False)
            bar.update(1)
    train_s = time.perf_counter() - t0
    done = max(args.steps - start, 0)
    thread_cpu = thread_cpu_per_step(cpu0, thread_cpu_s(store), done)
    if done or start < args.steps:
        checkpoints.append(_save_state(torch, store, max(args.steps, start), model, opt))
    stats = store.stats()  # training's statistics, before evaluation reads more rows
    report = {
        "steps": max(args.steps, start),
        "steps_this_run": done,
        "batch": cfg["batch"],
        "train_seconds": train_s,
        "samples_per_s": done * cfg["batch"] / train_s if done else 0.0,
        "step_threads": _step_threads(args, cfg),
        "lookahead": lookahead,
        "lr_schedule": cfg["lr_schedule"],
        "lr_final": store.engine.table_config(feature_names()[0]).optimizer.lr,
        "thread_cpu_ms_per_step": thread_cpu,
        "checkpoints": checkpoints,
    }
    model.eval()
    with torch.no_grad():
        for split in ("train", "test"):
            ys, ps = [], []
            for i in range(args.eval_batches):
                dense, cats, labels = data.batch(i, split)
                x, feats = to_torch(torch, dense, cats, dev)
                ps.append(torch.sigmoid(model(x, feats)).cpu().numpy())
                ys.append(labels)
            y, p = np.concatenate(ys), np.concatenate(ps)
            report[f"{split}_logloss"] = log_loss(y, p)
            report[f"{split}_auc"] = auc(y, p)
            report[f"{split}_ctr"] = float(y.mean())
    total = aggregate_stats(stats)
    # what the prefetch thread moved ahead of the steps (rows and bytes held are the same tiers)
    prefetched = aggregate_stats(
        {
            name: dict(
                s["prefetch"], **{tier: dict(s["prefetch"][tier], rows=0, bytes=0) for tier in ("hbm", "ddr", "ssd")}
            )
            for name, s in stats.items()
        }
    )
    capacity = sum(rows_held([store.engine.table_config(f) for f in feature_names()], store.engine.tiers))
    table_rows = sum(data.num_rows)
    report.update(
        tiers=total,
        prefetch=prefetched,
        table_rows=table_rows,
        capacity_rows=capacity,
        tables_over_capacity=table_rows / capacity,
        lmdb_file_bytes=store.engine.disk_bytes(),
    )
    return report


def format_report(r: dict) -> str:
    lines = [
        (
            f"trained {r['steps_this_run']} steps x {r['batch']} samples in {r['train_seconds']:.1f} s: "
            f"{r['samples_per_s']:,.0f} samples/s (step {r['steps']} of the run)"
        ),
        format_checkpoints(r["checkpoints"]),
        f"train    log loss {r['train_logloss']:.4f}  AUC {r['train_auc']:.4f}  (CTR {r['train_ctr']:.3f})",
        f"held-out log loss {r['test_logloss']:.4f}  AUC {r['test_auc']:.4f}  (CTR {r['test_ctr']:.3f})",
        (
            f"tables {r['table_rows']:,} rows = {r['tables_over_capacity']:.1f}x HBM+DDR capacity "
            f"({r['capacity_rows']:,} rows); LMDB files {r['lmdb_file_bytes'] / 2**20:.1f} MiB"
        ),
        "",
        format_tier_table({"steps": r["tiers"], "prefetch": r["prefetch"]}),
        (
            "(steps: what the training steps asked of each tier; prefetch: what the lookahead thread brought up "
            "before them; rows/MiB: held at the end)"
        ),
    ]
    return "\n".join(lines)


def emit_report(args, report: dict, fmt) -> int:
    """``report`` to ``<run-dir>/report.json`` and to ``--json``, else printed by ``fmt``."""
    out = Path(args.run_dir) / "report.json"
    out.write_text(json.dumps(report, indent=2, sort_keys=True))
    if emit_json(args.json, report):
        return 0
    print(fmt(report))
    LOG.info("report: %s", out)
    return 0


def run(args) -> int:
    sharded_run = args.resume and (Path(args.run_dir) / "shards" / "checkpoint.json").exists()
    if (getattr(args, "world_size", None) or 1) > 1 or sharded_run:
        from tiered_emb.apps.dlrm_sharded import run as run_sharded

        return run_sharded(args)
    if getattr(args, "plan", None) or getattr(args, "disk_limit", None):
        raise ConfigError("--plan or --disk-limit without --world-size", "give --world-size N (N > 1) to shard")
    return emit_report(args, train(args), format_report)


__all__ = [
    "aggregate_stats",
    "auc",
    "build_model",
    "emit_report",
    "format_report",
    "load_data",
    "log_loss",
    "to_torch",
    "train",
]
