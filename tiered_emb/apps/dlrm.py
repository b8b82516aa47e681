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
import math
import os
import time
from pathlib import Path

import numpy as np

from tiered_emb._options import STDOUT, add_command, check_run_dir, count, make_run_dir, require
from tiered_emb._progress import progress_bar
from tiered_emb.apps.checkpoints import checkpoint_due, format_checkpoints, timed_checkpoint
from tiered_emb.apps.clicks import NUM_CATS, NUM_DENSE, CriteoTSV, SyntheticClicks
from tiered_emb.apps.metrics import aggregate_stats, auc, log_loss, thread_cpu_per_step, thread_cpu_s
from tiered_emb.apps.stream import format_tier_table
from tiered_emb.cache.policies import POLICIES
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import (
    ConfigError,
    CorruptStoreError,
    DeviceError,
    MissingExtraError,
    StoreNotFoundError,
    TieredEmbError,
)
from tiered_emb.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad
from tiered_emb.sim.bench import check_output, emit_json
from tiered_emb.store import TieredStore

LOG = logging.getLogger(__name__)

_EMB_OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad, "adagrad": Adagrad, "sgd": SGD, "adam": Adam}
# Every option that shapes the model or the data; fixed for the life of a run directory.
_RUN_KEYS = ("data", "rows", "dim", "batch", "alpha", "bottom", "top", "optimizer", "lr", "dense_lr", "seed", "model")
# Their defaults.  The parser's defaults are None, so that ``--resume`` knows which flags
# were given (and refuses those that differ from the run's config.json).
_RUN_DEFAULTS = {
    "data": None,
    "rows": 100_000,
    "dim": 16,
    "batch": 2048,
    "alpha": 1.05,
    "bottom": "64",
    "top": "64",
    "optimizer": "rowwise_adagrad",
    "lr": 0.05,
    "dense_lr": 0.05,
    "seed": 0,
    "model": "dlrm",
}


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
    p.add_argument("--hbm-rows", type=count, default=4096, help="HBM rows per table")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="HBM tier and MLPs on a GPU (docs/gpu.md)")
    p.add_argument("--ddr-rows", type=count, default=4096, help="DDR rows per table")
    p.add_argument(
        "--policy", default="lookahead+lru", help=f"eviction policy of the tiers: {', '.join(sorted(POLICIES))}"
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(_EMB_OPTIMIZERS),
        help="the store's optimizer for the embedding rows (default: rowwise_adagrad)",
    )
    p.add_argument("--lr", type=float, help="embedding learning rate (default: 0.05)")
    p.add_argument("--dense-lr", type=float, help="learning rate of the MLPs (torch Adagrad; default: 0.05)")
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
        "where HBM holds two batches' ids, --hbm-rows >= 2 x --batch, else 0: a window that cannot "
        "pin a whole batch ahead only cuts the step's chunks smaller; the model is the same either way)",
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


def build_model(store, features: list[str], dim: int, bottom: list[int], top: list[int]):
    """A DLRM over ``store``'s tables (one per feature): ``model(dense, feats) -> logits (B,)``."""
    import torch

    from tiered_emb.torch import TieredEmbeddingBagCollection

    class DLRM(torch.nn.Module):
        """Bottom MLP, embeddings, pairwise dot interaction, top MLP (Naumov et al. 2019)."""

        def __init__(self):
            super().__init__()
            self.bottom = _mlp(torch, [NUM_DENSE, *bottom, dim], last_relu=True)
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
def _features() -> list[str]:
    return [f"C{i + 1}" for i in range(NUM_CATS)]


def _data(cfg: dict):
    if cfg["data"]:
        return CriteoTSV(cfg["data"], cfg["rows"], cfg["batch"])
    return SyntheticClicks(cfg["rows"], cfg["batch"], alpha=cfg["alpha"], seed=cfg["seed"])


def _to_torch(torch, dense, cats, device="cpu"):
    """The batch as the model takes it: dense features on ``device``, ids on the host (the store plans there)."""
    lengths = torch.ones(cats.shape[0], dtype=torch.int64)
    feats = {f: (torch.from_numpy(np.ascontiguousarray(cats[:, i])), lengths) for i, f in enumerate(_features())}
    return torch.from_numpy(dense).to(device), feats


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError as err:
        raise ConfigError(f"MLP sizes {text!r} are invalid", "give comma-separated ints, e.g. 64,32") from err
    if any(s < 1 for s in sizes):
        raise ConfigError(f"MLP sizes {text!r} are invalid", "give sizes >= 1")
    return sizes


def _save_state(torch, store, step: int, model, opt) -> dict:
    """A checkpoint of the rows with the step and the dense state; returns its record for the report."""
    buf = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return timed_checkpoint(store, step, buf.getvalue())


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


