"""Trace sources: seeded and deterministic, and every reader round-trips."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_emb.errors import ConfigError, TraceFileError
from tiered_emb.sim import (drift_ids, next_use_of, read_column, read_criteo, read_npy, read_oracle_general,
                            table_batches, write_npy, write_oracle_general, zipf_ids)
from tiered_emb.sim.traces import ORACLE_GENERAL_DTYPE

ids_lists = st.lists(st.integers(0, 2**62), min_size=0, max_size=200)


def test_zipf_unchanged_and_seeded():
    a = zipf_ids(1000, 1.05, 5000, seed=3)
    assert np.array_equal(a, zipf_ids(1000, 1.05, 5000, seed=3))
    assert not np.array_equal(a, zipf_ids(1000, 1.05, 5000, seed=4))
    # rank 0 is the hottest id and sits at the scatter image of 0
    assert np.bincount(a).argmax() == 12345 % 1000


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
    with pytest.raises(TraceFileError, match=">= 0"):
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
