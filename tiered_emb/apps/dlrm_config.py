"""The DLRM job's run: the flags that make a run what it is (kept in its config.json, checked
again on ``--resume``), their defaults and checks, its tables, and its learning-rate schedule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tiered_emb.apps.clicks import NUM_CATS, table_rows
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError, CorruptStoreError, MissingExtraError
from tiered_emb.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad
from tiered_emb.precision import canonical
from tiered_emb.prefetch.window import pin_budget
from tiered_emb.tiers.pool import pool_rows, reserved_of

EMB_OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad, "adagrad": Adagrad, "sgd": SGD, "adam": Adam}
# Every option that shapes the model or the data; fixed for the life of a run directory.
RUN_KEYS = (
    "data",
    "rows",
    "dim",
    "batch",
    "alpha",
    "bottom",
    "top",
    "optimizer",
    "lr",
    "dense_lr",
    "seed",
    "model",
    "lr_schedule",
    "warmup_steps",
    "decay_steps",
    "weight_decay",
    "min_count",
    "dtype",
    "cardinalities",
)
#: The learning-rate schedules of ``--lr-schedule`` (see :func:`lr_factor`).
SCHEDULES = ("constant", "cosine", "poly")
# Their defaults.  The parser's defaults are None, so that ``--resume`` knows which flags
# were given (and refuses those that differ from the run's config.json).
RUN_DEFAULTS = {
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
    "lr_schedule": "constant",
    "warmup_steps": 0,
    "decay_steps": None,  # the run's --steps after the warm-up, as the run began
    "weight_decay": 0.0,
    "min_count": 1,
    "dtype": "float32",
    "cardinalities": "uniform",
}
# Kept by runs made before these keys were: their value then.
_BEFORE = {
    "model": "dlrm",
    "lr_schedule": "constant",
    "warmup_steps": 0,
    "decay_steps": 0,
    "weight_decay": 0.0,
    "min_count": 1,
    "dtype": "float32",
    "cardinalities": "uniform",
}


def feature_names() -> list[str]:
    return [f"C{i + 1}" for i in range(NUM_CATS)]


def mlp_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError as err:
        raise ConfigError(f"MLP sizes {text!r} are invalid", "give comma-separated ints, e.g. 64,32") from err
    if any(s < 1 for s in sizes):
        raise ConfigError(f"MLP sizes {text!r} are invalid", "give sizes >= 1")
    return sizes


def check_run_flags(args) -> None:
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


def run_config(args) -> dict:
    """The run's identity (``RUN_KEYS``) from the flags given, defaults for the others; checked."""
    cfg = {}
    for k in RUN_KEYS:
        v = getattr(args, k, None)
        cfg[k] = RUN_DEFAULTS[k] if v is None else v
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
    if cfg["optimizer"] not in EMB_OPTIMIZERS:
        raise ConfigError(f"--optimizer {cfg['optimizer']!r} is unknown", f"use one of {sorted(EMB_OPTIMIZERS)}")
    _check_schedule(cfg, args.steps)
    cfg["dtype"] = canonical(cfg["dtype"], "--dtype")
    table_configs(cfg)  # (the optimizer checks lr and weight decay)
    mlp_sizes(cfg["bottom"])
    mlp_sizes(cfg["top"])
    check_model(cfg)
    return cfg


def check_model(cfg: dict) -> None:
    """``--model`` is known, and ``torchrec`` importable for it; checked before the run directory is touched."""
    if cfg["model"] not in ("dlrm", "torchrec"):
        raise ConfigError(f"--model {cfg['model']!r} is unknown", "use dlrm or torchrec")
    if cfg["model"] == "torchrec":
        from tiered_emb.torchrec import INSTALL, TORCHREC_ERROR

        if TORCHREC_ERROR is not None:
            raise MissingExtraError(f"--model torchrec: torchrec cannot be imported ({TORCHREC_ERROR})", INSTALL)