def _lookahead(args, cfg: dict, hbm_rows: int) -> int:
    """``--lookahead``, else 4 where a table's HBM holds the ids of two batches (the one
    stepping and the one brought up ahead: each sample looks up one id a table), else 0."""
    given = getattr(args, "lookahead", None)
    if given is not None:
        return given
    return 4 if hbm_rows >= 2 * cfg["batch"] else 0


def _check_run_flags(args) -> None:
    """The flags that are not part of the run's identity (checked before anything is touched)."""

    def bad(flag, value, hint):
        raise ConfigError(f"{flag} {value!r} is invalid", hint)

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(args.steps) or args.steps < 0:
        bad("--steps", args.steps, "use an int >= 0: the train steps of the run in total")
    if not is_int(args.eval_batches) or args.eval_batches < 1:
        bad("--eval-batches", args.eval_batches, "use an int >= 1: the report's log loss and AUC need a batch")
    if not is_int(args.checkpoint_every) or args.checkpoint_every < 0:
        bad("--checkpoint-every", args.checkpoint_every, "use an int >= 0 (0: checkpoint only at the end)")
    for flag, name in (("--lookahead", "lookahead"), ("--load-ahead", "load_ahead"), ("--read-ahead", "read_ahead")):
        v = getattr(args, name, 0)
        if v is None and name == "lookahead":  # (chosen from the tiers and the batch)
            continue
        if not is_int(v) or v < 0:
            bad(flag, v, "use an int >= 0")
    n = getattr(args, "step_threads", None)
    if n is not None and (not is_int(n) or n < 1):
        bad("--step-threads", n, "use an int >= 1, or leave it out (every core but one)")


