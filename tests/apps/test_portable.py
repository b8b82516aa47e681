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
