"""TieredStore's typed errors for bad calls: ids, rows, gradients, configs, paths, a second
writer, a closed store, a missing GPU; each raised before anything changes."""

import numpy as np
import pytest
from store_setup import TABLES, cpu

from tiered_emb import SGD, TableConfig, TierConfig, TieredStore, Uniform
from tiered_emb.errors import (
    ConfigError,
    DeviceError,
    IdRangeError,
    IdTypeError,
    NonFiniteGradientError,
    RowDtypeError,
    RowShapeError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
    TieredEmbError,
    UnknownTableError,
)
from tiered_emb.testing.reference import ReferenceStore


@pytest.mark.parametrize(
    "ids, err",
    [
        (np.array([1.0, 2.0]), IdTypeError),
        (np.array([[1, 2]]), IdTypeError),
        (np.array([-1]), IdRangeError),
        (np.array([100]), IdRangeError),
        (np.array([2**64 - 1], dtype=np.uint64), IdRangeError),
        (["x"], IdTypeError),
    ],
)
def test_bad_ids_raise_typed_errors_and_change_nothing(store, ids, err):
    before = store.stats()
    with pytest.raises(err) as e:
        store.lookup("b", ids)
    assert "Hint:" in str(e.value) and isinstance(e.value, TieredEmbError)
    with pytest.raises(err):
        store.apply_gradients("b", ids, np.zeros((len(ids), 3), np.float32))
    assert store.stats() == before


def test_bad_rows_and_gradients(store):
    ids = np.array([1, 2])
    with pytest.raises(RowShapeError):
        store.write("a", ids, np.zeros((2, 7), np.float32))
    with pytest.raises(RowDtypeError):
        store.write("a", ids, np.zeros((2, 8), np.float64))
    before = store.peek("a", ids, with_state=True)
    g = np.ones((2, 8), np.float32)
    g[1, 3] = np.nan
    with pytest.raises(NonFiniteGradientError):
        store.apply_gradients("a", ids, g)
    np.testing.assert_array_equal(store.peek("a", ids, with_state=True), before)
    store.apply_gradients("a", ids, g, nonfinite="skip")
    after = store.peek("a", ids, with_state=True)
    np.testing.assert_array_equal(after[1], before[1])
    assert not np.array_equal(after[0], before[0])
    before = store.peek("a", ids, with_state=True)
    store.apply_gradients("a", ids, g, nonfinite="zero")
    after = store.peek("a", ids, with_state=True)
    assert np.isfinite(after).all() and not np.array_equal(after[1], before[1])  # updated, NaN as 0
    zeroed = np.nan_to_num(g, nan=0.0)
    ref = ReferenceStore(TABLES, seed=3)
    for i, r in zip(ids, before, strict=False):  # the same weights and optimizer state
        ref.record("a", int(i))[:] = r
    ref.apply_gradients("a", ids, zeroed)
    assert after.tobytes() == ref.peek_records("a", ids).tobytes()
    with pytest.raises(UnknownTableError, match="use one of"):
        store.lookup("nope", ids)


def test_config_errors_name_field_and_value():
    with pytest.raises(ConfigError, match="hbm_rows=0"):
        TierConfig(hbm_rows=0)
    with pytest.raises(ConfigError, match="background_writes=1"):
        TierConfig(hbm_rows=1, background_writes=1)
    with pytest.raises(ConfigError, match="policy='mru'"):
        TierConfig(hbm_rows=1, policy="mru")
    with pytest.raises(ConfigError, match="dim=0"):
        TableConfig("t", dim=0)
    with pytest.raises(ConfigError, match="name"):
        TableConfig("a b", dim=1)
    with pytest.raises(ConfigError, match="dtype"):
        TableConfig("t", dim=1, dtype="float8")
    with pytest.raises(ConfigError, match="Uniform"):
        Uniform(1, 0)
    with pytest.raises(ConfigError, match="lr"):
        SGD(lr=-1)
    with pytest.raises(ConfigError, match="ssd_compression"):
        TierConfig(hbm_rows=1, ssd_compression=30)


def test_store_path_errors(tmp_path):
    with pytest.raises(StoreNotFoundError):
        TieredStore.open(tmp_path / "missing")
    TieredStore.create(tmp_path / "s", TABLES, cpu(2)).close()
    with pytest.raises(StoreExistsError):
        TieredStore.create(tmp_path / "s", TABLES, cpu(2))
    with pytest.raises(ConfigError, match="duplicate"):
        TieredStore.create(tmp_path / "d", [TABLES[0], TABLES[0]], cpu(2))