def _check_schedule(cfg: dict, steps: int) -> None:
    """``--lr-schedule``, ``--warmup-steps``, ``--decay-steps`` and ``--weight-decay`` checked;
    ``decay_steps`` set to the steps after the warm-up when not given."""
    if cfg["lr_schedule"] not in SCHEDULES:
        raise ConfigError(f"--lr-schedule {cfg['lr_schedule']!r} is unknown", f"use one of {list(SCHEDULES)}")
    for k in ("warmup_steps", "decay_steps"):
        v = cfg[k]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"--{k.replace('_', '-')} {v!r} is invalid", "use an int >= 0")
    if cfg["decay_steps"] is None:
        cfg["decay_steps"] = max(steps - cfg["warmup_steps"], 1)
    wd = cfg["weight_decay"]
    if not isinstance(wd, (int, float)) or isinstance(wd, bool) or not math.isfinite(wd) or wd < 0:
        raise ConfigError(f"--weight-decay {wd!r} is invalid", "use a finite number >= 0")


def lr_factor(cfg: dict, step: int) -> float:
    """What the run's learning rates (``--lr``, ``--dense-lr``) are multiplied by at ``step`` (from 0).

    A linear warm-up over ``warmup_steps`` (``(step + 1) / warmup_steps``), then over
    ``decay_steps``: ``constant`` 1, ``cosine`` ``(1 + cos(pi * t)) / 2``, ``poly``
    ``(1 - t) ** 2`` (the polynomial decay of facebookresearch/dlrm's ``LRPolicyScheduler``),
    ``t`` the fraction of the decay done; 0 after it for those two.  A pure function of the
    step, so a resumed run goes on with the same rates.
    """
    warm, kind = cfg["warmup_steps"], cfg["lr_schedule"]
    if step < warm:
        return (step + 1) / warm
    if kind == "constant":
        return 1.0
    t = min(1.0, (step - warm) / max(cfg["decay_steps"], 1))
    return 0.5 * (1.0 + math.cos(math.pi * t)) if kind == "cosine" else (1.0 - t) ** 2


#: Rows a table's tiers hold when neither ``--hbm-rows`` / ``--ddr-rows`` nor the tiers'
#: bytes are given: on a GPU this many in HBM and as many in DDR (:func:`default_rows`)
ROWS_PER_TABLE = 4096


def default_rows(device: str) -> tuple[int, int]:
    """``(--hbm-rows, --ddr-rows)`` when not given: on a GPU :data:`ROWS_PER_TABLE` each; on
    the CPU the same memory all in HBM.  There both tiers are host memory, and HBM's rows
    are the ones a step pools in place and a window pins: a row held in DDR instead costs a
    copy up each time it is used, and a window over tiers that cannot pin two batches'
    rows in HBM does not run (docs/tuning.md, "The CPU: one tier")."""
    if device == "cuda":
        return ROWS_PER_TABLE, ROWS_PER_TABLE
    return 2 * ROWS_PER_TABLE, 0


def run_tiers(args, tables) -> TierConfig:
    """The run's tiers: ``--hbm-rows`` / ``--ddr-rows`` per table (:func:`default_rows` where
    not given), or one HBM and one DDR tier shared by the tables, ``--hbm-bytes`` /
    ``--ddr-bytes`` (:mod:`tiered_emb.tiers.pool`); the bytes replace the rows; ConfigError
    for DDR in bytes under HBM in rows, and the tiers' own (a budget that holds no row)."""
    hbm_bytes, ddr_bytes = getattr(args, "hbm_bytes", None), getattr(args, "ddr_bytes", None)
    reserve = getattr(args, "reserve", None) or []
    common = {
        "policy": args.policy,
        "device": getattr(args, "device", "cpu"),
        "background_writes": not getattr(args, "sync_writes", False),
    }
    if hbm_bytes is None and ddr_bytes is None and not reserve:
        hbm_rows, ddr_rows = default_rows(common["device"])
        return TierConfig(
            hbm_rows=hbm_rows if args.hbm_rows is None else args.hbm_rows,
            ddr_rows=ddr_rows if args.ddr_rows is None else args.ddr_rows,
            **common,
        )
    if hbm_bytes is None:
        raise ConfigError(
            f"{'--reserve' if reserve else '--ddr-bytes'} is given without --hbm-bytes",
            "give --hbm-bytes too (tiers shared by the tables), or --hbm-rows / --ddr-rows per table",
        )
    tiers = TierConfig(hbm_bytes=hbm_bytes, ddr_bytes=ddr_bytes or 0, reserved=reserve, **common)
    reserved_of(tables, tiers)  # (a budget that holds no row: an error before anything starts)
    pool_rows(tables, tiers)
    return tiers


