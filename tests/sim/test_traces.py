"""Trace sources: seeded and deterministic, and every reader round-trips."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_emb.errors import ConfigError, IdRangeError, IdTypeError, TraceFileError
from tiered_emb.sim import (
    drift_ids,
    next_use_of,
    read_column,
    read_criteo,
    read_npy,
    read_oracle_general,
    table_batches,
    write_npy,
    write_oracle_general,
    zipf_ids,
)
from tiered_emb.sim.traces import CDF_MAX_IDS, ORACLE_GENERAL_DTYPE, zipf_ranks_rejection

ids_lists = st.lists(st.integers(0, 2**62), min_size=0, max_size=200)


def test_zipf_unchanged_and_seeded():
    a = zipf_ids(1000, 1.05, 5000, seed=3)
    assert np.array_equal(a, zipf_ids(1000, 1.05, 5000, seed=3))
    assert not np.array_equal(a, zipf_ids(1000, 1.05, 5000, seed=4))
    # rank 0 is the hottest id and sits at the scatter image of 0
    assert np.bincount(a).argmax() == 12345 % 1000


@given(
    st.integers(1, 5000),
    st.sampled_from([0.0, 0.3, 1.05, 2.5]),
    st.integers(0, 2**32),
)
def test_zipf_table_draw_is_the_inverse_cdf(n_ids, alpha, seed):
    """Under the table's size a draw is the inverse CDF of the seed's uniform draws,
    ``searchsorted(cdf, u, side="right")`` exactly (the guided search finds the same rank)."""
    cdf = np.cumsum(np.arange(1, n_ids + 1, dtype=np.float64) ** -alpha)
    cdf /= cdf[-1]
    u = np.random.default_rng(seed).random(3000)
    expect = np.minimum(np.searchsorted(cdf, u, side="right"), n_ids - 1)
    assert np.array_equal(zipf_ids(n_ids, alpha, 3000, seed=seed, scatter=False), expect)


def test_drift_moves_the_hot_set():
    tr = drift_ids(1000, 1.2, 20_000, seed=0, period=10_000, shift=100)
    first, second = np.bincount(tr[:10_000], minlength=1000), np.bincount(tr[10_000:], minlength=1000)
    assert (first.argmax() + 100) % 1000 == second.argmax()
    assert np.array_equal(tr, drift_ids(1000, 1.2, 20_000, seed=0, period=10_000, shift=100))
    with pytest.raises(ConfigError, match="period"):
        drift_ids(10, 1.0, 10, seed=0, period=0)


def test_table_batches_shape_and_tags():
    tr = table_batches([100, 50], [1.2, 0.7], batch_size=8, pooling=[2, 3], n_batches=4, seed=1)
    per_batch = 8 * 2 + 8 * 3
    assert tr.shape == (4 * per_batch,)
    tables = (tr >> 40).reshape(4, per_batch)
    assert (tables[:, :16] == 0).all() and (tables[:, 16:] == 1).all()
    assert ((tr & ((1 << 40) - 1)) < 100).all()
    with pytest.raises(ConfigError, match="one entry per table"):
        table_batches([1], [1.0, 2.0], 1, [1], 1, seed=0)


@given(ids_lists)
def test_npy_round_trip(tmp_path_factory, ids):
    p = tmp_path_factory.mktemp("npy") / "t.npy"
    write_npy(p, np.array(ids, dtype=np.int64))
    assert read_npy(p).tolist() == ids


@given(ids_lists)
def test_oracle_general_round_trip(tmp_path_factory, ids):
    p = tmp_path_factory.mktemp("og") / "t.oracleGeneral"
    arr = np.array(ids, dtype=np.int64)
    write_oracle_general(p, arr)
    got, nxt = read_oracle_general(p, with_next_access=True)
    assert got.tolist() == ids
    expect = next_use_of(arr)
    expect[expect == len(ids)] = -1
    assert nxt.tolist() == expect.tolist()
    assert p.stat().st_size == 24 * len(ids)


def test_oracle_general_layout(tmp_path):
    p = tmp_path / "t.bin"
    write_oracle_general(p, np.array([5, 6, 5]))
    rec = np.fromfile(p, dtype=ORACLE_GENERAL_DTYPE)
    assert rec["clock_time"].tolist() == [0, 1, 2]
    assert rec["obj_size"].tolist() == [1, 1, 1]
    assert rec["next_access_vtime"].tolist() == [2, -1, -1]


@given(st.lists(st.integers(0, 10**12), min_size=1, max_size=50))
def test_column_round_trip(tmp_path_factory, ids):
    d = tmp_path_factory.mktemp("col")
    (d / "t.csv").write_text("user,item\n" + "".join(f"{i % 7},{x}\n" for i, x in enumerate(ids)))
    assert read_column(d / "t.csv", 1, header=True).tolist() == ids
    (d / "t.tsv").write_text("".join(f"{x:x}\tz\n" for x in ids))
    assert read_column(d / "t.tsv", 0, base=16).tolist() == ids
    (d / "t.txt").write_text("".join(f"{i}  {x}\n" for i, x in enumerate(ids)))
    assert read_column(d / "t.txt", 1).tolist() == ids


def test_criteo_reader(tmp_path):
    row = ["1"] + [""] * 13 + ["68fd1e64", ""] + ["0000000a"] * 24
    (tmp_path / "c.tsv").write_text("\t".join(row) + "\n" + "\t".join(row))
    tr = read_criteo(tmp_path / "c.tsv")
    assert tr.shape == (50,)
    assert tr[0] == (14 << 32) | 0x68FD1E64 and tr[1] == (16 << 32) | 10


def test_reader_errors(tmp_path):
    with pytest.raises(TraceFileError, match="does not exist"):
        read_npy(tmp_path / "nope.npy")
    (tmp_path / "bad.bin").write_bytes(b"x" * 25)
    with pytest.raises(TraceFileError, match="multiple of 24"):
        read_oracle_general(tmp_path / "bad.bin")
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(TraceFileError, match="not an id"):
        read_column(tmp_path / "t.csv", 0)
    with pytest.raises(TraceFileError, match="no column 5"):
        read_column(tmp_path / "t.csv", 5)
    with pytest.raises(IdRangeError, match=">= 0"):
        write_oracle_general(tmp_path / "n.bin", np.array([-3]))


def test_libcachesim_reads_our_oracle_general(tmp_path):
    lcs = pytest.importorskip("libcachesim")
    tr = zipf_ids(500, 1.0, 5000, seed=0)
    p = tmp_path / "t.oracleGeneral"
    write_oracle_general(p, tr)
    reader = lcs.TraceReader(str(p), lcs.TraceType.ORACLE_GENERAL_TRACE)
    assert reader.get_num_of_req() == tr.shape[0]


def test_shared_data(sim_shared_data):
    crit = read_criteo(sim_shared_data / "criteo_sample_900.tsv")
    assert crit.shape[0] > 900 and (crit >> 32).min() >= 14
    items = read_column(sim_shared_data / "amazon_video_user_item.txt", 1)
    assert items.shape == (287_107,) and items.min() >= 1


def _criteo_row(tmp_path, field14):
    row = ["0"] + ["1"] * 13 + ["68fd1e64"] * 26
    row[14] = field14
    p = tmp_path / "c.tsv"
    p.write_text("\t".join(row) + "\n")
    return p


@pytest.mark.parametrize(
    "content,match",
    [
        (b"", "not a readable"),  # EOFError
        (b"hello world", "not a readable"),  # ValueError (pickled data)
    ],
)
def test_read_npy_bad_files(tmp_path, content, match):
    p = tmp_path / "x.npy"
    p.write_bytes(content)
    with pytest.raises(TraceFileError, match=match):
        read_npy(p)


def test_read_npy_bad_arrays(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, np.arange(100, dtype=np.int64))
    p.write_bytes(p.read_bytes()[:-8])
    with pytest.raises(TraceFileError, match="not a readable"):  # ValueError: failed to read all data
        read_npy(p)
    np.save(p, np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(TraceFileError, match="not a readable"):  # ValueError: object arrays
        read_npy(p)
    np.savez(tmp_path / "z.npz", a=np.arange(3))
    with pytest.raises(TraceFileError, match="npz"):  # AttributeError
        read_npy(tmp_path / "z.npz")
    np.save(p, np.array([2**64 - 1, 3], dtype=np.uint64))
    with pytest.raises(IdRangeError, match="beyond int64"):  # was [-1, 3], silently
        read_npy(p)


def test_read_column_bad_input(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text(f"1,2\n{2**63},4\n")
    with pytest.raises(IdRangeError, match="id number 2"):  # OverflowError
        read_column(p)
    with pytest.raises(ConfigError, match="column=-5"):  # IndexError (and -1 read the last column)
        read_column(p, column=-5)
    with pytest.raises(ConfigError, match="delimiter"):  # ValueError: empty separator
        read_column(p, delimiter="")
    with pytest.raises(ConfigError, match="base=1"):
        read_column(p, base=1)
    p.write_bytes(b"1\n\xff\xfe\n")
    with pytest.raises(TraceFileError, match="UTF-8"):  # UnicodeDecodeError
        read_column(p)


@pytest.mark.parametrize(
    "field,match",
    [
        ("-1", "32-bit"),  # was id -1, silently
        ("100000001", "32-bit"),  # was (15 << 32) | 1: column 15's id
        ("ffffffffffffffffff", "32-bit"),
    ],
)  # OverflowError
def test_criteo_hashes_are_32_bits(tmp_path, field, match):
    with pytest.raises(TraceFileError, match=match):
        read_criteo(_criteo_row(tmp_path, field))
    assert read_criteo(_criteo_row(tmp_path, "ffffffff"))[0] == (14 << 32) | 0xFFFFFFFF


def test_criteo_columns(tmp_path):
    p = _criteo_row(tmp_path, "1f")
    with pytest.raises(ConfigError, match="empty"):  # ValueError: max() of nothing
        read_criteo(p, columns=[])
    with pytest.raises(ConfigError, match="column"):  # a negative tag
        read_criteo(p, columns=[-1])
    assert read_criteo(p, columns=[14]).tolist() == [(14 << 32) | 0x1F]


def test_oracle_general_bad_input(tmp_path):
    rec = np.zeros(2, ORACLE_GENERAL_DTYPE)
    rec["obj_id"] = [2**64 - 1, 5]
    rec.tofile(tmp_path / "o.bin")
    with pytest.raises(IdRangeError, match="relabel"):  # was [-1, 5], silently
        read_oracle_general(tmp_path / "o.bin")
    out = tmp_path / "x.bin"
    with pytest.raises(IdTypeError, match="float64"):  # was written as [1, 2]
        write_oracle_general(out, np.array([1.7, 2.2]))
    with pytest.raises(IdTypeError, match="shape"):
        write_oracle_general(out, np.array([[1, 2], [3, 4]]))
    with pytest.raises(ConfigError, match="obj_size"):  # OverflowError
        write_oracle_general(out, np.array([1, 2]), obj_size=-1)
    with pytest.raises(ConfigError, match="clock_time"):  # ValueError: could not broadcast
        write_oracle_general(out, np.array([1, 2]), clock_time=np.array([1, 2, 3]))
    with pytest.raises(TraceFileError, match="not a directory"):  # FileNotFoundError
        write_oracle_general(tmp_path / "nodir" / "x.bin", np.array([1, 2]))
    assert not out.exists()
    with pytest.raises(IdTypeError, match="float64"):  # was written as [1, 2]
        write_npy(tmp_path / "f.npy", np.array([1.7, 2.2]))


def test_synthetic_arguments():
    with pytest.raises(ConfigError, match="n_ids"):  # IndexError
        zipf_ids(0, 1.0, 10, seed=0)
    with pytest.raises(ConfigError, match="alpha"):  # every id the same, silently
        zipf_ids(1000, float("nan"), 100, seed=0)
    with pytest.raises(ConfigError, match="size"):  # ValueError: negative dimensions
        zipf_ids(10, 1.0, -1, seed=0)
    with pytest.raises(ConfigError, match="seed"):  # ValueError from SeedSequence
        zipf_ids(10, 1.0, 5, seed=-1)
    with pytest.raises(ConfigError, match="more than 2\\*\\*table_bits"):  # tags 1..6 on table 0's ids
        table_batches([100, 100], [1.0, 1.0], 8, [1, 1], 4, 0, table_bits=4)
    with pytest.raises(ConfigError, match="pooling"):
        table_batches([100], [1.0], 8, [0], 4, 0)
    # the boundary still works: 16 ids in 4 bits
    tr = table_batches([16, 16], [1.0, 1.0], 8, [1, 1], 4, 0, table_bits=4)
    assert ((tr.reshape(4, 16)[:, :8] >> 4) == 0).all()


def test_criteo_tsv_clicks_bad_lines(tmp_path):
    from tiered_emb.apps.clicks import CriteoTSV

    row = ["1"] + ["3"] * 13 + ["68fd1e64"] * 26
    good = "\t".join(row) + "\n"
    p = tmp_path / "c.tsv"
    p.write_text(good * 3 + "\t".join(["x"] + row[1:]) + "\n")
    with pytest.raises(ConfigError, match="line 4"):  # ValueError: could not convert 'x'
        CriteoTSV(p, 100, 2)
    p.write_text(good * 3)
    with pytest.raises(ConfigError, match="num_rows"):  # ZeroDivisionError (modulo 0)
        CriteoTSV(p, 0, 2)
    assert len(CriteoTSV(p, 100, 2)) == 3


@pytest.mark.parametrize("alpha", [0.5, 1.0, 1.05, 1.5])
def test_zipf_by_rejection_has_the_zipf_distribution(alpha):
    """Rejection-inversion's ranks against the exact masses: chi-square over 1,000 ranks
    of 1M seeded draws (its mean is the degrees of freedom, its spread sqrt(2 dof) = 45)."""
    n = 1000
    r = zipf_ranks_rejection(n, alpha, 1_000_000, np.random.default_rng(11))
    assert r.min() >= 0 and r.max() < n
    w = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    p = w / w.sum()
    chi2 = float((((np.bincount(r, minlength=n) / r.shape[0] - p) ** 2) / p).sum() * r.shape[0])
    assert abs(chi2 - (n - 1)) < 5 * np.sqrt(2 * (n - 1)), chi2


def test_zipf_above_the_table_size_is_seeded_and_a_prefix():
    n = CDF_MAX_IDS + 7
    a = zipf_ids(n, 1.05, 200_000, seed=5)
    assert np.array_equal(a, zipf_ids(n, 1.05, 200_000, seed=5))
    assert np.array_equal(a[:1000], zipf_ids(n, 1.05, 1000, seed=5))
    assert a.min() >= 0 and a.max() < n
    values, counts = np.unique(a, return_counts=True)
    assert values[counts.argmax()] == 12345  # rank 0, the hottest, at the scatter image of 0
    u = zipf_ids(n, 0.0, 100_000, seed=5)  # uniform
    assert u.min() >= 0 and u.max() < n and np.unique(u).shape[0] > 98_000  # (collisions: ~1,190 expected)


def test_zipf_over_1e9_ids_costs_the_trace_alone():
    """The table of a 1e9-id space would be 12 GB: a child process draws 65,536 ids from it
    in a few MiB beyond what importing takes."""
    code = (
        "import resource\n"
        "from tiered_emb.sim import zipf_ids\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "ids = zipf_ids(1_000_000_000, 1.05, 65_536, seed=1)\n"
        "assert 0 <= ids.min() and ids.max() < 1_000_000_000\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 64, out.stdout  # MiB of peak RSS the draw added