def test_second_writer_is_refused(tmp_path):
    with TieredStore.create(tmp_path / "s", TABLES, cpu(2)):
        with pytest.raises(StoreLockedError, match="another writer"):
            TieredStore.open(tmp_path / "s")
    TieredStore.open(tmp_path / "s").close()


def test_closed_store_refuses_calls(tmp_path):
    s = TieredStore.create(tmp_path / "s", TABLES, cpu(2))
    s.close()
    s.close()
    with pytest.raises(StoreClosedError):
        s.lookup("a", np.array([1]))


def test_cuda_without_gpu_is_a_clear_error(tmp_path, monkeypatch):
    import tiered_emb._backend as be

    monkeypatch.setattr(be, "_cupy_or_reason", lambda: (None, "CuPy is not importable (test)"))
    with pytest.raises(DeviceError, match="device='cuda'"):
        TieredStore.create(tmp_path / "g", TABLES, TierConfig(hbm_rows=2, device="cuda"))
    assert not (tmp_path / "g").exists()


def test_auto_device_falls_back_with_one_warning(monkeypatch):
    import tiered_emb._backend as be

    monkeypatch.setattr(be, "_cupy_or_reason", lambda: (None, "no GPU (test)"))
    monkeypatch.setattr(be, "_warned", False)
    monkeypatch.delenv("TIERED_EMB_DEVICE", raising=False)
    with pytest.warns(be.DeviceFallbackWarning):
        assert be.resolve_xp("auto") is np
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert be.resolve_xp("auto") is np


def test_importing_does_not_import_torch_or_cupy():
    import subprocess
    import sys

    code = "import sys, tiered_emb; print('torch' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_fused_backward_checks_its_gradient_and_ids(tmp_path):
    """apply_pooled_gradients is held to apply_gradients' checks: a gradient of the wrong
    shape or dtype, or ids beyond num_rows, raise and change nothing."""
    from tiered_emb.step.plan import plan_bags

    with TieredStore.create(tmp_path / "s", TABLES, cpu(4, 4), seed=3) as s:
        plan = plan_bags(np.array([1, 2]), np.array([0, 1, 2]))
        _, fwd = s.engine.lookup_pooled("a", plan)
        before = s.peek("a", np.array([1, 2]), with_state=True)
        with pytest.raises(RowShapeError):
            s.engine.apply_pooled_gradients("a", fwd, np.ones((2, 4), np.float32))
        with pytest.raises(RowShapeError):
            s.engine.apply_pooled_gradients("a", fwd, np.ones((3, 8), np.float32))
        with pytest.raises(RowDtypeError):
            s.engine.apply_pooled_gradients("a", fwd, np.ones((2, 8), np.float64))
        with pytest.raises(ConfigError, match="forward record of table 'a'"):  # a record is its table's
            s.engine.apply_pooled_gradients("b", fwd, np.ones((2, 3), np.float32))
        np.testing.assert_array_equal(s.peek("a", np.array([1, 2]), with_state=True), before)
        bad = plan_bags(np.array([5, 100]), np.array([0, 2]))  # b has num_rows=100, never looked up
        with pytest.raises(IdRangeError):
            s.engine.apply_pooled_gradients("b", bad, np.ones((1, 3), np.float32))
        with pytest.raises(IdRangeError):  # checked against the table it is applied to
            s.engine.apply_pooled_gradients(
                "b", plan_bags(np.array([100]), np.array([0, 1])), np.ones((1, 3), np.float32)
            )
        assert s.stats()["b"]["hbm"]["lookups"] == 0
    with TieredStore.open(tmp_path / "s") as s:  # nothing out of range reached LMDB
        assert s.peek("b", np.array([5])).shape == (1, 3)


@pytest.mark.parametrize("name", [["a"], 3, None])
def test_table_name_of_another_type_is_unknown_table(store, name):
    with pytest.raises(UnknownTableError):
        store.lookup(name, np.array([1]))


def test_bag_plans_take_integer_ids_only(tmp_path):
    from tiered_emb.step.plan import plan_bags

    with pytest.raises(IdTypeError):
        plan_bags(np.array([1.7, 2.0]), np.array([0, 2]))
    with pytest.raises(IdTypeError):
        plan_bags(np.array([True, False]), np.array([0, 2]))
    with pytest.raises(IdTypeError):
        plan_bags(np.array([1, 2]), np.array([0.0, 2.0]))
    with pytest.raises(IdRangeError, match="beyond int64"):
        plan_bags(np.array([2**64 - 1], dtype=np.uint64), np.array([0, 1]))
    assert plan_bags(np.array([3, 1], dtype=np.uint32), np.array([0, 2])).uids.tolist() == [3, 1]
