"""The DLRM main job at tiny size: the smoke run, resume bitwise, a real Criteo sample."""
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import TieredStore  # noqa: E402
from tiered_emb.cli import main  # noqa: E402
from tiered_emb.dlrm import auc, log_loss  # noqa: E402

TINY = ["--batch", "64", "--rows", "3000", "--dim", "4", "--hbm-rows", "64", "--ddr-rows", "128",
        "--bottom", "8", "--top", "8", "--eval-batches", "2", "--quiet"]
CRITEO_SAMPLE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "criteo_sample_900.tsv"


def _train(run_dir, *extra):
    assert main(["train", "--run-dir", str(run_dir), *TINY, *extra]) == 0
    return json.loads((run_dir / "report.json").read_text())


def _state(run_dir):
    """Every row with its optimizer state, and the dense weights, of a finished run."""
    with TieredStore.open(run_dir / "store", restore="checkpoint") as store:
        ids = np.arange(3000)
        rows = {name: store.peek(name, ids, with_state=True).tobytes() for name in store.tables}
        saved = torch.load(io.BytesIO(store.extra), weights_only=True)
    return rows, saved


def test_smoke_run_reports(tmp_path, capsys):
    r = _train(tmp_path / "run", "--steps", "6")
    out = capsys.readouterr().out
    assert "held-out log loss" in out and "AUC" in out and "hbm" in out
    assert r["steps"] == 6 and r["samples_per_s"] > 0
    if sys.platform.startswith("linux"):  # per-thread CPU from /proc
        cpu = r["thread_cpu_ms_per_step"]
        assert cpu["main"] > 0 and "tiered_emb-prefetch" in cpu and min(cpu.values()) >= 0
    assert r["tables_over_capacity"] >= 10
    assert r["tiers"]["ssd"]["lookups"] > 0 and r["tiers"]["ssd"]["rows"] > 0  # LMDB really used
    for key in ("train_auc", "test_auc", "train_logloss", "test_logloss"):
        assert np.isfinite(r[key])


def test_resume_from_checkpoint_is_bitwise_an_uninterrupted_run(tmp_path):
    _train(tmp_path / "whole", "--steps", "6", "--checkpoint-every", "0")
    _train(tmp_path / "parts", "--steps", "3", "--checkpoint-every", "2")
    r = _train(tmp_path / "parts", "--steps", "6", "--resume")
    assert r["steps_this_run"] == 3
    rows_a, saved_a = _state(tmp_path / "whole")
    rows_b, saved_b = _state(tmp_path / "parts")
    assert saved_a["step"] == saved_b["step"] == 6
    assert rows_a == rows_b
    for k, v in saved_a["model"].items():
        assert torch.equal(v, saved_b["model"][k]), k


def test_resume_needs_a_run(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["train", "--run-dir", str(tmp_path / "none"), "--resume", *TINY])


@pytest.mark.skipif(not CRITEO_SAMPLE.is_file(), reason=f"{CRITEO_SAMPLE} is absent")
def test_real_criteo_sample(tmp_path):
    r = _train(tmp_path / "criteo", "--steps", "4", "--data", str(CRITEO_SAMPLE))
    assert np.isfinite(r["test_logloss"]) and 0.0 <= r["test_auc"] <= 1.0


def test_metrics():
    y = np.array([0, 1, 0, 1, 1], dtype=np.float32)
    assert auc(y, np.array([0.1, 0.9, 0.2, 0.8, 0.7])) == 1.0
    assert auc(y, np.array([0.5] * 5)) == 0.5
    assert log_loss(y, np.full(5, 0.5)) == pytest.approx(np.log(2))
