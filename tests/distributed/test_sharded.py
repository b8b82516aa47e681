"""Sharded training over gloo, world sizes 1, 2 and 4 on this machine: every sharding type
bitwise one process; 16-bit communication reproducible; bad input, mismatched plans and a
dead rank fail every rank with a typed error and change nothing."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
import sharded_job as job

from tiered_emb.distributed.launch import run_ranks

KINDS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The job in one process on the global batches, sum and mean pooling."""
    root = tmp_path_factory.mktemp("one")
    return {mode: job.single(str(root / mode), mode) for mode in ("sum", "mean")}


def _pooled_mismatches(results, reference, world):
    per = job.BAGS // world
    bad = []
    for r, (pooled, *_) in enumerate(results):
        for s, step in enumerate(pooled):
            for f, got in step.items():
                want = reference[s][f][r * per : (r + 1) * per]
                if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                    bad.append(f"rank {r} step {s} feature {f}")
    return bad


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_sharding_type_is_bitwise_one_process(tmp_path, one_process, world):
    pooled_ref, records_ref = one_process["sum"]
    results = run_ranks(job.sharded_rank, world, (str(tmp_path), KINDS, "sum", "fp32"))
    for kind in KINDS:
        per_rank = [results[r][kind] for r in range(world)]
        assert _pooled_mismatches(per_rank, pooled_ref, world) == [], kind
        shards = [results[r][kind][1] for r in range(world)]
        assert job.record_mismatches(job.plan_of(kind, world), shards, records_ref) == [], kind
        if world > 1:
            assert all(results[r][kind][3] > 0 for r in range(world))  # bytes did cross ranks
    # the comparison sees a single bit: the last weight of one row of one shard, one ulp off
    shards = [dict(results[r]["row_wise"][1]) for r in range(world)]
    owner = next(r for r in range(world) if "a" in shards[r])
    flipped = shards[owner]["a"].copy()
    flipped.view(np.uint32)[:, 0] ^= 1
    shards[owner]["a"] = flipped
    assert job.record_mismatches(job.plan_of("row_wise", world), shards, records_ref)


def test_ranks_holding_no_shard_take_part_and_change_nothing(tmp_path, one_process):
    pooled_ref, records_ref = one_process["sum"]
    results = run_ranks(job.sharded_rank, 2, (str(tmp_path), ["on_rank_0"], "sum", "fp32"))
    assert results[1]["on_rank_0"][1] == {}  # rank 1 holds nothing
    assert _pooled_mismatches([results[r]["on_rank_0"] for r in range(2)], pooled_ref, 2) == []
    shards = [results[r]["on_rank_0"][1] for r in range(2)]
    assert job.record_mismatches(job.plan_of("on_rank_0", 2), shards, records_ref) == []


def test_mean_pooling_is_bitwise_one_process(tmp_path, one_process):
    pooled_ref, records_ref = one_process["mean"]
    kinds = ["row_wise", "column_wise", "data_parallel"]
    results = run_ranks(job.sharded_rank, 2, (str(tmp_path), kinds, "mean", "fp32"))
    for kind in kinds:
        assert _pooled_mismatches([results[r][kind] for r in range(2)], pooled_ref, 2) == [], kind
        shards = [results[r][kind][1] for r in range(2)]
        assert job.record_mismatches(job.plan_of(kind, 2), shards, records_ref) == [], kind


@pytest.mark.parametrize("comm_dtype", ["fp16", "bf16"])
def test_16_bit_communication_is_reproducible_and_close(tmp_path, one_process, comm_dtype):
    pooled_ref, _ = one_process["sum"]
    kinds = ["table_wise", "row_wise"]
    runs = [run_ranks(job.sharded_rank, 2, (str(tmp_path / str(i)), kinds, "sum", comm_dtype)) for i in range(2)]
    tol = 1e-2 if comm_dtype == "fp16" else 5e-2
    for kind in kinds:
        for r in range(2):
            a, b = runs[0][r][kind], runs[1][r][kind]
            for s in range(job.STEPS):
                for f in a[0][s]:
                    assert np.array_equal(a[0][s][f], b[0][s][f])  # the same bytes run to run
                    want = pooled_ref[s][f][r * (job.BAGS // 2) : (r + 1) * (job.BAGS // 2)]
                    np.testing.assert_allclose(a[0][s][f], want, rtol=tol, atol=tol)
            for t in a[1]:
                assert np.array_equal(a[1][t], b[1][t])
        assert _pooled_mismatches([runs[0][r][kind] for r in range(2)], pooled_ref, 2)  # rounded: not fp32's bits


def test_communication_types_per_table_round_only_their_tables(tmp_path, one_process):
    pooled_ref, _ = one_process["sum"]
    results = run_ranks(job.sharded_rank, 2, (str(tmp_path), ["table_wise"], "sum", {"a": "bf16"}))
    per = job.BAGS // 2
    for r in range(2):
        pooled = results[r]["table_wise"][0]
        for f, t in job.FEATURES.items():
            same = np.array_equal(pooled[0][f], pooled_ref[0][f][r * per : (r + 1) * per])
            assert same == (t != "a") or not pooled[0][f].any(), f  # (an all-empty slice rounds to itself)


def test_16_bit_communication_sends_half_the_row_bytes(tmp_path):
    sent = {}
    for dt in ("fp32", "fp16"):
        results = run_ranks(job.sharded_rank, 2, (str(tmp_path / dt), ["table_wise"], "sum", dt))
        sent[dt] = sum(results[r]["table_wise"][3] for r in range(2))
    assert sent["fp16"] < 0.8 * sent["fp32"]


@pytest.mark.parametrize("fault", ["ids", "nan"])
def test_a_bad_batch_on_one_rank_fails_every_rank_and_changes_nothing(tmp_path, fault):
    results = run_ranks(job.faulty_rank, 2, (str(tmp_path), fault))
    errors = [e for e, _, _ in results]
    met = {"ids": ("IdRangeError", 1), "nan": ("NonFiniteGradientError", None)}[fault]
    if met[1] is not None:
        assert errors[met[1]] == met[0]
        assert errors[1 - met[1]] == "DistributedError"
    else:  # the NaN reaches the owners of rank 0's rows: one of them meets it, the others are told
        assert met[0] in errors and set(errors) <= {met[0], "DistributedError"}
    for _, before, after in results:
        for t in before:
            assert np.array_equal(before[t], after[t]), t


def test_ranks_with_different_plans_refuse_to_start(tmp_path):
    results = run_ranks(job.mismatched_rank, 2, (str(tmp_path),))
    assert [e for e, _ in results] == ["DistributedError", "DistributedError"]
    assert "differs between ranks" in results[0][1]


@pytest.mark.parametrize("when", ["before", "mid-step"])
def test_a_dead_rank_fails_the_others_within_the_timeout_changing_nothing(tmp_path, when):
    results = run_ranks(job.dying_rank, 2, (str(tmp_path), when), timeout_s=20, allow_missing=True)
    assert results[1] is None
    error, waited, kept = results[0]
    assert error == "DistributedError"
    assert waited < 60 and kept
