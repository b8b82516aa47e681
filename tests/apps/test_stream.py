"""`tiered-emb stream` at tiny size: checkpoints on a schedule (--checkpoint-every)."""

import json

import numpy as np
import pytest

from tiered_emb import TieredStore
from tiered_emb.cli import main
from tiered_emb.errors import ConfigError

IDS = 1000
TINY = ["--tables", "2", "--ids", str(IDS), "--batch", "128", "--hbm-rows", "32", "--ddr-rows", "64", "--steps", "5"]


def _stream(run_dir, *extra):
    assert main(["stream", "--run-dir", str(run_dir), *TINY, *extra]) == 0
    return json.loads((run_dir / "report.json").read_text())


def _store(run_dir):
    """The store's checkpoint count, and every row of every table with its optimizer state (bytes)."""
    with TieredStore.open(run_dir / "store", restore="checkpoint") as store:
        epoch = store.epoch  # (before close() checkpoints once more)
        ids = np.arange(IDS)
        rows = {name: store.peek(name, ids, with_state=True).tobytes() for name in sorted(store.tables)}
    return epoch, rows


@pytest.mark.parametrize("every, steps", [("0", [5]), ("2", [2, 4, 5]), ("1", [1, 2, 3, 4, 5]), ("5", [5]), ("7", [5])])
def test_checkpoint_every_k_steps_and_one_at_the_end(tmp_path, every, steps):
    r = _stream(tmp_path / "run", "--checkpoint-every", every)
    assert [c["step"] for c in r["checkpoints"]] == steps
    for c in r["checkpoints"]:
        assert sorted(c) == ["rows_written", "seconds", "step"]
        assert isinstance(c["rows_written"], int) and c["rows_written"] >= 0
    assert r["checkpoints"][0]["rows_written"] > 0  # the first writes every row updated so far that LMDB lacks


def test_scheduled_checkpoints_move_the_store_epoch_and_leave_the_rows_bitwise_equal(tmp_path):
    """Checkpointing on the way changes when rows reach LMDB, never their values."""
    _stream(tmp_path / "end", "--checkpoint-every", "0")
    r = _stream(tmp_path / "every2", "--checkpoint-every", "2")
    epoch_end, rows_end = _store(tmp_path / "end")
    epoch_every2, rows_every2 = _store(tmp_path / "every2")
    assert epoch_every2 - epoch_end == len(r["checkpoints"]) - 1 == 2
    assert [name for name in rows_end if rows_end[name] != rows_every2[name]] == []


def test_a_negative_checkpoint_every_is_refused_before_the_run_dir_is_touched(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"--checkpoint-every -1 is invalid") as e:
        main(["stream", "--run-dir", str(run), *TINY, "--checkpoint-every", "-1"])
    assert "int >= 0" in e.value.hint
    assert not run.exists()
    with pytest.raises(SystemExit):
        main(["stream", "--help"])
    assert "--checkpoint-every CHECKPOINT_EVERY" in capsys.readouterr().out
