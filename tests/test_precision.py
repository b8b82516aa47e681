"""Row precision: the rounding into float16 / bfloat16 / int8 rows, and a store of each dtype
(bitwise against the reference, across tier sizes, the pooled step and the prefetch window)."""

import numpy as np
import pytest

from tiered_emb import Adagrad, Adam, ConfigError, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.precision import decode, encode, records_of, rounding_key, row_range, values_of
from tiered_emb.step.plan import plan_bags
from tiered_emb.testing.reference import ReferenceStore, pool_bags
from tiered_emb.tiers.ssd.codec import TOMBSTONE_WORD

NARROW = ("float16", "bfloat16", "int8")


def _values(n: int = 40_000) -> np.ndarray:
    rng = np.random.default_rng(0)
    scales = (1e-9, 1e-6, 1e-3, 1.0, 1e2, 6e4, 1e6, 1e37)
    x = np.concatenate([rng.standard_normal(n).astype(np.float32) * np.float32(s) for s in scales])
    edges = [0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-30, 3.4e38]
    return np.concatenate([x, np.array(edges, np.float32)])


def _bf16_nearest(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits of finite ``x`` rounded to nearest even: the well-known integer form."""
    b = x.view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _patterns(dtype, x, key=None, generic=False):
    words = np.zeros((x.shape[0], 1), np.float32)
    encode(dtype, x[:, None], words, None, np.arange(x.shape[0]), key, generic=generic)
    return words.view(np.uint16)[:, 0]


def test_round_to_nearest_is_numpy_float16_and_bfloat16_bit_for_bit():
    x = _values()
    with np.errstate(over="ignore"):
        assert (_patterns("float16", x) == x.astype(np.float16).view(np.uint16)).all()
    finite = np.isfinite(x)
    assert (_patterns("bfloat16", x)[finite] == _bf16_nearest(x[finite])).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("key", [None, 12345])
def test_fast_path_is_the_arithmetic_path_bit_for_bit(dtype, key):
    x = _values()
    assert (_patterns(dtype, x, key) == _patterns(dtype, x, key, generic=True)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fast_path_is_the_arithmetic_path_on_random_bits(dtype):
    """Every float32 exponent, float16's subnormal band and its edges most of all (the fast
    path's fixed-point rounding there), both signs, stochastic and to nearest."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    exponent = rng.integers(60, 150, 100_000).astype(np.uint32)
    bits[:100_000] = (bits[:100_000] & np.uint32(0x807FFFFF)) | (exponent << np.uint32(23))
    x = bits.view(np.float32)
    for key in (None, 12345, 1 << 63):
        assert (_patterns(dtype, x, key) == _patterns(dtype, x, key, generic=True)).all(), key


@pytest.mark.parametrize("dtype", NARROW)
def test_stochastic_rounding_is_unbiased(dtype):
    """200k roundings of the same row (a different id each): the mean is the value to within
    six standard deviations of the mean of a two-point draw, per column."""
    n, dim = 200_000, 4
    row = np.array([0.1, -0.3337, 1.0e-3, 0.7], np.float32)
    if dtype == "int8":  # (int8 quantizes a row against its own range: give it one)
        row = np.array([0.1, -0.3337, 0.5, 0.7], np.float32)
    words = np.zeros((n, 8), np.float32)
    encode(dtype, np.tile(row, (n, 1)), words, None, np.arange(n), rounding_key(1, 2, 3, 0))
    back = decode(dtype, words, None, dim).astype(np.float64)
    lo, hi = back.min(axis=0), back.max(axis=0)
    inner = [0, 2] if dtype == "int8" else [0, 1, 2, 3]  # (an int8 row's min and max are exact)
    assert (hi[inner] > lo[inner]).all()  # two neighbours each: it did round both ways
    assert (hi == lo).sum() == dim - len(inner)
    lo, hi, row = lo[inner], hi[inner], row[inner].astype(np.float64)
    back = back[:, inner]
    p = (row - lo) / (hi - lo)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / n)
    assert (np.abs(back.mean(axis=0) - row) <= 6 * sigma + 1e-12).all()


def test_stochastic_bits_are_a_function_of_key_id_and_column():
    x = np.full((1000, 3), 0.1, np.float32)
    a, b, c = (np.zeros((1000, 2), np.float32) for _ in range(3))
    encode("float16", x, a, None, np.arange(1000), rounding_key(7, 1, 4, 0))
    encode("float16", x[::-1].copy(), b, np.arange(999, -1, -1), np.arange(999, -1, -1), rounding_key(7, 1, 4, 0))
    encode("float16", x, c, None, np.arange(1000), rounding_key(7, 1, 5, 0))
    assert a.tobytes() == b.tobytes()  # (order and slots do not matter)
    assert a.tobytes() != c.tobytes()  # (another step draws other bits)


