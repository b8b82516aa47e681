from hypothesis import given
from hypothesis import strategies as st

from tiered_emb.cache.index import hash_home, index_del, index_find, index_put, new_index, table_size_for


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
