"""Numbered checkpoints: a store keeps the last ``keep_checkpoints``, each opens bitwise
(read-only, or as the writer to restart the run from it), through compaction and kills."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiered_emb import SGD, RowWiseAdagrad, StoreReader, TableConfig, TierConfig, TieredStore, verify_store
from tiered_emb.cli import main as cli
from tiered_emb.errors import ConfigError, CorruptStoreError, SnapshotNotFoundError
from tiered_emb.testing import random_updates
from tiered_emb.testing.reference import ReferenceStore
from tiered_emb.tiers.ssd.compaction import Compactor

REPO = Path(__file__).resolve().parents[3]
TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=300, optimizer=SGD(lr=0.5)),
]
EVERY = 4


def _reference(steps: int) -> dict:
    ref = ReferenceStore(TABLES, seed=4)
    for step in range(1, steps + 1):
        random_updates([ref], TABLES, 1, seed=step, ids_below=300)
    return {t.name: ref.peek_records(t.name, np.arange(300)) for t in TABLES}


def _rows(store) -> dict:
    return {t.name: store.peek(t.name, np.arange(300), with_state=True) for t in TABLES}


def _same(got: dict, want: dict) -> bool:
    return all(np.array_equal(got[t], want[t]) for t in want)


def _train(path: Path, checkpoints: int, keep: int, monkeypatch, compacts: bool = True) -> dict:
    """Checkpoints every EVERY steps (write-backs of 32 rows, compaction of small stores on);
    returns the step of each checkpoint's number."""
    monkeypatch.setattr(Compactor, "COMPACT_MIN_ROWS", 100)
    tiers = TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", keep_checkpoints=keep)
    steps = {0: 0}
    s = TieredStore.create(path, TABLES, tiers, seed=4)
    s.engine.ssd.writeback_rows = 32
    for step in range(1, checkpoints * EVERY + 1):
        random_updates([s], TABLES, 1, seed=step, ids_below=300)
        if step % EVERY == 0:
            steps[s.checkpoint(extra=str(step).encode())] = step
    assert s.snapshots() == sorted(steps)[-keep:]
    compacted = s.engine.ssd.compactor.runs
    s.close(checkpoint=False)  # (the last checkpoint has every row)
    assert compacted > 0 or not compacts  # (the kept checkpoints' rows went through compaction)
    return steps


def test_every_kept_checkpoint_reads_back_bitwise_through_compaction(tmp_path, monkeypatch):
    steps = _train(tmp_path / "s", 8, 4, monkeypatch)
    kept = sorted(steps)[-4:]
    for epoch in kept:
        with TieredStore.open(tmp_path / "s", mode="r", snapshot=epoch) as r:
            assert r.epoch == epoch and r.snapshots() == kept
            assert r.extra == str(steps[epoch]).encode()
            assert _same(_rows(r), _reference(steps[epoch])), epoch
    with TieredStore.open(tmp_path / "s", mode="r") as r:  # the last by default; refresh to another
        assert r.epoch == kept[-1]
        assert r.refresh(kept[0]) == kept[0] and _same(_rows(r), _reference(steps[kept[0]]))
    with pytest.raises(SnapshotNotFoundError, match="keeps no checkpoint"):
        TieredStore.open(tmp_path / "s", mode="r", snapshot=kept[0] - 1)
    with pytest.raises(SnapshotNotFoundError):
        TieredStore.open(tmp_path / "s", snapshot=kept[0] - 1)
    for bad in (-1, "2", True):
        with pytest.raises(ConfigError, match="snapshot"):
            TieredStore.open(tmp_path / "s", snapshot=bad)
    with pytest.raises(ConfigError, match="restore"):
        TieredStore.open(tmp_path / "s", restore="latest", snapshot=kept[0])
    with TieredStore.open(tmp_path / "s") as s:  # nothing above changed the store
        assert s.snapshots() == kept and _same(_rows(s), _reference(steps[kept[-1]]))


def test_a_run_restarted_from_a_kept_checkpoint_goes_on_bitwise(tmp_path, monkeypatch):
    steps = _train(tmp_path / "s", 8, 3, monkeypatch)
    back = sorted(steps)[-3]
    with TieredStore.open(tmp_path / "s", snapshot=back) as s:
        assert s.epoch == back and s.snapshots() == [back]
        assert s.extra == str(steps[back]).encode()
        assert _same(_rows(s), _reference(steps[back]))
        for step in range(steps[back] + 1, steps[back] + 2 * EVERY + 1):
            random_updates([s], TABLES, 1, seed=step, ids_below=300)
        s.checkpoint()
        assert s.epoch == back + 1  # the later ones were dropped: numbers go on from it
        assert _same(_rows(s), _reference(steps[back] + 2 * EVERY))