@pytest.mark.parametrize("key", [None, 99])
def test_int8_error_within_the_rows_scale(key):
    rng = np.random.default_rng(1)
    v = rng.standard_normal((3000, 37)).astype(np.float32) * rng.uniform(1e-3, 1e3, (3000, 1)).astype(np.float32)
    v[0] = 0.25  # a constant row: exact, at a scale that is not zero
    words = np.zeros((3000, TableConfig("t", 37, dtype="int8").weight_words), np.float32)
    encode("int8", v, words, None, np.arange(3000), key)
    scale = words[:, 0]
    assert np.isfinite(scale).all() and (scale > 0).all()
    assert (words[:, 0].view(np.uint32) != TOMBSTONE_WORD).all()
    err = np.abs(decode("int8", words, None, 37) - v)
    bound = scale[:, None] * (0.5 if key is None else 1.0) * (1 + 1e-5) + 1e-6 * np.abs(v)
    assert (err <= bound).all()
    assert (err[0] == 0).all()


def _range_in_order(v):
    lo = hi = v[0]
    for x in v[1:]:
        lo = x if x < lo else lo
        hi = x if x > hi else hi
    return lo, hi


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 47, 64, 100, 128])
def test_int8_row_range_is_the_loop_in_order_bit_for_bit(n):
    """An int8 row's (min, max), sixteen lanes at a time, is the loop's in order: the zero of
    the sign that comes first, a NaN passed over unless it comes first."""
    rng = np.random.default_rng(n)
    for case in range(64):
        v = rng.standard_normal(n).astype(np.float32)
        if case % 4 == 1:  # zeros of both signs, the smallest or largest values
            v = np.abs(v) if case % 8 == 1 else -np.abs(v)
            at = rng.choice(n, min(n, 3), replace=False)
            v[at] = rng.choice(np.array([0.0, -0.0], np.float32), at.shape[0])
        elif case % 4 == 2:  # NaNs, sometimes first
            v[rng.choice(n, min(n, 2), replace=False)] = np.nan
            if case % 8 == 2:
                v[0] = np.nan
        elif case % 4 == 3:  # ties away from zero
            v = np.round(v).astype(np.float32)
        got, want = row_range(v), _range_in_order(v)
        assert np.array(got, np.float32).view(np.uint32).tolist() == np.array(want, np.float32).view(np.uint32).tolist()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_odd_dim_pads_with_a_zero_half_word(dtype):
    words = np.full((5, 4), np.nan, np.float32)
    cfg = TableConfig("t", dim=7, dtype=dtype, optimizer=RowWiseAdagrad())
    encode(dtype, np.ones((5, 7), np.float32), words)
    assert (words.view(np.uint16)[:, 7] == 0).all() and cfg.record_width == 5


def test_unknown_dtype_is_a_config_error_with_the_choices():
    with pytest.raises(ConfigError, match="int8"):
        TableConfig("t", dim=4, dtype="fp8")


