"""The DLRM job on several ranks: ``tiered-emb train --world-size N`` (the job starts its
ranks on this machine) or ``torchrun --nproc-per-node N -m tiered_emb.apps.dlrm_sharded
[train flags]`` (on one machine or several).

Each step's global batch (the same batches as one process) is cut into ``N`` equal runs
of samples, one a rank.  The embedding tables are sharded by a plan (``--plan``, or the
planner's for the run's tables), each rank holding its shards in its own store under
``<run-dir>/shards``; the MLPs are data-parallel (``DistributedDataParallel``, gradients
averaged); each rank's loss is its samples' mean and the rows get the global batch's
mean-loss gradient (the sharded collection's ``grad_scale = 1 / N``).  gloo, on the CPUs
(``--device cuda`` is refused: the sharded step pools on the host).  Every checkpoint is
taken by every rank at the same step; ``<run-dir>/shards/checkpoint.json``, written
last, names each rank's.

torch is imported when the job runs, not when the CLI is built.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from tiered_emb._options import check_run_dir, make_run_dir, require
from tiered_emb.apps.dlrm_config import (
    check_run_flags,
    default_rows,
    distinct_ids,
    feature_names,
    lr_factor,
    mlp_sizes,
    run_config,
    table_configs,
    window_depth,
)
from tiered_emb.apps.metrics import auc, log_loss
from tiered_emb.config import TierConfig
from tiered_emb.errors import ConfigError, DistributedError, StoreNotFoundError
from tiered_emb.tiers.pool import pool_rows

#: how many of the first batches the planner reads for its access statistics
PLAN_BATCHES = 4
JOB_FORMAT = "tiered_emb-job/1"


def _tiers(cfg: dict, world: int) -> TierConfig:
    """A rank's tiers at ``world`` ranks: rows per table, or an equal share of the job's
    ``--hbm-bytes`` / ``--ddr-bytes`` as one HBM and one DDR tier for the rank's shards."""
    # two checkpoints kept: a rank that completed checkpoint k+1 when another did not can go back to k
    common = {
        "policy": cfg["policy"],
        "device": cfg["device"],
        "background_writes": not cfg["sync_writes"],
        "keep_checkpoints": 2,
    }
    if cfg.get("hbm_bytes"):  # (a run begun before the job's bytes were shared has rows only)
        return TierConfig(hbm_bytes=cfg["hbm_bytes"] // world, ddr_bytes=cfg["ddr_bytes"] // world, **common)
    return TierConfig(hbm_rows=cfg["hbm_rows"], ddr_rows=cfg["ddr_rows"], **common)


def manifest_path(run_dir: Path) -> Path:
    """The job's last complete checkpoint: ``{step, world_size, generation, epochs, dense, plan}``."""
    return run_dir / "shards" / "checkpoint.json"


def generation_root(run_dir: Path, generation: int) -> Path:
    """Where one plan's shards live (a reshard writes the next generation beside it)."""
    return run_dir / "shards" / f"g{generation}"


def read_manifest(run_dir: Path) -> dict:
    path = manifest_path(run_dir)
    try:
        m = json.loads(path.read_text())
        if m.get("format") != JOB_FORMAT:
            raise ValueError(f"format {m.get('format')!r}")
        return m
    except (OSError, ValueError) as err:
        raise StoreNotFoundError(
            f"the sharded run in {str(run_dir)!r} has no complete checkpoint ({err})",
            "start the run again without --resume",
        ) from err


def open_reader(run_dir: str | os.PathLike[str]):
    """A :class:`tiered_emb.distributed.ShardedReader` of the run's last complete checkpoint
    (beside the job, from any process); ``reader.refresh(read_manifest(run_dir)["epochs"])``
    moves it to a newer one."""
    from tiered_emb.distributed import ShardedReader, ShardingPlan

    run_dir = Path(run_dir)
    m = read_manifest(run_dir)
    return ShardedReader(generation_root(run_dir, m["generation"]), ShardingPlan.from_json(m["plan"]), m["epochs"])


def write_manifest(run_dir: Path, manifest: dict) -> None:
    """Atomically: the checkpoint every rank completed becomes the one a resume starts from."""
    path = manifest_path(run_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": JOB_FORMAT, **manifest}, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _plan_for(cfg: dict, tables, world: int, plan_file, data) -> tuple:
    """The run's plan (``plan_file``, else the planner's) and the planner's estimate of it:
    ``(plan, printed estimate, estimated imbalance)``."""
    from tiered_emb.distributed import ShardingPlan
    from tiered_emb.distributed.planner import RankLimits, describe, estimate, imbalance, plan_tables, table_loads

    feats = {f: f for f in feature_names()}
    batches = []
    for step in range(PLAN_BATCHES):
        cats = data.batch(step, "train")[1]
        batches.append({f: (cats[:, i], np.ones(cats.shape[0], np.int64)) for i, f in enumerate(feats)})
    loads = table_loads(batches, feats)
    if plan_file:
        plan = ShardingPlan.load(plan_file)
        plan.check(tables)
        if plan.world_size != world:
            raise ConfigError(f"--plan is for {plan.world_size} ranks, the run has {world}", "plan for --world-size")
    else:
        limits = RankLimits(disk_bytes=cfg.get("disk_limit"))
        plan = plan_tables(tables, world, cfg["batch"], loads=loads, limits=limits, tiers=_tiers(cfg, world))
    costs = estimate(plan, tables, cfg["batch"], loads, _tiers(cfg, world))
    return plan, describe(costs), imbalance(costs)


def prepare(args) -> dict:
    """The run directory, its config.json and plan.json (a resume: the last complete
    checkpoint, resharded first for another world size or plan); what every rank needs
    (picklable).  Every check before anything on disk changes."""
    from tiered_emb.apps.dlrm import load_data

    run_dir = Path(args.run_dir)
    if getattr(args, "device", "cpu") == "cuda":
        raise ConfigError(
            "--device cuda with --world-size is not available yet (the sharded step pools on the host)",
            "drop --device cuda: the ranks train on their CPUs, over gloo",
        )
    if args.resume:
        return _prepare_resume(args, run_dir)
    world = args.world_size or 1
    check_run_dir(run_dir, "train")
    check_run_flags(args)
    cfg = run_config(args)
    if cfg["batch"] % world:
        raise ConfigError(f"--batch {cfg['batch']} for {world} ranks", "give a batch that the world size divides")
    tables = table_configs(cfg)
    hbm_bytes, ddr_bytes = getattr(args, "hbm_bytes", None), getattr(args, "ddr_bytes", None)
    if getattr(args, "reserve", None):
        raise ConfigError(
            "--reserve with --world-size is not available (a rank holds shards, not whole tables)",
            "drop --reserve: each rank's shards share its part of --hbm-bytes / --ddr-bytes",
        )
    if ddr_bytes is not None and hbm_bytes is None:
        raise ConfigError(
            "--ddr-bytes is given without --hbm-bytes",
            "give --hbm-bytes too (tiers shared by each rank's shards), or --hbm-rows / --ddr-rows per table",
        )
    rows = default_rows(args.device)
    cfg.update(
        comm_dtype=args.comm_dtype,
        hbm_rows=0 if hbm_bytes else rows[0] if args.hbm_rows is None else args.hbm_rows,
        ddr_rows=0 if hbm_bytes else rows[1] if args.ddr_rows is None else args.ddr_rows,
        hbm_bytes=hbm_bytes,
        ddr_bytes=ddr_bytes or 0,
        policy=args.policy,
        device=args.device,
        sync_writes=bool(getattr(args, "sync_writes", False)),
        disk_limit=getattr(args, "disk_limit", None),
    )
    if hbm_bytes:  # (a rank's share that holds no row: an error before anything starts)
        pool_rows(tables, _tiers(cfg, world))
    plan, estimate, est = _plan_for(cfg, tables, world, args.plan, load_data(cfg))
    make_run_dir(run_dir, "train")
    (run_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    plan.save(run_dir / "plan.json")
    return _job(args, cfg, plan, run_dir, None, estimate, est)


def _job(args, cfg, plan, run_dir: Path, manifest: dict | None, estimate: str | None, est: float | None) -> dict:
    return {
        "cfg": cfg,
        "plan": plan.to_json(),
        "run_dir": str(run_dir),
        "steps": args.steps,
        "eval_batches": args.eval_batches,
        "checkpoint_every": args.checkpoint_every,
        "manifest": manifest,
        "estimate": estimate,
        "estimated_imbalance": est,
        "lookahead": args.lookahead,  # (None: each rank's from the run's first batches, the same on all)
    }


def _rows_a_table(cfg: dict) -> int:
    """HBM rows per table: the run's, or those an even split of its bytes would give."""
    if cfg.get("hbm_bytes"):
        return int(cfg["hbm_bytes"] // sum(4 * t.record_width for t in table_configs(cfg)))
    return int(cfg["hbm_rows"])


def _prepare_resume(args, run_dir: Path) -> dict:
    """A resume: the run's flags kept, its last complete checkpoint found, and resharded
    when ``--world-size`` or ``--plan`` asks for another plan."""
    from tiered_emb.apps.dlrm import load_data
    from tiered_emb.apps.dlrm_config import flag_conflicts, read_run_config
    from tiered_emb.distributed import ShardingPlan
    from tiered_emb.distributed.reshard import reshard

    cfg = read_run_config(run_dir / "config.json")
    conflicts = flag_conflicts(args, cfg)
    if conflicts:
        raise ConfigError(
            f"--resume with flags that differ from the run's config.json: {', '.join(conflicts)}",
            "drop them to continue the run as it was started",
        )
    m = read_manifest(run_dir)
    world = args.world_size or m["world_size"]
    if cfg["batch"] % world:
        raise ConfigError(f"--batch {cfg['batch']} for {world} ranks", "give a world size that divides the batch")
    old_plan = ShardingPlan.from_json(m["plan"])
    tables = table_configs(cfg)
    if cfg.get("hbm_bytes"):  # (each rank's share at the new world size)
        pool_rows(tables, _tiers(cfg, world))
    if world == m["world_size"] and not args.plan:
        return _job(args, cfg, old_plan, run_dir, m, None, None)
    plan, estimate, est = _plan_for(cfg, tables, world, args.plan, load_data(cfg))
    if plan == old_plan:
        return _job(args, cfg, old_plan, run_dir, m, estimate, est)
    gen = m["generation"] + 1
    new_root = generation_root(run_dir, gen)
    if new_root.exists():  # a reshard that did not finish: its manifest was never written
        shutil.rmtree(new_root)
    epochs = reshard(
        generation_root(run_dir, m["generation"]),
        old_plan,
        m["epochs"],
        new_root,
        plan,
        tables,
        _tiers(cfg, world),
        cfg["seed"],
    )
    dense = f"g{gen}/{Path(m['dense']).name}"
    shutil.copyfile(run_dir / "shards" / m["dense"], run_dir / "shards" / dense)
    old_gen = m["generation"]
    m = {"step": m["step"], "world_size": world, "generation": gen, "epochs": epochs, "dense": dense}
    m["plan"] = plan.to_json()
    write_manifest(run_dir, m)
    plan.save(run_dir / "plan.json")
    shutil.rmtree(generation_root(run_dir, old_gen))  # (the job made it; the new one holds its rows)
    return _job(args, cfg, plan, run_dir, m, estimate, est)


def rank_main(rank: int, world: int, job: dict):
    """One rank of the job; rank 0 returns the report, the others None."""
    import torch

    from tiered_emb.apps.dlrm import build_model, load_data, to_torch
    from tiered_emb.distributed import ShardingPlan, Shards, open_shards
    from tiered_emb.distributed.launch import barrier, gather_objects
    from tiered_emb.prefetch import lookahead

    cfg, run_dir = job["cfg"], Path(job["run_dir"])
    threads = max(
        1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) // world
    )
    torch.set_num_threads(threads)
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    plan = ShardingPlan.from_json(job["plan"])
    tables = table_configs(cfg)
    m = job["manifest"]
    gen = m["generation"] if m else 0
    snapshot = m["epochs"][rank] if m else None
    store = open_shards(generation_root(run_dir, gen), plan, tables, _tiers(cfg, world), rank, cfg["seed"], snapshot)
    shards = Shards(store, plan, tables, comm_dtype=cfg["comm_dtype"], grad_scale=1.0 / world)
    torch.manual_seed(cfg["seed"])
    build = build_model
    if cfg["model"] == "torchrec":
        from tiered_emb.apps.torchrec_dlrm import build_torchrec_model as build
    model = build(store, feature_names(), cfg["dim"], mlp_sizes(cfg["bottom"]), mlp_sizes(cfg["top"]), sharded=shards)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adagrad(model.parameters(), lr=cfg["dense_lr"])
    start = 0
    if m:
        state = torch.load(run_dir / "shards" / m["dense"], weights_only=True)
        start = int(state["step"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = load_data(cfg)
    per = cfg["batch"] // world
    mine = slice(rank * per, (rank + 1) * per)
    checkpoints = []

    def set_rates(step: int) -> None:
        f = lr_factor(cfg, step)
        if store is not None:
            store.set_learning_rate(None, cfg["lr"] * f)
        for group in opt.param_groups:
            group["lr"] = cfg["dense_lr"] * f

    def checkpoint(step: int) -> None:
        t0 = time.perf_counter()
        dense = f"g{gen}/dense-{step}.pt"
        if rank == 0:  # the dense state, equal on every rank (DDP), before the manifest names it
            tmp = run_dir / "shards" / f"{dense}.tmp"
            torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
            os.replace(tmp, run_dir / "shards" / dense)
        epoch = store.checkpoint(str(step).encode()) if store is not None else None
        epochs = gather_objects(epoch)  # every rank's checkpoint is complete
        if rank == 0:
            before = read_manifest(run_dir) if manifest_path(run_dir).exists() else None
            write_manifest(
                run_dir,
                {
                    "step": step,
                    "world_size": world,
                    "generation": gen,
                    "epochs": epochs,
                    "dense": dense,
                    "plan": job["plan"],
                },
            )
            if before is not None:  # the dense states of checkpoints no rank keeps any more
                keep = {before["dense"], dense}
                for old in (run_dir / "shards" / f"g{gen}").glob("dense-*.pt"):
                    if f"g{gen}/{old.name}" not in keep:
                        old.unlink()
        checkpoints.append({"step": step, "seconds": time.perf_counter() - t0})

    busy0 = sum(c.busy_s for c in shards.made)
    sent0 = sum(c.bytes_sent() for c in shards.made)
    barrier()
    t0 = time.perf_counter()
    ema = None
    used = shards.made[-1]  # (the TorchRec model's builtin twin made one it never runs)

    def local(step: int):
        dense, cats, labels = data.batch(step, "train")
        x, feats = to_torch(torch, dense[mine], np.ascontiguousarray(cats[mine]))
        return step, x, feats, torch.from_numpy(labels[mine])

    batches = (local(step) for step in range(start, job["steps"]))
    depth = window_depth(job["lookahead"], cfg["batch"], _rows_a_table(cfg), distinct_ids(data, start))
    ids_of = lambda b: used.owned_ids(b[2])  # noqa: E731 (each rank's own rows of the batch, brought up ahead)
    stream = (
        lookahead(store, batches, ids_of, depth, load_ahead=1)
        if store is not None
        else lockstep(batches, ids_of, depth)
    )
    for step, x, feats, labels in stream:
        set_rates(step)
        loss = loss_fn(ddp(x, feats), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = float(loss.detach())
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        every = job["checkpoint_every"]
        if every and (step + 1) % every == 0 and step + 1 < job["steps"]:
            checkpoint(step + 1)
    barrier()
    train_s = time.perf_counter() - t0
    sent_here = sum(c.bytes_sent() for c in shards.made) - sent0
    busy = gather_objects(sum(c.busy_s for c in shards.made) - busy0)
    sent = sum(gather_objects(sent_here))
    if job["steps"] > start:
        checkpoint(job["steps"])
    model.eval()
    evals = {}
    with torch.no_grad():
        for split in ("train", "test"):
            ys, ps = [], []
            for i in range(job["eval_batches"]):
                dense, cats, labels = data.batch(i, split)
                x, feats = to_torch(torch, dense[mine], np.ascontiguousarray(cats[mine]))
                ps.append(torch.sigmoid(model(x, feats)).numpy())
                ys.append(labels[mine])
            every = gather_objects((np.concatenate(ys), np.concatenate(ps)))
            evals[split] = every
    if store is not None:
        store.close(checkpoint=False)
    # DDP's reducer holds the process group: released now, while the group is whole, not
    # at the interpreter's exit after leave() (gloo's threads then abort the process)
    ddp = model = opt = None
    gc.collect()
    if rank:
        return None
    samples = (job["steps"] - start) * cfg["batch"]
    report = {
        "steps_this_run": job["steps"] - start,
        "world_size": world,
        "plan": json.loads(job["plan"]),
        "comm_dtype": cfg["comm_dtype"],
        "steps": job["steps"],
        "batch": cfg["batch"],
        "train_seconds": train_s,
        "samples_per_s": samples / train_s if train_s > 0 else 0.0,
        "bytes_sent_per_sample": sent / samples if samples else 0.0,
        "rank_busy_seconds": busy,
        "measured_imbalance": max(busy) / (sum(busy) / world) if sum(busy) > 0 else 1.0,
        "checkpoints": checkpoints,
        "loss_ema": ema,
        "lookahead": depth,
    }
    if job["estimate"]:
        report["plan_estimate"] = job["estimate"]
        report["estimated_imbalance"] = job["estimated_imbalance"]
    for split, every in evals.items():
        y = np.concatenate([a for a, _ in every])
        p = np.concatenate([b for _, b in every])
        report[f"{split}_logloss"] = log_loss(y, p)
        report[f"{split}_auc"] = auc(y, p)
    return report


def lockstep(batches, ids_of, depth: int):
    """The batches, with ``ids_of`` called for each as :func:`tiered_emb.prefetch.lookahead`
    calls it (``depth`` batches ahead), on a rank that holds no shard: ``ids_of`` is a
    collective the other ranks run on that schedule."""
    if depth == 0:
        yield from batches
        return
    window: list = []
    for b in batches:
        ids_of(b)
        window.append(b)
        if len(window) > depth:
            yield window.pop(0)
    yield from window


def format_report(r: dict) -> str:
    lines = [
        (
            f"trained {r['steps_this_run']} steps x {r['batch']} samples on {r['world_size']} ranks "
            f"in {r['train_seconds']:.1f} s: "
            f"{r['samples_per_s']:,.0f} samples/s; {r['bytes_sent_per_sample']:,.0f} bytes sent between ranks a sample "
            f"({r['comm_dtype']}; step {r['steps']} of the run)"
        ),
        f"train    log loss {r['train_logloss']:.4f}  AUC {r['train_auc']:.4f}",
        f"held-out log loss {r['test_logloss']:.4f}  AUC {r['test_auc']:.4f}",
        (
            f"ranks busy in their stores {', '.join(f'{b:.2f}' for b in r['rank_busy_seconds'])} s "
            f"(imbalance max / mean {r['measured_imbalance']:.3f})"
        ),
    ]
    if "plan_estimate" in r:
        lines += ["", "the planner's plan:", r["plan_estimate"]]
    return "\n".join(lines)


def run(args) -> int:
    """``tiered-emb train --world-size N``: prepare the run, start the ranks, report."""
    from tiered_emb.apps.dlrm import emit_report
    from tiered_emb.distributed import ShardingPlan
    from tiered_emb.distributed.launch import run_ranks

    require("torch", "tiered-emb train", "pip install 'tiered-emb[torch]' (on CPU: pip install torch==2.13.0)")
    job = prepare(args)
    world = ShardingPlan.from_json(job["plan"]).world_size
    report = run_ranks(rank_main, world, (job,), backend="gloo")[0]
    return emit_report(args, report, format_report)


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: every rank parses the same flags; rank 0 prepares the run, then all train."""
    from tiered_emb.apps.dlrm import emit_report
    from tiered_emb.cli import build_parser
    from tiered_emb.distributed.launch import broadcast_object, init_from_env, leave

    args = build_parser().parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    rank, world = init_from_env("gloo")
    if args.world_size not in (None, world):
        raise ConfigError(f"--world-size {args.world_size} under torchrun's {world} ranks", "leave --world-size out")
    args.world_size = world
    job = None
    if rank == 0:
        try:
            job = prepare(args)
        except Exception as e:  # the others must not wait for a run that will not start
            broadcast_object(f"{type(e).__name__}: {e}")
            raise
    job = broadcast_object(job)
    if isinstance(job, str):
        raise DistributedError(f"rank 0 could not prepare the run: {job}", "read rank 0's error")
    report = rank_main(rank, world, job)
    leave()
    return emit_report(args, report, format_report) if rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
