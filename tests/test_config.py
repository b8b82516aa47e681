"""Validation of TableConfig / TierConfig / Uniform / Normal (tiered_emb/config.py).

Every invalid value is a ConfigError with a hint, raised when the config is built.
"""

import numpy as np
import pytest

from tiered_emb import SGD, Adagrad, Adam, Normal, TableConfig, TierConfig, TieredStore, Uniform
from tiered_emb.config import FLOAT32_MAX, MAX_MAP_SIZE_BYTES
from tiered_emb.errors import ConfigError


@pytest.mark.parametrize(
    "make",
    [
        lambda: Uniform("a", 1.0),
        lambda: Uniform(None, 1.0),
        lambda: Uniform(0.0, 1j),
        lambda: Uniform(False, True),
        lambda: Normal("x"),
        lambda: Normal(1j),
        lambda: Normal(0.1, mean=None),
    ],
    ids=[
        "uniform-str",
        "uniform-none",
        "uniform-complex",
        "uniform-bool",
        "normal-str",
        "normal-complex",
        "normal-mean-none",
    ],
)
def test_init_non_number_is_a_config_error(make):
    with pytest.raises(ConfigError, match=r"Uniform|Normal") as e:
        make()
    assert e.value.hint


@pytest.mark.parametrize(
    "make",
    [
        lambda: Uniform(-1e308, 1e308),
        lambda: Uniform(0.0, 1e39),
        lambda: Uniform(-3.5e38, 0.0),
        lambda: Normal(std=1e300),
        lambda: Normal(std=1e38),
        lambda: Normal(std=1e37, mean=-3.4e38),
    ],
    ids=["uniform-f64-huge", "uniform-high", "uniform-low", "normal-huge", "normal-std", "normal-mean"],
)
def test_init_that_overflows_float32_is_refused(make):
    with pytest.raises(ConfigError, match="float32"):
        make()


def test_init_at_the_float32_limits_is_accepted(tmp_path):
    cfgs = [
        TableConfig("u", 4, init=Uniform(-FLOAT32_MAX, FLOAT32_MAX)),
        TableConfig("n", 4, init=Normal(std=1e37)),
        TableConfig("i", 4, init=Uniform(np.float32(-1), 1)),
    ]
    with TieredStore.create(tmp_path / "s", cfgs, TierConfig(hbm_rows=8, device="cpu")) as s:
        for name in ("u", "n", "i"):
            assert np.isfinite(s.lookup(name, np.arange(64))).all()
    # a numpy scalar bound is kept as a float, so the manifest (JSON) is written and read back
    assert type(cfgs[2].init.low) is float
    with TieredStore.open(tmp_path / "s") as s:
        assert s.tables["i"].init == Uniform(-1.0, 1)


@pytest.mark.parametrize(
    "opt",
    [SGD(lr=1e39), Adagrad(lr=1e39), Adagrad(lr=0.1, eps=1e40), Adam(lr=4e38)],
    ids=["sgd-lr", "adagrad-lr", "adagrad-eps", "adam-lr"],
)
def test_optimizer_hyperparameter_that_overflows_float32_is_refused(opt):
    # finite in float64, inf in the float32 kernel: one update would turn rows into NaN
    with pytest.raises(ConfigError, match="overflows float32"):
        TableConfig("t", 4, optimizer=opt)


def test_sgd_lr_at_float32_max_is_accepted():
    assert TableConfig("t", 4, optimizer=SGD(lr=FLOAT32_MAX)).optimizer.lr == FLOAT32_MAX


@pytest.mark.parametrize("policy", [["lru"], {"lru": 1}, None, 3])
def test_tierconfig_policy_not_a_string(policy):
    with pytest.raises(ConfigError, match="policy"):
        TierConfig(4, policy=policy)


@pytest.mark.parametrize("device", [["cpu"], None])
def test_tierconfig_device_not_a_string(device):
    with pytest.raises(ConfigError, match="device"):
        TierConfig(4, device=device)


@pytest.mark.parametrize("name", ["a\n", "a\r\n", "\na", "a b", "", "x" * 201])
def test_table_name_must_match_entirely(name):
    with pytest.raises(ConfigError, match="name"):
        TableConfig(name, 4)


def test_table_names_that_are_valid():
    for name in ("a", "C1", "user.id-2_x", "x" * 200):
        assert TableConfig(name, 4).name == name


@pytest.mark.parametrize("size", [2**70, 2**64, MAX_MAP_SIZE_BYTES + 1, (1 << 20) - 1])
def test_tierconfig_map_size_out_of_range(size):
    with pytest.raises(ConfigError, match="map_size_bytes") as e:
        TierConfig(4, map_size_bytes=size)
    assert "2**48" in e.value.hint


def test_tierconfig_map_size_limits_are_accepted():
    assert MAX_MAP_SIZE_BYTES == 2**48
    assert TierConfig(4, map_size_bytes=MAX_MAP_SIZE_BYTES).map_size_bytes == 2**48
    assert TierConfig(4, map_size_bytes=1 << 20).map_size_bytes == 1 << 20


@pytest.mark.parametrize("value", [1, "yes", None])
def test_tierconfig_tune_malloc_must_be_a_bool(value):
    with pytest.raises(ConfigError, match="tune_malloc") as e:
        TierConfig(4, tune_malloc=value)
    assert "True or False" in e.value.hint
