"""First values of rows never written: the kernel against a plain-Python reference of the
hash, and the in-place fill against the buffer it replaces."""

import math

import numpy as np
import pytest

from tiered_emb import Normal, RowWiseAdagrad, TableConfig, Uniform
from tiered_emb.init import init_rows, init_rows_into, table_hash

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix(x: int) -> int:
    z = (x + _GOLDEN) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def reference_row(cfg: TableConfig, i: int, seed: int) -> list[float]:
    """The weights of row ``i`` as init.py's module doc defines them, in Python integers."""
    base = _splitmix(seed & _M) ^ _splitmix(table_hash(cfg.init_table or cfg.name))
    key = _splitmix(base ^ _splitmix(i))
    out = []
    for jj in range(cfg.dim):
        j = jj + cfg.init_column
        if isinstance(cfg.init, Normal):
            x1 = _splitmix((key + (2 * j + 1) * _GOLDEN) & _M)
            x2 = _splitmix((key + (2 * j + 2) * _GOLDEN) & _M)
            u1 = ((x1 >> 11) + 1.0) * 1.1102230246251565e-16
            u2 = (x2 >> 11) * 1.1102230246251565e-16
            z = math.sqrt(-2.0 * math.log(u1)) * math.cos(6.283185307179586 * u2)
            out.append(float(np.float32(cfg.init.mean + cfg.init.std * z)))
        else:
            u = (_splitmix((key + (j + 1) * _GOLDEN) & _M) >> 11) * 1.1102230246251565e-16
            out.append(float(np.float32(cfg.init.low + (cfg.init.high - cfg.init.low) * u)))
    return out


TABLES = [
    TableConfig("t", dim=5, optimizer=RowWiseAdagrad()),
    TableConfig("n", dim=3, init=Normal(0.5, 2.0), optimizer=RowWiseAdagrad()),
    TableConfig("u", dim=4, init=Uniform(-1.0, 3.0)),
]


@pytest.mark.parametrize("cfg", TABLES, ids=lambda c: c.name)
def test_initial_rows_are_the_hash_of_seed_table_and_id(cfg):
    ids = np.array([0, 7, 123_456_789, 2**40 + 3], dtype=np.int64)
    rows = init_rows(cfg, ids, 11)
    for r, i in enumerate(ids.tolist()):
        assert rows[r, : cfg.dim].tolist() == pytest.approx(reference_row(cfg, i, 11), rel=0, abs=2e-7)
    assert not rows[:, cfg.dim :].any()  # optimizer state starts at zero


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("cfg", TABLES, ids=lambda c: c.name)
def test_filling_rows_in_place_gives_the_records_init_rows_gives(cfg, dtype):
    cfg = TableConfig(cfg.name, dim=cfg.dim, init=cfg.init, optimizer=cfg.optimizer, dtype=dtype)
    ids = np.array([9, 4, 100, 3], dtype=np.int64)
    out = np.full((7, cfg.record_width), 42.0, dtype=np.float32)
    at = np.array([5, 0, 2, 6], dtype=np.int64)
    init_rows_into(cfg, ids, 3, out, at)
    assert out[at].tobytes() == init_rows(cfg, ids, 3).tobytes()
    assert (out[[1, 3, 4]] == 42.0).all()  # the other rows untouched
    init_rows_into(cfg, ids[:0], 3, out, at[:0])  # (nothing to fill)
    assert (out[[1, 3, 4]] == 42.0).all()
