import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tiered_emb.cache.index import (
    hash_home,
    index_del,
    index_del_of,
    index_find,
    index_find_of,
    index_put,
    index_put_of,
    new_index,
    table_size_for,
)


def test_table_size_scales_with_capacity_not_ids():
    assert table_size_for(1) == 8
    assert table_size_for(1000) == 2048
    assert table_size_for(1024) == 2048
    keys, vals = new_index(100)
    assert keys.shape == (256,) and vals.shape == (256,)


def test_hand_traced_insert_find_delete():
    keys, vals = new_index(4)
    for slot, key in enumerate([10, 2**62, 7, 0]):
        index_put(keys, vals, key, slot)
    assert [index_find(keys, vals, k) for k in (10, 2**62, 7, 0, 5)] == [0, 1, 2, 3, -1]
    index_del(keys, vals, 2**62)
    assert index_find(keys, vals, 2**62) == -1
    assert [index_find(keys, vals, k) for k in (10, 7, 0)] == [0, 2, 3]


def test_backward_shift_keeps_colliding_runs_reachable():
    keys, vals = new_index(4)  # 8 buckets
    mask = keys.shape[0] - 1
    # keys chosen by their home bucket: three share bucket h, two share the next one, so
    # runs overlap and a delete must shift a key home-ahead of the gap (and not one whose
    # home lies after it)
    by_home = {}
    for k in range(1, 10_000):
        by_home.setdefault(int(hash_home(k, mask)), []).append(k)
    h = next(b for b in range(8) if len(by_home.get(b, [])) >= 3 and len(by_home.get((b + 1) & mask, [])) >= 2)
    ids = by_home[h][:3] + by_home[(h + 1) & mask][:2] + by_home[(h + 3) & mask][:1]
    slots = {k: s for s, k in enumerate(ids)}
    for k, s in slots.items():
        index_put(keys, vals, k, s)
    for victim in (ids[0], ids[3], ids[1], ids[5]):
        index_del(keys, vals, victim)
        ids.remove(victim)
        for k in ids:
            assert index_find(keys, vals, k) == slots[k]
        assert index_find(keys, vals, victim) == -1


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=200))
def test_index_matches_a_dict(ops):
    cap = 16
    keys, vals = new_index(cap)
    model = {}
    for put, key in ops:
        if put and key not in model and len(model) < cap:
            model[key] = len(model) * 7 % 1000
            index_put(keys, vals, key, model[key])
        elif not put and key in model:
            del model[key]
            index_del(keys, vals, key)
        for k in range(41):
            assert index_find(keys, vals, k) == model.get(k, -1)
    assert int((keys != -1).sum()) == len(model)


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.sampled_from([0, 1, 2, 3, 2**62, 2**63 - 1])),
        max_size=60,
    )
)
def test_an_index_shared_by_tables_keys_by_table_and_id(ops):
    """The same id of several tables: each (table, id) its own entry, found, put and deleted
    apart from the others' (the owner of a slot names its table), against a dict."""
    keys, vals = new_index(32)
    owner = np.full(32, -1, dtype=np.int32)
    free = list(range(31, -1, -1))
    model: dict[tuple[int, int], int] = {}
    for put, tab, key in ops:
        if put and (tab, key) not in model and free:
            s = free.pop()
            owner[s] = tab
            index_put_of(keys, vals, owner, key, tab, s)
            model[tab, key] = s
        elif not put and (tab, key) in model:
            s = model.pop((tab, key))
            index_del_of(keys, vals, owner, key, tab)
            owner[s] = -1
            free.append(s)
        for t in range(4):
            for k in (0, 1, 2, 3, 2**62, 2**63 - 1):
                assert index_find_of(keys, vals, owner, k, t) == model.get((t, k), -1)


def test_table_zero_of_a_shared_index_hashes_as_a_plain_one():
    """A tier of one table (empty owner, table 0) finds what the plain functions put."""
    keys, vals = new_index(8)
    none = np.empty(0, dtype=np.int32)
    for s, k in enumerate([5, 9, 2**40]):
        index_put(keys, vals, k, s)
    assert [index_find_of(keys, vals, none, k, 0) for k in (5, 9, 2**40, 6)] == [0, 1, 2, -1]
    index_del_of(keys, vals, none, 9, 0)
    assert index_find(keys, vals, 9) == -1 and index_find(keys, vals, 2**40) == 2
