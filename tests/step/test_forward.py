"""The pooled step as values: a checked plan, and the immutable record a lookup returns for
its backward (``store.engine.lookup_pooled``), its backend chosen once by the lookup."""

import dataclasses

import numpy as np
import pytest

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.errors import ConfigError, IdRangeError
from tiered_emb.step.plan import plan_bags

TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1), num_rows=1000),
    TableConfig("b", dim=4, optimizer=RowWiseAdagrad(lr=0.1), num_rows=10),
]
BAGS = (np.array([7, 3, 7, 5, 3, 9]), np.array([0, 2, 4, 6]))
GRAD = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)


def _open(path, hbm_rows=16, policy="lru"):
    return TieredStore.create(path, TABLES, TierConfig(hbm_rows, 64, policy, "cpu"), seed=5)


def test_a_lookup_returns_an_immutable_record_of_what_it_read(tmp_path):
    with _open(tmp_path / "s") as s:
        bags = plan_bags(*BAGS)
        out, fwd = s.engine.lookup_pooled("a", bags)
        assert fwd.backend == "host" and fwd.ticket is None and fwd.grouping is None
        assert fwd.uids.tolist() == [7, 3, 5, 9] and fwd.inverse.tolist() == [0, 1, 0, 2, 1, 3]
        assert fwd.slots.shape == (4,) and (s.engine.table("a").hbm.find(fwd.uids) == fwd.slots).all()
        assert fwd.bags.table is s.engine.table("a") and bags.table is None  # checked: a new plan
        for obj, name in ((fwd, "slots"), (fwd, "backend"), (fwd.bags, "ids"), (bags, "table")):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, name, None)
        assert out.shape == (3, 4)


def test_ids_are_checked_once_per_table(tmp_path):
    with _open(tmp_path / "s") as s:
        checked = s.engine.check_bags("a", plan_bags(*BAGS))
        assert s.engine.check_bags("a", checked) is checked  # not checked again
        assert s.engine.lookup_pooled("a", checked)[1].bags is checked
        with pytest.raises(IdRangeError):  # checked again against another table: b holds 10 ids
            s.engine.check_bags("b", plan_bags(np.array([3, 12]), np.array([0, 2])))
        assert s.stats()["b"]["hbm"]["lookups"] == 0


def test_the_backend_is_chosen_once_and_named(tmp_path):
    with TieredStore.create(tmp_path / "r", TABLES[1:], TierConfig(10, 0, "lru", "cpu")) as s:
        small = plan_bags(np.array([1, 2, 1]), np.array([0, 2, 3]))
        _, fwd = s.engine.lookup_pooled("b", small)  # the rows are not up yet: resolved
        assert fwd.backend == "host"
        _, fwd = s.engine.lookup_pooled("b", small, backward=False)  # held whole, all up: read by id
        assert fwd.backend == "by_id" and fwd.uids is None
        before = s.peek("b", np.arange(3), with_state=True)
        with pytest.raises(ConfigError, match="backward=False"):
            s.engine.apply_pooled_gradients("b", fwd, np.ones((2, 4), np.float32))
        np.testing.assert_array_equal(s.peek("b", np.arange(3), with_state=True), before)
    with _open(tmp_path / "s", hbm_rows=3) as s:
        _, fwd = s.engine.lookup_pooled("a", plan_bags(*BAGS))  # 4 unique ids, 3 slots
        assert fwd.backend == "spill" and fwd.slots is None
    with _open(tmp_path / "p", policy="lookahead+lru") as s:
        ticket = s.prefetch({"a": BAGS[0]})
        s.engine.drain_prefetch()  # (its rows brought up and pinned)
        with s.engine.stepping(ticket):
            _, fwd = s.engine.lookup_pooled("a", plan_bags(*BAGS))
            assert fwd.backend == "pinned" and fwd.ticket is ticket and fwd.slots is not None
            s.engine.apply_pooled_gradients("a", fwd, GRAD)
        s.release(ticket)


@pytest.mark.parametrize("hbm_rows", [16, 3])
def test_a_record_and_a_plan_no_lookup_read_update_the_same_bytes(tmp_path, hbm_rows):
    """The backward of a lookup's record (its slots updated in place) and of a plan no lookup
    read (the rows resolved again) write the same bytes."""
    rows = []
    for name, use_record in (("rec", True), ("plan", False)):
        with _open(tmp_path / name, hbm_rows) as s:
            for step in range(3):
                bags = plan_bags(BAGS[0] * (step + 1) % 20, BAGS[1])
                _, fwd = s.engine.lookup_pooled("a", bags)
                s.engine.apply_pooled_gradients("a", fwd if use_record else bags, GRAD * np.float32(step + 1))
            rows.append(s.peek("a", np.arange(20), with_state=True))
    assert rows[0].tobytes() == rows[1].tobytes()


def test_a_record_goes_back_to_its_own_table(tmp_path):
    with _open(tmp_path / "s") as s:
        _, fwd = s.engine.lookup_pooled("b", plan_bags(np.array([1, 2]), np.array([0, 1, 2])))
        with pytest.raises(ConfigError, match="forward record of table 'b'"):
            s.engine.apply_pooled_gradients("a", fwd, np.ones((2, 4), np.float32))
        assert s.engine.reduce_pooled(fwd, np.ones((2, 4), np.float32))[0].tolist() == [1, 2]
