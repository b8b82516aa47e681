"""The DLRM job sharded over ranks: ``tiered-emb train --world-size N`` and torchrun, resume
bitwise from the last checkpoint every rank completed, resume at another world size, the
world sizes' losses within a stated tolerance of one process, and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import TieredStore  # noqa: E402
from tiered_emb.apps.clicks import SyntheticClicks, table_rows  # noqa: E402
from tiered_emb.apps.dlrm_config import distinct_ids  # noqa: E402
from tiered_emb.apps.dlrm_sharded import generation_root, open_reader, read_manifest  # noqa: E402
from tiered_emb.cli import main  # noqa: E402
from tiered_emb.distributed import ShardingPlan, ShardingType, shard_path  # noqa: E402
from tiered_emb.distributed.launch import free_port  # noqa: E402
from tiered_emb.errors import ConfigError, PlanError  # noqa: E402
from tiered_emb.prefetch.window import pin_budget  # noqa: E402

TINY = [
    "--batch", "256", "--rows", "3000", "--dim", "4", "--hbm-rows", "128", "--ddr-rows", "128",
    "--bottom", "8", "--top", "8", "--eval-batches", "4", "--quiet",
]  # fmt: skip
#: held-out log loss and AUC of 2 and 4 ranks against one process, after 30 steps
TOLERANCE = 0.002


def _train(run_dir: Path, *extra: str) -> dict:
    assert main(["train", "--run-dir", str(run_dir), *TINY, *extra]) == 0
    return json.loads((run_dir / "report.json").read_text())


def _state(run_dir: Path) -> tuple[dict, dict]:
    """Every shard's rows with their state at the job's last complete checkpoint, and its dense state."""
    m = read_manifest(run_dir)
    plan = ShardingPlan.from_json(m["plan"])
    rows = {}
    for r in range(plan.world_size):
        path = shard_path(generation_root(run_dir, m["generation"]), r)
        if not path.exists():
            continue
        with TieredStore.open(path, snapshot=m["epochs"][r]) as store:
            for name in store.tables:
                rows[(r, name)] = store.peek(name, np.arange(3000), with_state=True).tobytes()
    dense = torch.load(run_dir / "shards" / m["dense"], weights_only=True)
    return rows, dense


def _same_dense(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and a["step"] == b["step"]


def test_a_sharded_run_resumes_bitwise_even_after_a_checkpoint_one_rank_alone_took(tmp_path):
    whole = _train(tmp_path / "whole", "--world-size", "2", "--steps", "6", "--checkpoint-every", "3")
    _train(tmp_path / "split", "--world-size", "2", "--steps", "3", "--checkpoint-every", "3")
    # rank 1 completes one more checkpoint the job never recorded (the others died first):
    m = read_manifest(tmp_path / "split")
    store = TieredStore.open(shard_path(generation_root(tmp_path / "split", 0), 1))
    name = next(iter(store.tables))
    store.write(name, np.arange(50), np.full((50, 4), 9.0, np.float32))
    store.checkpoint()
    store.close(checkpoint=False)
    resume = ["train", "--run-dir", str(tmp_path / "split"), "--resume", "--steps", "6"]
    resume += ["--eval-batches", "4", "--quiet"]
    assert main(resume) == 0
    resumed = json.loads((tmp_path / "split" / "report.json").read_text())
    assert resumed["steps_this_run"] == 3 and m["step"] == 3
    rows_a, dense_a = _state(tmp_path / "whole")
    rows_b, dense_b = _state(tmp_path / "split")
    assert rows_a.keys() == rows_b.keys() and all(rows_a[k] == rows_b[k] for k in rows_a)
    assert _same_dense(dense_a, dense_b)
    for k in ("test_logloss", "test_auc", "train_logloss"):
        assert whole[k] == resumed[k]


def test_a_reader_beside_the_job_moves_to_each_new_global_checkpoint(tmp_path):
    run = tmp_path / "run"
    _train(run, "--world-size", "2", "--steps", "3", "--checkpoint-every", "3")
    ids = np.arange(3000)
    with open_reader(run) as reader:
        at_3 = reader.peek("C1", ids, with_state=True)
        assert main(["train", "--run-dir", str(run), "--resume", "--steps", "6", "--eval-batches", "4", "--quiet"]) == 0
        assert np.array_equal(reader.peek("C1", ids, with_state=True), at_3)  # still step 3
        reader.refresh(read_manifest(run)["epochs"])
        at_6 = reader.peek("C1", ids, with_state=True)
    rows, _ = _state(run)
    holder = next(r for (r, name) in rows if name == "C1")
    assert at_6.tobytes() == rows[(holder, "C1")] and not np.array_equal(at_6, at_3)


def test_a_sharded_run_resumes_at_another_world_size(tmp_path):
    run = tmp_path / "run"
    _train(run, "--world-size", "2", "--steps", "3", "--checkpoint-every", "3")
    assert main(["train", "--run-dir", str(run), "--resume", "--world-size", "4", "--steps", "6", "--quiet"]) == 0
    report = json.loads((run / "report.json").read_text())
    m = read_manifest(run)
    assert report["world_size"] == 4 and m["world_size"] == 4 and m["generation"] == 1 and m["step"] == 6
    assert not generation_root(run, 0).exists()  # the old plan's shards, once the new ones hold the rows
    assert ShardingPlan.load(run / "plan.json").world_size == 4


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("w1"), "--steps", "30")


@pytest.mark.parametrize("world", [2, 4])
def test_world_sizes_train_the_model_one_process_trains(tmp_path, one_process, world):
    report = _train(tmp_path, "--world-size", str(world), "--steps", "30")
    assert report["world_size"] == world and report["bytes_sent_per_sample"] > 0
    assert abs(report["test_logloss"] - one_process["test_logloss"]) < TOLERANCE
    assert abs(report["test_auc"] - one_process["test_auc"]) < TOLERANCE
    again = _train(tmp_path / "again", "--world-size", str(world), "--steps", "30")
    assert again["test_logloss"] == report["test_logloss"]  # reproducible for a fixed world size and plan


def test_16_bit_communication_sends_fewer_bytes_for_nearly_the_same_model(tmp_path, one_process):
    plan = _row_wise_plan(tmp_path, 2)  # one plan for the three: only the type the rows cross in differs
    fp32 = _train(tmp_path / "fp32", "--world-size", "2", "--steps", "30", "--plan", plan)
    for dt in ("fp16", "bf16"):
        r = _train(tmp_path / dt, "--world-size", "2", "--steps", "30", "--plan", plan, "--comm-dtype", dt)
        assert r["bytes_sent_per_sample"] < fp32["bytes_sent_per_sample"]
        assert abs(r["test_auc"] - one_process["test_auc"]) < TOLERANCE * 5


def _row_wise_plan(tmp_path: Path, world: int) -> str:
    from tiered_emb.apps.dlrm_config import feature_names
    from tiered_emb.distributed import TablePlan

    plan = ShardingPlan(world, tuple(TablePlan(f, ShardingType.ROW_WISE, tuple(range(world))) for f in feature_names()))
    path = tmp_path / "plan.json"
    plan.save(path)
    return str(path)


def test_the_ranks_window_is_on_where_hbm_pins_two_batches_distinct_ids(tmp_path):
    """Without --lookahead every rank takes the one process's rule: 4 where a table's HBM
    can pin the distinct ids of two of the run's first batches (fewer than the batch's 256
    here), else 0."""
    d = distinct_ids(SyntheticClicks(table_rows(3000, "uniform"), 256, 1.05, 0), 0)
    fits = next(h for h in range(1, 4096) if 2 * d <= pin_budget(h, 0))
    assert fits < 2 * 256
    extra = ["--world-size", "2", "--steps", "2", "--ddr-rows", "0", "--checkpoint-every", "0"]
    on = _train(tmp_path / "on", *extra, "--hbm-rows", str(fits))
    off = _train(tmp_path / "off", *extra, "--hbm-rows", str(fits - 1))
    assert (on["lookahead"], off["lookahead"]) == (4, 0)


@pytest.mark.parametrize("plan", ["planner", "row_wise"])
def test_each_rank_prefetching_its_own_rows_changes_no_bit(tmp_path, plan):
    extra = ["--world-size", "2", "--steps", "8", "--hbm-rows", "1024", "--ddr-rows", "512", "--checkpoint-every", "0"]
    if plan == "row_wise":
        extra += ["--plan", _row_wise_plan(tmp_path, 2)]
    reports = {la: _train(tmp_path / f"la{la}", *extra, "--lookahead", str(la)) for la in (0, 4)}
    assert reports[4]["lookahead"] == 4 and reports[0]["lookahead"] == 0
    rows_0, dense_0 = _state(tmp_path / "la0")
    rows_4, dense_4 = _state(tmp_path / "la4")
    assert rows_0.keys() == rows_4.keys() and all(rows_0[k] == rows_4[k] for k in rows_0)
    assert _same_dense(dense_0, dense_4)


def test_tables_over_one_ranks_disk_train_sharded(tmp_path):
    # 26 tables of 3,000 rows x (4 + 1) words x 4 bytes: 1.56 MB, over one rank's 800 kB
    report = _train(tmp_path, "--world-size", "2", "--steps", "4", "--disk-limit", "800K")
    plan = ShardingPlan.from_json(json.dumps({"format": "tiered_emb-plan/1", **report["plan"]}))
    held = [sum(3000 * 5 * 4 for tp in plan.tables if r in tp.ranks) for r in range(2)]
    assert max(held) <= 800_000 < sum(held)
    with pytest.raises(PlanError, match="fits no set of ranks"):
        _train(tmp_path / "small", "--world-size", "2", "--steps", "4", "--disk-limit", "20K")
    assert not (tmp_path / "small").exists()


def test_the_job_refuses_bad_flags_before_it_makes_anything(tmp_path):
    with pytest.raises(ConfigError, match="world size divides"):
        main(["train", "--run-dir", str(tmp_path / "a"), *TINY, "--batch", "255", "--world-size", "2"])
    with pytest.raises(ConfigError, match="--world-size"):
        main(["train", "--run-dir", str(tmp_path / "b"), *TINY, "--plan", "p.json"])
    bad = ShardingPlan(3, ())
    bad.save(tmp_path / "bad.json")
    with pytest.raises(PlanError):
        main(
            [
                "train",
                "--run-dir",
                str(tmp_path / "c"),
                *TINY,
                "--world-size",
                "2",
                "--plan",
                str(tmp_path / "bad.json"),
            ]
        )
    with pytest.raises(ConfigError, match="device cuda"):
        main(["train", "--run-dir", str(tmp_path / "d"), *TINY, "--world-size", "2", "--device", "cuda"])
    two = ["--world-size", "2"]
    with pytest.raises(ConfigError, match="holds no row"):  # (each rank's half: 6 bytes)
        main(["train", "--run-dir", str(tmp_path / "e"), *TINY, *two, "--dtype", "bf16", "--hbm", "12B"])
    with pytest.raises(ConfigError, match="--reserve with --world-size"):
        main(["train", "--run-dir", str(tmp_path / "f"), *TINY, *two, "--hbm", "1MiB", "--reserve", "C1=1KiB"])
    with pytest.raises(ConfigError, match="without --hbm-bytes"):
        main(["train", "--run-dir", str(tmp_path / "g"), *TINY, *two, "--ddr", "1MiB"])
    assert not any((tmp_path / d).exists() for d in "abcdefg")


def test_torchrun_runs_the_job_on_its_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           "-m", "tiered_emb.apps.dlrm_sharded", "--run-dir", str(tmp_path / "run"), *TINY, "--steps", "3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 3


def test_torchrecs_dlrm_trains_sharded(tmp_path, one_process):
    pytest.importorskip("torchrec")
    report = _train(tmp_path, "--model", "torchrec", "--world-size", "2", "--steps", "30")
    assert abs(report["test_logloss"] - one_process["test_logloss"]) < 0.01


def test_a_sharded_report_names_the_plan_it_ran(tmp_path):
    report = _train(tmp_path, "--world-size", "2", "--steps", "2")
    ran = ShardingPlan.from_json(json.dumps({"format": "tiered_emb-plan/1", **report["plan"]}))
    assert ran == ShardingPlan.load(tmp_path / "plan.json") == ShardingPlan.from_json(read_manifest(tmp_path)["plan"])
    assert report["steps_this_run"] == 2 and len(report["rank_busy_seconds"]) == 2


def test_a_sharded_run_of_narrow_rows_sizes_its_tiers_in_bytes(tmp_path):
    """--dtype bf16 --hbm / --ddr at world size 2: each rank's shards share one HBM and one
    DDR tier of half the job's bytes, slots of bfloat16's record (dim 4 + row-wise
    Adagrad's word: 12 bytes); the shards' tables are bfloat16."""
    run = tmp_path / "r"
    _train(run, "--world-size", "2", "--steps", "2", "--dtype", "bf16", "--hbm", "312KiB", "--ddr", "156KiB")
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["hbm_bytes"], cfg["ddr_bytes"], cfg["hbm_rows"], cfg["ddr_rows"]) == (312 * 1024, 156 * 1024, 0, 0)
    m = read_manifest(run)
    path = shard_path(generation_root(run, m["generation"]), 0)
    with TieredStore.open(path, snapshot=m["epochs"][0]) as store:
        assert (store.engine.tiers.hbm_bytes, store.engine.tiers.ddr_bytes) == (156 * 1024, 78 * 1024)
        for name in store.tables:
            store.lookup(name, np.arange(2000))
        held = store.stats()
        assert sum(held[n]["hbm"]["rows"] for n in held) == 156 * 1024 // 12
        assert {store.engine.table_config(n).dtype for n in store.tables} == {"bfloat16"}