def _train(path, dtype, tiers, steps=6, pooled=False, prefetch=False, state="float32"):
    """A few steps over a narrow table (and an Adam one, its state in ``state``) with ``tiers``;
    returns the store's records."""
    tables = [
        TableConfig("r", dim=10, dtype=dtype, optimizer=RowWiseAdagrad(lr=0.2)),
        TableConfig("a", dim=5, dtype=dtype, optimizer=Adam(lr=0.05), state_dtype=state),
    ]
    ref = ReferenceStore(tables, seed=3)
    rng = np.random.default_rng(5)
    with TieredStore.create(path, tables, tiers, seed=3) as s:
        for _ in range(steps):
            for t in tables:
                ids = rng.integers(0, 60, 48)
                offsets = np.arange(0, 49, 4)
                g = rng.standard_normal((12, t.dim)).astype(np.float32)
                bags = plan_bags(ids, offsets)
                if pooled:
                    ticket = s.prefetch({t.name: ids}) if prefetch else None
                    if ticket is not None:
                        with s.engine.stepping(ticket):
                            out, fwd = s.engine.lookup_pooled(t.name, bags)
                            s.engine.apply_pooled_gradients(t.name, fwd, g)
                        s.release(ticket)
                    else:
                        out, fwd = s.engine.lookup_pooled(t.name, bags)
                        s.engine.apply_pooled_gradients(t.name, fwd, g)
                    want = np.zeros((12, t.dim), np.float32)
                    pool_bags(ref.lookup(t.name, ids), offsets, np.empty(0, np.float32), False, False, want)
                    assert out.tobytes() == want.tobytes()
                    per_id = np.repeat(g, 4, axis=0)
                else:
                    per_id = rng.standard_normal((48, t.dim)).astype(np.float32)
                    s.apply_gradients(t.name, ids, per_id)
                ref.apply_gradients(t.name, ids, per_id)
            s.advance_step()
            ref.advance_step()
        for t in tables:
            got = s.peek(t.name, np.arange(60), with_state=True)
            assert got.tobytes() == ref.peek_records(t.name, np.arange(60)).tobytes()
        return {t.name: s.peek(t.name, np.arange(60), with_state=True) for t in tables}


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("pooled,prefetch", [(False, False), (True, False), (True, True)])
def test_narrow_store_is_the_reference_bit_for_bit_on_any_tiers(tmp_path, dtype, pooled, prefetch):
    big = _train(tmp_path / "big", dtype, TierConfig(64, 0, "lru", "cpu"), pooled=pooled, prefetch=prefetch)
    small = _train(tmp_path / "small", dtype, TierConfig(12, 8, "lfu", "cpu"), pooled=pooled, prefetch=prefetch)
    assert all(big[n].tobytes() == small[n].tobytes() for n in big)


def _store_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_16_bit_store_takes_at_most_055x_the_disk_bytes(tmp_path):
    """The same 20k rows of dim 64 (row-wise Adagrad), written and checkpointed uncompressed."""
    rows = np.random.default_rng(0).standard_normal((20_000, 64)).astype(np.float32)
    sizes = {}
    for dtype in ("float32", "float16", "int8"):
        cfg = TableConfig("t", dim=64, dtype=dtype, optimizer=RowWiseAdagrad())
        with TieredStore.create(tmp_path / dtype, [cfg], TierConfig(1000, 0, "lru", "cpu", ssd_compression=None)) as s:
            s.write("t", np.arange(20_000), rows)
            s.checkpoint()
        sizes[dtype] = _store_bytes(tmp_path / dtype)
    assert sizes["float16"] <= 0.55 * sizes["float32"], sizes
    assert sizes["int8"] <= 0.35 * sizes["float32"], sizes


def test_peek_decodes_and_the_record_words_hold_the_dtype(tmp_path):
    cfg = TableConfig("t", dim=3, dtype="bfloat16", optimizer=RowWiseAdagrad())
    with TieredStore.create(tmp_path / "s", [cfg], TierConfig(4, 0, "lru", "cpu")) as s:
        s.write("t", [1], np.array([[1.0, 1.00390625, -2.5]], np.float32))
        np.testing.assert_array_equal(s.peek("t", [1]), [[1.0, 1.0, -2.5]])  # (ties to even)
        assert s.peek("t", [1], with_state=True).shape == (1, 4)
    words = np.zeros((1, cfg.record_width), np.float32)
    encode("bfloat16", np.array([[1.0, 1.0, -2.5]], np.float32), words)
    assert values_of(cfg, words)[0, :3].tolist() == [1.0, 1.0, -2.5]