def rows_held(tables, tiers: TierConfig) -> tuple[int, int]:
    """Rows of HBM and of DDR the tables hold in all."""
    if tiers.shared:
        own = reserved_of(tables, tiers).values()
        hbm, ddr = pool_rows(tables, tiers)
        return hbm + sum(h for h, _ in own), ddr + sum(d for _, d in own)
    hbm = [min(tiers.hbm_rows, t.num_rows or tiers.hbm_rows) for t in tables]  # (a small table: its rows)
    ddr = [min(tiers.ddr_rows, (t.num_rows or tiers.ddr_rows + h) - h) for t, h in zip(tables, hbm, strict=True)]
    return sum(hbm), sum(ddr)


def table_configs(cfg: dict) -> list[TableConfig]:
    """The run's 26 tables: ``--rows`` ids each or Criteo's sizes (``--cardinalities``),
    their optimizer at the run's ``lr`` and weight decay (L2, as FBGEMM's), their
    admission after ``min_count`` sightings."""
    opt = EMB_OPTIMIZERS[cfg["optimizer"]](lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    rows = table_rows(cfg["rows"], cfg["cardinalities"])
    return [
        TableConfig(f, dim=cfg["dim"], num_rows=n, dtype=cfg["dtype"], optimizer=opt, min_count=cfg["min_count"])
        for f, n in zip(feature_names(), rows, strict=True)
    ]


def read_run_config(config_path: Path) -> dict:
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptStoreError(
            f"the run's {str(config_path)!r} cannot be read ({err})",
            "restore it from a backup, or start a new run without --resume",
        ) from err
    if isinstance(cfg, dict):
        for k, v in _BEFORE.items():  # a run kept before the key was
            cfg.setdefault(k, v)
    if not isinstance(cfg, dict) or any(k not in cfg for k in RUN_KEYS):
        raise CorruptStoreError(
            f"the run's {str(config_path)!r} is not a run config (needs {list(RUN_KEYS)})",
            "restore it from a backup, or start a new run without --resume",
        )
    n = cfg.get("step_threads")  # absent or None: a run kept before the count was
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise CorruptStoreError(
            f"the run's {str(config_path)!r} has step_threads={n!r}",
            "set it to the int >= 1 the run began with (or remove it), or start a new run",
        )
    return cfg


def flag_conflicts(args, stored: dict) -> list[str]:
    """The run flags given (not None) that differ from the run's stored config."""
    out = []
    for k in RUN_KEYS:
        given = getattr(args, k, None)
        if given is None:
            continue
        had = stored[k]
        if k == "data":
            same = had is not None and str(Path(given).resolve()) == had
        elif k in ("bottom", "top"):
            same = mlp_sizes(given) == mlp_sizes(had)
        elif k == "dtype":  # (bf16 is bfloat16)
            same = canonical(given, "--dtype") == had
        else:
            same = given == had
        if not same:
            out.append(f"--{k.replace('_', '-')} {given!r} (the run's: {had!r})")
    return out


def window_depth(given: int | None, batch: int, hbm_rows: int, distinct: int | None = None) -> int:
    """``--lookahead`` where ``given``, else 4 where a table's HBM (``hbm_rows``) can pin the
    ids of two batches (the one stepping and the one brought up ahead) within the window's
    budget (:func:`pin_budget`), else 0.  ``distinct``: the most distinct ids a table had in
    a batch of the run's first (:func:`distinct_ids`); unknown, ``batch`` (each sample
    looks up one id a table), the most there can be."""
    if given is not None:
        return given
    if distinct is None:
        return 4 if hbm_rows >= 2 * batch else 0
    return 4 if 2 * distinct <= pin_budget(hbm_rows, 0) else 0


def distinct_ids(data, start: int, batches: int = 2) -> int:
    """The most distinct ids of one table in one of the train batches ``start``,
    ``start + 1``, ... (``batches`` of them): what a window pins of a table for a batch."""
    most = 0
    for step in range(start, start + batches):
        cats = data.batch(step, "train")[1]
        for f in range(cats.shape[1]):
            most = max(most, int(np.unique(cats[:, f]).shape[0]))
    return most
