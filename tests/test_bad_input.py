"""Bad input across the API: a typed error with a hint, raised before anything changes.

Each case here once gave a raw exception, a silent wrong result or lost pins (found by a
review); the error it gets now, and what stays as it was.
"""

import json
import shutil

import numpy as np
import pytest

from tiered_emb import SGD, TableConfig, TierConfig, TieredStore
from tiered_emb.errors import ConfigError, CorruptStoreError, IdTypeError, TieredEmbError, UnknownTableError


def _store(tmp_path, name="s", hbm_rows=8):
    return TieredStore.create(
        tmp_path / name,
        [TableConfig("t", dim=4, num_rows=100, optimizer=SGD(0.1))],
        TierConfig(hbm_rows=hbm_rows, ddr_rows=4, device="cpu"),
    )


# --------------------------------------------------------------------------- ids
def test_an_empty_list_of_ids_is_an_empty_batch(tmp_path):
    # np.asarray([]) is float64: it was an IdTypeError for a caller who passed no float
    with _store(tmp_path) as s:
        assert s.lookup("t", []).shape == (0, 4)
        assert s.peek("t", []).shape == (0, 4)
        s.apply_gradients("t", [], np.zeros((0, 4), np.float32))
        with pytest.raises(IdTypeError, match="dtype float64"):
            s.lookup("t", [1.0])  # a float id is still refused


def test_ragged_ids_are_an_id_type_error(tmp_path):
    with _store(tmp_path) as s:
        with pytest.raises(IdTypeError, match="do not make an array") as err:
            s.lookup("t", [[1, 2], [3]])
        assert "1-D integer array" in err.value.hint


def test_prefetch_with_a_table_name_that_is_not_a_str(tmp_path):
    # sorted() of {1, "t"} raised a raw TypeError
    with _store(tmp_path) as s:
        with pytest.raises(UnknownTableError):
            s.prefetch({1: np.array([1]), "t": np.array([2])})
        assert s.engine.prefetcher.outstanding == []  # nothing queued


def test_a_ticket_given_to_another_store(tmp_path):
    # b.release(a's ticket) marked it released, then raised a raw ValueError: a's own
    # release afterwards did nothing and its rows stayed pinned until close
    a, b = _store(tmp_path, "a"), _store(tmp_path, "b")
    try:
        tk = a.prefetch({"t": [1, 2, 3]})
        tk.wait()
        for call in (b.release, b.engine.bring_up, b.engine.read_ahead):
            with pytest.raises(ConfigError, match="a ticket of another store"):
                call(tk)
        with pytest.raises(ConfigError, match="a str was given"):
            a.release("ticket")
        assert not tk.released
        a.release(tk)
        a.engine.drain_prefetch()
        t = a.engine.table("t")
        assert t.hbm.unpinned_capacity == t.hbm.capacity_rows  # nothing left pinned
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------- stores on disk
def _made(tmp_path):
    with _store(tmp_path, "src") as s:
        s.write("t", np.arange(3), np.arange(12, dtype=np.float32).reshape(3, 4))
        s.checkpoint()
    return tmp_path / "src"


@pytest.mark.parametrize("change", ["renamed", "emptied", "added"])
def test_a_manifest_whose_tables_are_not_lmdb_s(tmp_path, change):
    # a renamed table opened without a word and answered with fresh rows
    src = _made(tmp_path)
    bad = tmp_path / change
    shutil.copytree(src, bad)
    m = json.loads((bad / "manifest.json").read_text())
    if change == "renamed":
        m["tables"][0]["name"] = "zz"
    elif change == "emptied":
        m["tables"] = []
    else:
        m["tables"].append(dict(m["tables"][0], name="u"))
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptStoreError, match="the manifest lists tables") as err:
        TieredStore.open(bad)
    assert "restore" in err.value.hint
    with pytest.raises(CorruptStoreError):  # the store stays closed and unchanged: again the same
        TieredStore.open(bad)
    with TieredStore.open(src) as s:  # the store it was copied from opens, its rows intact
        np.testing.assert_array_equal(s.peek("t", np.arange(3)), np.arange(12, dtype=np.float32).reshape(3, 4))


def test_a_deeply_nested_manifest(tmp_path):
    src = _made(tmp_path)
    (src / "manifest.json").write_text("[" * 100_000)  # json.loads raised a raw RecursionError
    with pytest.raises(CorruptStoreError, match="RecursionError"):
        TieredStore.open(src)


