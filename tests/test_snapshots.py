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

from tiered_emb import SGD, RowWiseAdagrad, StoreReader, TableConfig, TierConfig, TieredStore
from tiered_emb.cli import main as cli
from tiered_emb.errors import ConfigError, SnapshotNotFoundError
from tiered_emb.testing import random_updates
from tiered_emb.testing.reference import ReferenceStore
from tiered_emb.tiers.ssd.compaction import Compactor

REPO = Path(__file__).resolve().parents[1]
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


def _train(path: Path, checkpoints: int, keep: int, monkeypatch) -> dict:
    """Checkpoints every EVERY steps (write-backs of 32 rows, compaction of small stores on);
    returns the step of each checkpoint's number."""
    monkeypatch.setattr(Compactor, "COMPACT_MIN_ROWS", 100)
    tiers = TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", keep_checkpoints=keep)
    steps = {0: 0}
    s = TieredStore.create(path, TABLES, tiers, seed=4)
    s.ssd.writeback_rows = 32
    for step in range(1, checkpoints * EVERY + 1):
        random_updates([s], TABLES, 1, seed=step, ids_below=300)
        if step % EVERY == 0:
            steps[s.checkpoint(extra=str(step).encode())] = step
    assert s.snapshots() == sorted(steps)[-keep:]
    compacted = s.ssd.compactor.runs
    s.close(checkpoint=False)  # (the last checkpoint has every row)
    assert compacted > 0  # (the kept checkpoints' rows went through compaction)
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


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_kill_while_going_back_to_a_checkpoint_reopens_at_one_of_the_two(tmp_path, monkeypatch, nth):
    """Going back is one transaction (the later checkpoints' records dropped, the older one
    made the latest), then deletions of later segments: killed at any of them, the store
    reopens at the latest checkpoint or at the one gone back to, bitwise."""
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
    with TieredStore.open(tmp_path / "s") as s:
        if s.epoch == kept[-1]:  # killed before going back
            assert s.snapshots() == kept and _same(_rows(s), _reference(steps[kept[-1]]))
        else:
            assert s.epoch == kept[0] and s.snapshots() == kept[:1]
            assert _same(_rows(s), _reference(steps[kept[0]]))
