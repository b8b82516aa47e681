"""``tiered-emb export`` / ``import``: a store to .npy files and back, bitwise, streaming."""

import json

import numpy as np
import pytest

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.cli import main
from tiered_emb.errors import CorruptStoreError, StoreExistsError
from tiered_emb.testing import random_updates

TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=300, optimizer=SGD(lr=0.5)),
]


def _rows(path):
    with TieredStore.open(path) as s:
        return {t.name: s.peek(t.name, np.arange(400 if t.num_rows is None else 300), with_state=True) for t in TABLES}


def test_export_then_import_is_the_same_store_bitwise(tmp_path, capsys):
    with TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"), seed=7) as s:
        random_updates([s], TABLES, 20, seed=3, ids_below=300)
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "x")]) == 0
    meta = json.loads((tmp_path / "x" / "export.json").read_text())
    ids = np.load(tmp_path / "x" / "a.ids.npy")
    assert meta["seed"] == 7 and meta["rows"]["a"] == ids.shape[0] > 100 and (np.diff(ids) > 0).all()
    # a budget of 1 MiB: the 20-byte rows of "a" go in chunks; the import streams them alike
    assert (
        main(["import", str(tmp_path / "x"), str(tmp_path / "t"), "--hbm-rows", "8", "--budget-bytes", str(1 << 20)])
        == 0
    )
    want, got = _rows(tmp_path / "s"), _rows(tmp_path / "t")
    for t in want:
        assert want[t].tobytes() == got[t].tobytes()  # written rows, and the initialiser's alike


def test_export_and_import_refuse_what_exists_and_what_is_damaged(tmp_path):
    TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, device="cpu")).close()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "mine.txt").write_text("keep")
    with pytest.raises(StoreExistsError):
        main(["export", str(tmp_path / "s"), str(tmp_path / "x")])
    assert (tmp_path / "x" / "mine.txt").read_text() == "keep"
    with pytest.raises(StoreExistsError):
        main(["import", str(tmp_path / "x"), str(tmp_path / "s")])
    with pytest.raises(CorruptStoreError, match="not an export"):
        main(["import", str(tmp_path / "x"), str(tmp_path / "new")])
    main(["export", str(tmp_path / "s"), str(tmp_path / "y")])
    np.save(tmp_path / "y" / "a.rows.npy", np.zeros((0, 3), np.float32))
    with pytest.raises(CorruptStoreError, match="do not match"):
        main(["import", str(tmp_path / "y"), str(tmp_path / "new2")])


def test_export_opens_where_asked_and_leaves_no_checkpoint(tmp_path):
    from tiered_emb.testing import crash

    s = TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, device="cpu"), seed=7)
    s.write("b", np.arange(5), np.full((5, 2), 3, np.float32))
    s.checkpoint()
    s.write("b", np.arange(5), np.full((5, 2), 4, np.float32))
    s.flush()
    epoch = s.epoch
    crash(s)  # rows written after the checkpoint, in LMDB
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "x"), "--restore", "latest"]) == 0
    assert (np.load(tmp_path / "x" / "b.rows.npy")[:5] == 4).all()
    with TieredStore.open(tmp_path / "s") as r:  # the export moved the mark (latest), no epoch of its own
        assert r.epoch == epoch and (r.peek("b", np.arange(5)) == 4).all()


NARROW = [
    TableConfig("h", dim=5, dtype="float16", optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("q", dim=6, num_rows=300, dtype="int8", optimizer=SGD(lr=0.5), min_count=2),
]


def _peek_all(path, tables):
    with TieredStore.open(path) as s:
        return {t.name: s.peek(t.name, np.arange(400 if t.num_rows is None else 300), with_state=True) for t in tables}


def test_a_narrow_store_exports_and_imports_bitwise(tmp_path):
    with TieredStore.create(tmp_path / "s", NARROW, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"), seed=5) as s:
        random_updates([s], NARROW, 20, seed=2, ids_below=300)
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "x")]) == 0
    assert json.loads((tmp_path / "x" / "export.json").read_text())["format"] == "tiered_emb-export/2"
    assert np.load(tmp_path / "x" / "h.rows.npy").dtype == np.uint32  # (the words, not float values)
    assert main(["import", str(tmp_path / "x"), str(tmp_path / "t"), "--hbm-rows", "8"]) == 0
    want, got = _peek_all(tmp_path / "s", NARROW), _peek_all(tmp_path / "t", NARROW)
    assert all(want[t].tobytes() == got[t].tobytes() for t in want)


def test_convert_rounds_to_nearest_only_when_asked_and_keeps_the_source(tmp_path):
    from tiered_emb.errors import ConfigError
    from tiered_emb.precision import decode, encode

    with TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"), seed=7) as s:
        random_updates([s], TABLES, 20, seed=3, ids_below=300)
        step = s.advance_step()

    def files():  # (LMDB's reader table changes with every open)
        return {f.name: f.read_bytes() for f in (tmp_path / "s").rglob("*") if f.is_file() and f.name != "lock.mdb"}

    before = files()
    with pytest.raises(ConfigError, match="lossy"):
        main(["convert", str(tmp_path / "s"), "--dtype", "fp16", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()
    cmd = ["convert", str(tmp_path / "s"), "--dtype", "fp16", "--out", str(tmp_path / "c"), "--lossy"]
    assert main([*cmd, "--budget-bytes", "1MiB"]) == 0
    assert files() == before
    want, got = _rows(tmp_path / "s"), _peek_all(tmp_path / "c", TABLES)
    for t in TABLES:
        w = want[t.name]
        words = np.zeros((w.shape[0], (t.dim + 1) // 2), np.float32)
        encode("float16", w[:, : t.dim], words)
        assert got[t.name][:, : t.dim].tobytes() == decode("float16", words, None, t.dim).tobytes()
        assert got[t.name][:, t.dim :].tobytes() == w[:, t.dim :].tobytes()  # (the state as it was)
    with TieredStore.open(tmp_path / "c") as c:
        assert c.step == step and c.engine.table_config("a").dtype == "float16"
    # widening loses nothing: no --lossy needed, and the rows written come back exactly (rows
    # never written start as the new dtype's first values: the float32 draws)
    assert main(["convert", str(tmp_path / "c"), "--dtype", "float32", "--out", str(tmp_path / "w")]) == 0
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "x")]) == 0
    wide = _peek_all(tmp_path / "w", TABLES)
    for t in TABLES:
        ids = np.load(tmp_path / "x" / f"{t.name}.ids.npy")
        assert ids.shape[0] > 100 and wide[t.name][ids].tobytes() == got[t.name][ids].tobytes()


def test_convert_refuses_a_store_in_use_and_an_import_a_bad_int8_scale(tmp_path):
    from tiered_emb.errors import StoreLockedError

    with TieredStore.create(tmp_path / "s", NARROW, TierConfig(hbm_rows=8, device="cpu")) as s:
        s.write("q", [1, 2], np.ones((2, 6), np.float32))
        s.checkpoint()
        with pytest.raises(StoreLockedError):
            main(["convert", str(tmp_path / "s"), "--dtype", "int8", "--out", str(tmp_path / "c")])
        assert not (tmp_path / "c").exists()
    main(["export", str(tmp_path / "s"), str(tmp_path / "x")])
    rows = np.load(tmp_path / "x" / "q.rows.npy")
    rows[0, 0] = np.float32(np.nan).view(np.uint32)
    np.save(tmp_path / "x" / "q.rows.npy", rows)
    with pytest.raises(CorruptStoreError, match="scale"):
        main(["import", str(tmp_path / "x"), str(tmp_path / "t")])
    assert not (tmp_path / "t").exists()