def _run_config(args) -> dict:
    """The run's identity (``_RUN_KEYS``) from the flags given, defaults for the others; checked."""
    cfg = {}
    for k in _RUN_KEYS:
        v = getattr(args, k, None)
        cfg[k] = _RUN_DEFAULTS[k] if v is None else v
    if cfg["data"]:
        cfg["data"] = str(Path(cfg["data"]).resolve())
    for k in ("rows", "batch"):
        v = cfg[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"--{k} {v!r} is invalid", "use an int >= 1")
    seed = cfg["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ConfigError(f"--seed {seed!r} is invalid", "use an int in [0, 2**64)")
    for k, flag, lo in (("alpha", "--alpha", "0 (0: uniform ids)"), ("dense_lr", "--dense-lr", "0")):
        v = cfg[k]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{flag} {v!r} is invalid", f"use a finite number >= {lo}")
    if cfg["optimizer"] not in _EMB_OPTIMIZERS:
        raise ConfigError(f"--optimizer {cfg['optimizer']!r} is unknown", f"use one of {sorted(_EMB_OPTIMIZERS)}")
    _sizes(cfg["bottom"])
    _sizes(cfg["top"])
    _check_model(cfg)
    return cfg


def _check_model(cfg: dict) -> None:
    """``--model`` is known, and ``torchrec`` importable for it; checked before the run directory is touched."""
    if cfg["model"] not in ("dlrm", "torchrec"):
        raise ConfigError(f"--model {cfg['model']!r} is unknown", "use dlrm or torchrec")
    if cfg["model"] == "torchrec":
        from tiered_emb.torchrec import INSTALL, TORCHREC_ERROR

        if TORCHREC_ERROR is not None:
            raise MissingExtraError(f"--model torchrec: torchrec cannot be imported ({TORCHREC_ERROR})", INSTALL)


def _tables(cfg: dict) -> list[TableConfig]:
    opt_cls = _EMB_OPTIMIZERS[cfg["optimizer"]]
    return [TableConfig(f, dim=cfg["dim"], num_rows=cfg["rows"], optimizer=opt_cls(lr=cfg["lr"])) for f in _features()]


def _load_data(cfg: dict):
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


def _read_run_config(config_path: Path) -> dict:
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptStoreError(
            f"the run's {str(config_path)!r} cannot be read ({err})",
            "restore it from a backup, or start a new run without --resume",
        ) from err
    if isinstance(cfg, dict):
        cfg.setdefault("model", "dlrm")  # a run kept before --model was
    if not isinstance(cfg, dict) or any(k not in cfg for k in _RUN_KEYS):
        raise CorruptStoreError(
            f"the run's {str(config_path)!r} is not a run config (needs {list(_RUN_KEYS)})",
            "restore it from a backup, or start a new run without --resume",
        )
    n = cfg.get("step_threads")  # absent or None: a run kept before the count was
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise CorruptStoreError(
            f"the run's {str(config_path)!r} has step_threads={n!r}",
            "set it to the int >= 1 the run began with (or remove it), or start a new run",
        )
    return cfg


def _conflicts(args, stored: dict) -> list[str]:
    """The run flags given (not None) that differ from the run's stored config."""
    out = []
    for k in _RUN_KEYS:
        given = getattr(args, k, None)
        if given is None:
            continue
        had = stored[k]
        if k == "data":
            same = had is not None and str(Path(given).resolve()) == had
        elif k in ("bottom", "top"):
            same = _sizes(given) == _sizes(had)
        else:
            same = given == had
        if not same:
            out.append(f"--{k.replace('_', '-')} {given!r} (the run's: {had!r})")
    return out


def train(args) -> dict:
    """Run the job described by the parsed ``args``; returns the report as a dict.

    The run directory is checked first (only an empty one or an earlier run of this command
    is replaced), then that torch imports, then every flag, all before anything on disk
    changes.  A step that fails (or a Ctrl-C) closes the store without a checkpoint, so the rows stay those of the last
    checkpoint, saved with the step and dense weights of that instant: ``--resume``
    continues from there as if never interrupted.
    """
    run_dir = Path(args.run_dir)
    store_dir = run_dir / "store"
    config_path = run_dir / "config.json"
    if not args.resume:
        check_run_dir(run_dir, "train")
    torch = require("torch", "tiered-emb train", "pip install 'tiered-emb[torch]' (on CPU: pip install torch==2.13.0)")
    _check_run_flags(args)
    if args.json not in (None, STDOUT):
        check_output(args.json, "--json")
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():  # before the run dir is touched
        raise DeviceError("--device cuda was given but torch sees no CUDA GPU", "drop --device cuda (docs/gpu.md)")
    tiers = TierConfig(
        hbm_rows=args.hbm_rows,
        ddr_rows=args.ddr_rows,
        policy=args.policy,
        device=getattr(args, "device", "cpu"),
        background_writes=not getattr(args, "sync_writes", False),
    )
    if args.resume:
        if not config_path.is_file():
            raise StoreNotFoundError(f"no run to resume in {str(run_dir)!r}", "drop --resume to start a new run")
        cfg = _read_run_config(config_path)
        _check_model(cfg)
        conflicts = _conflicts(args, cfg)
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
        data = _load_data(cfg)
        store = TieredStore.open(store_dir, tiers=tiers)
    else:
        cfg = _run_config(args)
        # Kept with the run: torch's results depend on its thread count (docs/determinism.md),
        # so a resume on another machine, whose default differs, goes on as the run began.
        cfg["step_threads"] = _step_threads(args)
        tables = _tables(cfg)
        data = _load_data(cfg)
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
    store.close()
    return report


def _train_loop(torch, args, cfg: dict, store, data) -> dict:
    from tiered_emb.torch import TrainPipeline

    torch.manual_seed(cfg["seed"])
    build = build_model
    if cfg["model"] == "torchrec":
        from tiered_emb.apps.torchrec_dlrm import build_torchrec_model as build
    dev = torch.device(getattr(args, "device", "cpu"))
    model = build(store, _features(), cfg["dim"], _sizes(cfg["bottom"]), _sizes(cfg["top"])).to(dev)
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
    features = _features()

    def ids_of(batch):
        cats = batch[1]
        return {f: cats[:, i] for i, f in enumerate(features)}

    def loss_of(model, batch):
        dense, cats, labels = batch
        x, feats = _to_torch(torch, dense, cats, dev)
        return loss_fn(model(x, feats), torch.from_numpy(labels).to(dev))  # backward updates the rows in the store

    batches = (data.batch(step, "train") for step in range(start, args.steps))
    lookahead = _lookahead(args, cfg, store.tiers.hbm_rows)
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
    with progress_bar(max(args.steps - start, 0), "steps", args.quiet) as bar:
        for step, loss in enumerate(pipeline.run(batches), start=start):
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
        "thread_cpu_ms_per_step": thread_cpu,
        "checkpoints": checkpoints,
    }
    model.eval()
    with torch.no_grad():
        for split in ("train", "test"):
            ys, ps = [], []
            for i in range(args.eval_batches):
                dense, cats, labels = data.batch(i, split)
                x, feats = _to_torch(torch, dense, cats, dev)
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
    capacity = len(_features()) * (store.tiers.hbm_rows + store.tiers.ddr_rows)
    table_rows = sum(data.num_rows)
    report.update(
        tiers=total,
        prefetch=prefetched,
        table_rows=table_rows,
        capacity_rows=capacity,
        tables_over_capacity=table_rows / capacity,
        lmdb_file_bytes=store.disk_bytes(),
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


def run(args) -> int:
    report = train(args)
    out = Path(args.run_dir) / "report.json"
    out.write_text(json.dumps(report, indent=2, sort_keys=True))
    if emit_json(args.json, report):
        return 0
    print(format_report(report))
    LOG.info("report: %s", out)
    return 0


__all__ = ["aggregate_stats", "auc", "build_model", "format_report", "log_loss", "train"]
