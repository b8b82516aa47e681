"""bench/bench_train.py at tiny size, so it never rots."""
import importlib.util
import json
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_train.py"


def test_bench_train_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "train.json"
    with warnings.catch_warnings():  # fbgemm_gpu, when present, warns about its optional ops
        warnings.simplefilter("ignore")
        mod.main(["--rows", "2000", "--dim", "8", "--bags", "16", "--bag-size", "4", "--batches", "2",
                  "--repeats", "1", "--stream-steps", "3", "--lmdb-factor", "50", "--json", str(out)])
    data = json.loads(out.read_text())
    for key in ("ours_train", "ours_forward", "torch_forward", "stream_lmdb_train", "stream_resident_train"):
        assert data["results"][key]["lookups_per_s"] > 0
    assert data["ratios"]["forward_vs_torch"] > 0
    assert data["results"]["stream_lmdb_train"]["lmdb_rows"] > 0