def test_create_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")  # Path.mkdir raised a raw NotADirectoryError
    with pytest.raises(ConfigError, match="cannot be made") as err:
        TieredStore.create(tmp_path / "f" / "s", [TableConfig("t", dim=4)], TierConfig(hbm_rows=4, device="cpu"))
    assert "parents are directories" in err.value.hint
    assert (tmp_path / "f").read_text() == "x"


# --------------------------------------------------------------------------- torch collection
def test_collection_checks_each_feature_of_a_shared_table(tmp_path):
    torch = pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbeddingBagCollection

    with _store(tmp_path) as s:
        before = s.peek("t", np.arange(5), with_state=True)
        ebc = TieredEmbeddingBagCollection(s, {"f1": "t", "f2": "t"})
        f2 = (torch.tensor([3]), torch.tensor([1]))
        # f1's lengths [3] for 2 values took f2's id into f1's bag, silently
        with pytest.raises(IdTypeError, match="lengths of feature 'f1' sum to 3 for 2 values"):
            ebc({"f1": (torch.tensor([1, 2]), torch.tensor([3])), "f2": f2})
        with pytest.raises(IdTypeError, match="lengths of feature 'f1'"):
            ebc({"f1": (torch.tensor([1, 2]), torch.tensor([3, -1])), "f2": f2})
        # 3 weights for f1's 2 values: its third weighted f2's id, silently
        with pytest.raises(ConfigError, match="per_sample_weights have shape"):
            ebc({"f1": (torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([1.0, 2.0, 3.0])), "f2": f2})
        np.testing.assert_array_equal(s.peek("t", np.arange(5), with_state=True), before)
        # right input still pools each feature on its own
        out = ebc({"f1": (torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([1.0, 2.0])), "f2": f2})
        rows = s.peek("t", np.arange(5))
        np.testing.assert_array_equal(out["f1"].detach().numpy(), (rows[1] + 2 * rows[2])[None])
        np.testing.assert_array_equal(out["f2"].detach().numpy(), rows[3][None])


def test_collection_feature_names_are_str(tmp_path):
    pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbeddingBagCollection

    with _store(tmp_path) as s, pytest.raises(ConfigError, match="feature name 1 is a int"):
        TieredEmbeddingBagCollection(s, {1: "t"})


# --------------------------------------------------------------------------- simulator
def test_zipf_over_more_ids_than_a_draw_tells_apart():
    """2**62 ids: a Zipf draw's ranks are float64, exact up to 2**53 ids: ConfigError, and
    the bench over 5e18 ids says so; 2**53 ids draw, every id in range, in little memory."""
    from tiered_emb.cli import main
    from tiered_emb.sim import zipf_ids

    with pytest.raises(ConfigError, match="2\\*\\*53"):
        zipf_ids(2**62, 1.0, 3, 0)
    args = ["bench", "policies", "--ids", "5000000000000000000", "--requests", "10", "--cache", "2"]
    with pytest.raises(TieredEmbError):
        main([*args, "--repeats", "1", "--no-progress", "--policies", "lru"])
    ids = zipf_ids(2**53, 1.0, 1000, 0)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 2**53


def test_open_checks_its_tiers_before_the_data_file(tmp_path):
    """A bad ``tiers`` is the caller's error whatever the store holds: ConfigError first."""
    TieredStore.create(tmp_path / "s", [TableConfig("t", dim=4)], TierConfig(hbm_rows=4, device="cpu")).close()
    (tmp_path / "s" / "lmdb" / "data.mdb").unlink()
    with pytest.raises(ConfigError, match="tiers"):
        TieredStore.open(tmp_path / "s", tiers="not a TierConfig")
    with pytest.raises(CorruptStoreError, match=r"data\.mdb"):
        TieredStore.open(tmp_path / "s")


def test_stepping_takes_only_an_unreleased_ticket_of_this_store(tmp_path):
    """A ticket of another store would let the lock-free pooled path read this store's
    records at slots pinned in the other; a released one, at slots about to be unpinned."""
    tiers = TierConfig(hbm_rows=64, device="cpu")
    with (
        TieredStore.create(tmp_path / "a", [TableConfig("t", dim=4)], tiers) as a,
        TieredStore.create(tmp_path / "b", [TableConfig("t", dim=4)], tiers) as b,
    ):
        ids = np.arange(16, dtype=np.int64)
        ticket = a.prefetch({"t": ids})
        ticket.wait()
        with pytest.raises(ConfigError, match="another store"):
            b.engine.stepping(ticket).__enter__()
        assert b.engine.window.stepping is None
        with a.engine.stepping(ticket):
            assert a.engine.window.stepping is ticket
        a.release(ticket)
        with pytest.raises(ConfigError, match="released"):
            a.engine.stepping(ticket).__enter__()
        assert a.engine.window.stepping is None
