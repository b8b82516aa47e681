"""Descents behind the caller (tiered_emb/step/descend.py): a collection's forward hands each
table's victims to a helper thread while it resolves the next table; nothing it computes,
counts or writes changes, and an error of a descent reaches the caller."""

import contextlib
import threading

import numpy as np
import pytest
import torch

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.engine import Engine
from tiered_emb.step.resolve import Resolver
from tiered_emb.torch import TieredEmbeddingBagCollection

TABLES = [TableConfig(f"t{i}", dim=8, num_rows=3000, optimizer=RowWiseAdagrad(lr=0.1)) for i in range(4)]
IDS = np.arange(3000)


def _train(path, monkeypatch, behind: bool, tiers: TierConfig, steps: int = 8) -> tuple[dict, set]:
    """Rows, counters and LMDB's ids after ``steps`` forwards and backwards of the collection,
    and the names of the threads the descents ran on."""
    if not behind:
        monkeypatch.setattr(Engine, "descents_behind", lambda self: contextlib.nullcontext())
    threads = set()
    descend = Resolver.descend

    def spy(self, *args):
        threads.add(threading.current_thread().name)
        return descend(self, *args)

    monkeypatch.setattr(Resolver, "descend", spy)
    names = [t.name for t in TABLES]
    with TieredStore.create(path, TABLES, tiers, seed=5) as store:
        store.engine.ssd.writeback_rows = 300  # a write-back every few steps
        coll = TieredEmbeddingBagCollection(store, names)
        rng = np.random.default_rng(0)
        for _ in range(steps):
            feats = {n: (torch.from_numpy(rng.integers(0, 3000, 120)), torch.full((40,), 3)) for n in names}
            out = coll(feats)
            sum((o * (k + 1)).sum() for k, o in enumerate(out.values())).backward()
            store.advance_step()
        store.engine.ssd.wait_writes()
        stats = {n: {tier: store.stats()[n][tier] for tier in ("hbm", "ddr", "ssd")} for n in names}
        got = {
            "rows": {n: store.peek(n, IDS, with_state=True) for n in names},
            "stats": stats,
            "lmdb": {n: store.engine.ssd.pending_ids(n) for n in names},
        }
    monkeypatch.undo()
    return got, threads


def _same(a: dict, b: dict) -> None:
    for n in a["rows"]:
        np.testing.assert_array_equal(a["rows"][n], b["rows"][n])
        np.testing.assert_array_equal(a["lmdb"][n], b["lmdb"][n])
    assert a["stats"] == b["stats"]


def test_descents_behind_change_nothing(tmp_path, monkeypatch):
    tiers = TierConfig(hbm_rows=160, ddr_rows=160, device="cpu")  # (a batch fits: no spill path)
    serial, on = _train(tmp_path / "serial", monkeypatch, False, tiers)
    behind, by = _train(tmp_path / "behind", monkeypatch, True, tiers)
    assert on == {threading.current_thread().name}
    assert by == {"tiered_emb-descend_0"}  # (every descent went to the helper)
    assert serial["stats"]["t0"]["hbm"]["evictions"] > 500 and serial["stats"]["t0"]["ssd"]["writebacks"] > 300
    _same(serial, behind)


def test_shared_tiers_descend_on_the_callers_thread(tmp_path, monkeypatch):
    """A shared tier's victims are any table's: its bring-ups run their own descents."""
    tiers = TierConfig(hbm_bytes=640 * 4 * 9, ddr_bytes=640 * 4 * 9, device="cpu")
    serial, _ = _train(tmp_path / "serial", monkeypatch, False, tiers)
    behind, by = _train(tmp_path / "behind", monkeypatch, True, tiers)
    assert by == {threading.current_thread().name}
    _same(serial, behind)


def test_an_error_of_a_descent_reaches_the_caller(tmp_path, monkeypatch):
    threads = []

    def failing(self, t, *args):
        threads.append(threading.current_thread().name)
        if t.cfg.name == "t1":
            raise OSError("descent failed (test)")

    monkeypatch.setattr(Resolver, "descend", failing)
    names = [t.name for t in TABLES]
    with TieredStore.create(tmp_path / "s", TABLES, TierConfig(hbm_rows=160, ddr_rows=160, device="cpu")) as store:
        coll = TieredEmbeddingBagCollection(store, names)
        with torch.no_grad():
            coll({n: (torch.arange(150), torch.full((30,), 5)) for n in names})  # (no victims yet)
            with pytest.raises(OSError, match="descent failed"):
                coll({n: (torch.arange(150, 300), torch.full((30,), 5)) for n in names})
    assert threads == ["tiered_emb-descend_0"] * len(names)  # (every table's descent ran, on the helper)