def test_nearest_loses_small_updates_that_stochastic_rounding_keeps_on_average(tmp_path):
    """SGD steps of 1e-4 on float16 rows at 1.0 (a step of the dtype there: 2**-10 above,
    2**-11 below): to nearest every one is lost; stochastically 50 of them move the
    rows' mean by 50 * 1e-4 give or take its standard deviation."""
    from tiered_emb import SGD

    ids = np.arange(2000)
    means = {}
    for rounding in ("nearest", "stochastic"):
        cfg = TableConfig("t", dim=4, dtype="float16", optimizer=SGD(lr=1e-4), rounding=rounding)
        with TieredStore.create(tmp_path / rounding, [cfg], TierConfig(4096, 0, "lru", "cpu")) as s:
            s.write("t", ids, np.ones((2000, 4), np.float32))
            for _ in range(50):
                s.apply_gradients("t", ids, np.ones((2000, 4), np.float32))
                s.advance_step()
            means[rounding] = float(s.peek("t", ids).astype(np.float64).mean())
    assert means["nearest"] == 1.0
    assert abs(means["stochastic"] - (1.0 - 50e-4)) < 2e-4, means


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize(
    "opt, state",
    [
        ("rowwise_adagrad", "float32"),
        ("sgd", "float32"),
        ("adagrad", "float32"),
        ("adam", "float32"),
        ("adagrad", "bfloat16"),
        ("adam", "bfloat16"),
    ],
)
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
def test_fused_updates_are_the_unfused_path_bit_for_bit(dtype, opt, state, decay):
    """The fused kernels (decode, step, round in one pass; int8 quantized again; a bfloat16
    state's arrays too, each from its own bits) against rows decoded to float32, the float32
    kernel, and :func:`records_of`: values across float16's subnormal and normal ranges, an
    odd first column (a column-wise shard's), given row means."""
    from tiered_emb import SGD
    from tiered_emb.step import narrow
    from tiered_emb.step.update import apply_update

    kw = {} if decay == "none" else {"weight_decay": 0.01, "weight_decay_mode": decay}
    optimizer = {"rowwise_adagrad": RowWiseAdagrad, "sgd": SGD, "adagrad": Adagrad, "adam": Adam}[opt](lr=0.1, **kw)
    rng = np.random.default_rng(3)
    for col0, dim, given in ((0, 33, False), (5, 33, False), (0, 33, True)):
        cfg = TableConfig("t", dim=dim, dtype=dtype, optimizer=optimizer, init_column=col0, state_dtype=state)
        k = 301  # (row-wise Adagrad's kernels take rows four at a time: one left over)
        values = np.zeros((k, cfg.value_width), np.float32)
        values[:, :dim] = rng.standard_normal((k, dim)).astype(np.float32) * np.float32(10.0) ** rng.integers(
            -9, 3, (k, 1)
        )
        values[:, dim:] = rng.uniform(0, 1, (k, cfg.value_width - dim)).astype(np.float32)
        if opt == "adam":  # (its step count: whole numbers)
            values[:, 3 * dim] = rng.integers(0, 50, k)
        records = np.zeros((k + 5, cfg.record_width), np.float32)
        slots = rng.permutation(k + 5)[:k].astype(np.int64)
        ids = rng.integers(0, 1 << 40, k)
        records[slots] = records_of(cfg, values)
        grads = rng.standard_normal((k, dim)).astype(np.float32) * np.float32(1e-3)
        means = (grads.astype(np.float64) ** 2).mean(axis=1).astype(np.float32) * 3 if given else None
        means = means if opt == "rowwise_adagrad" else None
        want = records.copy()
        vals = values_of(cfg, want, slots)
        apply_update(optimizer, vals, np.arange(k, dtype=np.int64), grads, None, means)
        want[slots] = records_of(cfg, vals, ids, 777, col0)
        assert narrow.update(cfg, records, slots, ids, grads, 777, means)
        assert records.tobytes() == want.tobytes(), (col0, dim)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bfloat16_state_is_the_reference_bit_for_bit_on_any_tiers(tmp_path, dtype):
    """Adam's m and v in bfloat16 (rounded stochastically, each array from its own bits)."""
    big = _train(tmp_path / "big", dtype, TierConfig(64, 0, "lru", "cpu"), pooled=True, prefetch=True, state="bfloat16")
    small = _train(tmp_path / "small", dtype, TierConfig(12, 8, "lfu", "cpu"), pooled=True, state="bfloat16")
    assert big["a"].tobytes() == small["a"].tobytes()
    _train(tmp_path / "plain", dtype, TierConfig(12, 8, "lru", "cpu"), state="bfloat16")  # (apply_gradients)
    cfg = TableConfig("a", dim=64, optimizer=Adam(), state_dtype="bfloat16")
    assert cfg.record_width == 64 + 2 * 32 + 1  # (against 193 words in float32)


def test_a_state_dtype_the_optimizer_cannot_hold_is_a_config_error():
    from tiered_emb import SGD, Adagrad

    with pytest.raises(ConfigError, match="6e-8"):
        TableConfig("t", dim=4, optimizer=Adagrad(), state_dtype="float16")
    with pytest.raises(ConfigError, match="nothing to narrow"):
        TableConfig("t", dim=4, optimizer=RowWiseAdagrad(), state_dtype="bfloat16")
    with pytest.raises(ConfigError, match="nothing to narrow"):
        TableConfig("t", dim=4, optimizer=SGD(), state_dtype="bfloat16")
    with pytest.raises(ConfigError, match="precision"):
        TableConfig("t", dim=4, optimizer=Adam(), state_dtype="fp8")
