"""The backward's reduce kernels: work split by positions, sums bitwise in batch order."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_emb.step.plan import dedupe, plan_bags
from tiered_emb.step.reduce import _blocks_by_work, _group_positions, reduce_bag_grads, reduce_grads
from tiered_emb.testing.reference import unpool_grads as _unpool_grads

ids_st = st.lists(st.integers(0, 40), min_size=1, max_size=300)


@given(counts=st.lists(st.integers(0, 50), max_size=200), blocks=st.integers(1, 70))
def test_blocks_cover_ids_in_order_with_about_equal_work(counts, blocks):
    k = len(counts)
    starts = np.zeros(k + 1, dtype=np.int64)
    starts[1:] = np.cumsum(counts)
    bounds = np.empty(blocks + 1, dtype=np.int64)
    _blocks_by_work(starts, blocks, bounds)
    assert bounds[0] == 0 and bounds[-1] == k
    assert np.all(np.diff(bounds) >= 0)
    work = starts[bounds[1:]] + bounds[1:] - starts[bounds[:-1]] - bounds[:-1]  # positions + ids per block
    heaviest = max(counts, default=0) + 1
    assert work.sum() == starts[k] + k
    assert work.max() <= (starts[k] + k) // blocks + heaviest  # never more than one id past an even share


def _reference_reduce(grads, ids):
    """Plain loop: each unique id (first-occurrence order) sums its rows in batch order, float32."""
    uids = list(dict.fromkeys(ids))
    out = np.zeros((len(uids), grads.shape[1]), dtype=np.float32)
    for i, x in enumerate(ids):
        out[uids.index(x)] += grads[i]
    return out


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


def test_group_positions_is_a_stable_counting_sort():
    inverse = np.array([2, 0, 2, 1, 0, 2], dtype=np.int64)
    starts = np.empty(4, dtype=np.int64)
    order = np.empty(6, dtype=np.int64)
    _group_positions(inverse, 3, starts, order)
    assert starts.tolist() == [0, 2, 3, 6]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]