def test_inspect_lists_the_kept_checkpoints(tmp_path, monkeypatch, capsys):
    steps = _train(tmp_path / "s", 4, 2, monkeypatch)
    assert cli(["inspect", "--json", str(tmp_path / "s")]) == 0
    out = json.loads(capsys.readouterr().out)
    kept = sorted(steps)[-2:]
    assert [x["epoch"] for x in out["snapshots"]] == kept
    assert [x["extra_bytes"] for x in out["snapshots"]] == [len(str(steps[e])) for e in kept]
    with StoreReader(tmp_path / "s") as r:
        assert out["checkpoint"]["epoch"] == r.epoch == kept[-1]


_KILLED = r"""
import os, signal, sys
from tiered_emb import TieredStore
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
path, epoch, nth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
real, calls = LmdbEnv.write, [0]
def dying(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
LmdbEnv.write = dying
TieredStore.open(path, snapshot=epoch).close()
"""


@pytest.mark.parametrize(("nth", "restore"), [(1, "checkpoint"), (2, "checkpoint"), (3, "checkpoint"), (3, "latest")])
def test_a_kill_while_going_back_to_a_checkpoint_reopens_at_one_of_the_two(tmp_path, monkeypatch, nth, restore):
    """Going back is one transaction (the later checkpoints' records dropped, the older one
    made the latest), then deletions of later segments: killed at any of them, the store
    reopens at the latest checkpoint or at the one gone back to, bitwise (with
    restore="latest" too: the rows after it are not taken back)."""
    steps = _train(tmp_path / "s", 6, 4, monkeypatch)
    kept = sorted(steps)[-4:]
    p = subprocess.run(
        [sys.executable, "-c", _KILLED, str(tmp_path / "s"), str(kept[0]), str(nth)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    with TieredStore.open(tmp_path / "s", restore=restore) as s:
        if s.epoch == kept[-1]:  # killed before going back
            assert s.snapshots() == kept and _same(_rows(s), _reference(steps[kept[-1]]))
        else:
            assert s.epoch == kept[0] and s.snapshots() == kept[:1]
            assert _same(_rows(s), _reference(steps[kept[0]]))


def test_a_failed_refresh_keeps_the_reader_where_it_was(tmp_path, monkeypatch):
    steps = _train(tmp_path / "s", 3, 2, monkeypatch, compacts=False)
    last = max(steps)
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        with pytest.raises(SnapshotNotFoundError):
            r.refresh(999)
        assert r.epoch == last and _same(_rows(r), _reference(steps[last]))
        assert r.stats()["b"]["ssd"]["rows"] > 0


def test_keep_checkpoints_is_checked_and_kept_across_opens(tmp_path, monkeypatch):
    for bad in (0, -3, "2", 2.5, True):
        with pytest.raises(ConfigError, match="keep_checkpoints"):
            TierConfig(hbm_rows=8, keep_checkpoints=bad)
    steps = _train(tmp_path / "s", 3, 3, monkeypatch, compacts=False)
    with TieredStore.open(tmp_path / "s", TierConfig(hbm_rows=16, device="cpu")) as s:  # (tiers changed, not keep)
        s.checkpoint()
        assert s.snapshots() == sorted(steps)[-2:] + [max(steps) + 1]


def test_extra_is_stored_once_and_read_back_for_every_kept_checkpoint(tmp_path):
    import lmdb

    tiers = TierConfig(hbm_rows=8, device="cpu", keep_checkpoints=3)
    with TieredStore.create(tmp_path / "s", TABLES, tiers, seed=1) as s:
        s.checkpoint(extra=b"x" * 1000)
        for _ in range(4):  # (no extra: the last one's stays, not copied)
            s.checkpoint()
        assert s.extra == b"x" * 1000
        kept = s.snapshots()
        s.close(checkpoint=False)
    env = lmdb.open(str(tmp_path / "s" / "lmdb"), max_dbs=16, readonly=True)
    with env.begin() as txn:
        values = [bytes(v) for _, v in txn.cursor(db=env.open_db(b"meta", txn=txn, create=False))]
    env.close()
    assert sum(len(v) >= 1000 for v in values) == 1
    for epoch in kept:
        with TieredStore.open(tmp_path / "s", mode="r", snapshot=epoch) as r:
            assert r.extra == b"x" * 1000


def test_a_damaged_mark_is_found_by_verify_and_refused_at_open(tmp_path, monkeypatch):
    import lmdb

    _train(tmp_path / "s", 2, 1, monkeypatch, compacts=False)
    env = lmdb.open(str(tmp_path / "s" / "lmdb"), max_dbs=16, readonly=True)
    with env.begin() as txn:
        value = bytes(txn.get(b"mark", db=env.open_db(b"meta", txn=txn, create=False)))
    env.close()
    data = tmp_path / "s" / "lmdb" / "data.mdb"
    blob = bytearray(data.read_bytes())
    assert blob.count(value) == 1  # (the one the last checkpoint wrote)
    blob[blob.find(value) + len(value) - 1] ^= 1  # the mark's last byte, one bit
    data.write_bytes(bytes(blob))
    report = verify_store(tmp_path / "s")
    assert any(d["table"] is None and "mark" in d["what"] for d in report["damaged"]), report["damaged"]
    with pytest.raises(CorruptStoreError, match="mark"):
        TieredStore.open(tmp_path / "s")
