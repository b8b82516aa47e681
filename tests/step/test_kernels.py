"""The backward's reduce kernels: work split by positions, sums bitwise in batch order."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb._order import stable_argsort
from tiered_emb.step.plan import dedupe, plan_bags
from tiered_emb.step.reduce import REDUCE_CHUNK, blocks_by_work, group_positions, reduce_bag_grads, reduce_grads
from tiered_emb.testing.reference import chunked_sum
from tiered_emb.testing.reference import unpool_grads as _unpool_grads

ids_st = st.lists(st.integers(0, 40), min_size=1, max_size=300)


@given(counts=st.lists(st.integers(0, 50), max_size=200), blocks=st.integers(1, 70))
def test_blocks_cover_ids_in_order_with_about_equal_work(counts, blocks):
    k = len(counts)
    starts = np.zeros(k + 1, dtype=np.int64)
    starts[1:] = np.cumsum(counts)
    bounds = np.empty(blocks + 1, dtype=np.int64)
    blocks_by_work(starts, blocks, bounds)
    assert bounds[0] == 0 and bounds[-1] == k
    assert np.all(np.diff(bounds) >= 0)
    work = starts[bounds[1:]] + bounds[1:] - starts[bounds[:-1]] - bounds[:-1]  # positions + ids per block
    heaviest = max(counts, default=0) + 1
    assert work.sum() == starts[k] + k
    assert work.max() <= (starts[k] + k) // blocks + heaviest  # never more than one id past an even share


def _reference_reduce(grads, ids):
    """Plain loop: each unique id (first-occurrence order) sums its rows in batch order, float32,
    a REDUCE_CHUNK of rows at a time (``chunked_sum``)."""
    uids = list(dict.fromkeys(ids))
    return np.stack([chunked_sum([grads[i] for i, x in enumerate(ids) if x == u]) for u in uids])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=40), st.booleans())
def test_dedupe_of_ids_in_order_is_the_hash_dedupe(ids, strict):
    """Ids each once and in order (a bulk write's) skip the hash: the same uniques and inverse
    (ids >= 0, the domain of dedupe: its hash keeps -1 for an empty bucket)."""
    a = np.array(sorted(set(ids)) if strict else sorted(ids), dtype=np.int64)
    uids, inverse = dedupe(a)
    assert uids.tolist() == list(dict.fromkeys(a.tolist()))
    assert uids[inverse].tolist() == a.tolist() and inverse.dtype == np.int64
    uids[:1] = 99  # (its own array: the caller's ids unchanged)
    assert a.tolist() == (sorted(set(ids)) if strict else sorted(ids))


@settings(max_examples=60, deadline=None)
@given(ids=ids_st, dim=st.sampled_from([1, 3, 16]), seed=st.integers(0, 2**16))
def test_reduce_grads_bitwise_batch_order(ids, dim, seed):
    grads = np.random.default_rng(seed).standard_normal((len(ids), dim)).astype(np.float32) * 1e3
    uids, inverse = dedupe(np.asarray(ids, dtype=np.int64))
    assert uids.tolist() == list(dict.fromkeys(ids))
    got = reduce_grads(grads, inverse, uids.shape[0])
    assert got.tobytes() == _reference_reduce(grads, ids).tobytes()


@settings(max_examples=60, deadline=None)
@given(
    ids=ids_st,
    cuts=st.lists(st.integers(0, 300), max_size=12),
    weighted=st.booleans(),
    mean=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reduce_bag_grads_equals_unpool_then_reduce(ids, cuts, weighted, mean, seed):
    n = len(ids)
    offsets = np.array(sorted([0, n] + [c % (n + 1) for c in cuts]), dtype=np.int64)  # empty bags too
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(n).astype(np.float32) if weighted else None
    grad_out = rng.standard_normal((offsets.shape[0] - 1, 8)).astype(np.float32)
    with np.errstate(over="ignore"):  # some rows, and so some sums, overflow to inf
        grad_out[rng.integers(0, grad_out.shape[0])] *= np.float32(1e38) if seed % 5 == 0 else 1
    plan = plan_bags(np.asarray(ids, dtype=np.int64), offsets, weights, mean=mean and not weighted)
    summed, bad = reduce_bag_grads(plan, grad_out)
    unpooled = np.empty((n, 8), dtype=np.float32)
    w = weights if weighted else np.empty(0, dtype=np.float32)
    _unpool_grads(grad_out, offsets, w, weighted, plan.mean, unpooled)
    want = reduce_grads(unpooled, plan.inverse, plan.uids.shape[0])
    assert summed.tobytes() == want.tobytes()
    assert bad.tolist() == (~np.isfinite(want).all(axis=1)).astype(np.uint8).tolist()


@pytest.mark.parametrize("repeats", [REDUCE_CHUNK, REDUCE_CHUNK + 1, 3 * REDUCE_CHUNK + 7])
def test_an_id_seen_more_than_a_chunk_sums_chunk_by_chunk(repeats):
    """The reduce of an id past REDUCE_CHUNK positions: chunks in order, each from +0.0; per
    position and per bag alike."""
    rng = np.random.default_rng(repeats)
    ids = rng.permutation(np.concatenate([np.full(repeats, 7), np.arange(40)])).astype(np.int64)
    grads = (rng.standard_normal((ids.shape[0], 5)) * 1e3).astype(np.float32)
    uids, inverse = dedupe(ids)
    got = reduce_grads(grads, inverse, uids.shape[0])
    assert got.tobytes() == _reference_reduce(grads, ids.tolist()).tobytes()
    offsets = np.concatenate([np.arange(0, ids.shape[0], 3), [ids.shape[0]]]).astype(np.int64)
    plan = plan_bags(ids, offsets, rng.standard_normal(ids.shape[0]).astype(np.float32))
    grad_out = rng.standard_normal((plan.num_bags, 5)).astype(np.float32)
    summed, _ = reduce_bag_grads(plan, grad_out)
    unpooled = np.empty((ids.shape[0], 5), dtype=np.float32)
    _unpool_grads(grad_out, offsets, plan.weights, True, False, unpooled)
    assert summed.tobytes() == reduce_grads(unpooled, plan.inverse, plan.uids.shape[0]).tobytes()


def test_group_positions_is_a_stable_counting_sort():
    inverse = np.array([2, 0, 2, 1, 0, 2], dtype=np.int64)
    starts = np.empty(4, dtype=np.int64)
    order = np.empty(6, dtype=np.int64)
    group_positions(inverse, 3, starts, order)
    assert starts.tolist() == [0, 2, 3, 6]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.lists(st.integers(-5, 5), max_size=80),
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
        st.lists(st.integers(0, 2**61), max_size=40),
    ),
    st.sampled_from(["int64", "uint32", "uint64", "float64"]),
)
def test_stable_argsort_is_numpys_stable_argsort(keys, dtype):
    """The packed sort (keys of a narrow range, repeats among them) and its fallbacks (a wide
    range, floats) give exactly the permutation of NumPy's stable argsort."""
    a = np.array(keys, dtype=np.int64)
    if dtype == "uint32":
        a = (a % (1 << 32)).astype(np.uint32)
    elif dtype == "uint64":  # (above 2**63 too)
        a = a.astype(np.uint64) + np.uint64(2**63)
    elif dtype == "float64":
        a = (a % 1000).astype(np.float64)
    got = stable_argsort(a)
    assert got.dtype == np.int64
    assert got.tolist() == np.argsort(a, kind="stable").tolist()
    runs = np.concatenate([np.sort(a[k : k + 7]) for k in range(0, a.shape[0], 7)] or [a])  # (sorted runs)
    assert stable_argsort(np.sort(a)).tolist() == np.argsort(np.sort(a), kind="stable").tolist()  # (in order already)
    for k in (a, runs):  # (the merge sort taken for runs: the same permutation, whatever the input)
        assert stable_argsort(k, runs=True).tolist() == np.argsort(k, kind="stable").tolist()
