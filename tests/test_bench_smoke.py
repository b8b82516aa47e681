"""The bench scripts at tiny size (train, prefetch, reliability, tiers, memlimit, lifecycle), so they never rot."""

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_train.py"


def _bench(name: str):
    """The script ``bench/<name>.py`` loaded as a module (the bench folder is no package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_train_smoke(tmp_path):
    mod = _bench("bench_train")
    out = tmp_path / "train.json"
    with warnings.catch_warnings():  # fbgemm_gpu, when present, warns about its optional ops
        warnings.simplefilter("ignore")
        mod.main(
            [
                "--rows",
                "2000",
                "--dim",
                "8",
                "--bags",
                "16",
                "--bag-size",
                "4",
                "--batches",
                "2",
                "--repeats",
                "1",
                "--stream-steps",
                "3",
                "--lmdb-factor",
                "50",
                "--json",
                str(out),
            ]
        )
    data = json.loads(out.read_text())
    for key in ("ours_train", "ours_forward", "torch_forward", "stream_lmdb_train", "stream_resident_train"):
        assert data["results"][key]["lookups_per_s"] > 0
    assert data["ratios"]["forward_vs_torch"] > 0
    assert data["results"]["stream_lmdb_train"]["lmdb_rows"] > 0


def test_bench_prefetch_smoke(tmp_path):
    """Both parts of bench/bench_prefetch.py at tiny size: every configuration runs and reports."""
    mod = _bench("bench_prefetch")
    out = tmp_path / "prefetch.json"
    res = mod.main(
        [
            "--ids",
            "3000",
            "--requests",
            "30000",
            "--batch",
            "256",
            "--sizes",
            "0.1",
            "--e2e-steps",
            "2",
            "--e2e-repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert set(data["end_to_end"]["ratios"]) == set(res["end_to_end"]["ratios"])
    modes = [k for k in data["end_to_end"] if k != "ratios"]
    assert len(modes) == 10 and all(data["end_to_end"][m]["median_samples_per_s"] > 0 for m in modes)
    for trace in data["hit_rates"].values():
        for point in trace["points"].values():
            rates = [p["hbm_hit_rate"] for p in point["policies"].values()]
            assert all(0.0 <= r <= 1.0 for r in rates)
            assert point["policies"]["belady (full)"]["hbm_hit_rate"] >= max(rates) - 1e-12


def test_stream_counts_each_row_stored_once(tmp_path, capsys):
    """`tiered-emb stream`'s "rows stored" is the distinct rows the run touched (the rows
    still in HBM and DDR were counted a second time beside LMDB's copies of them)."""
    import re

    import numpy as np

    from tiered_emb.cli import main
    from tiered_emb.sim.traces import zipf_ids

    steps, tables, ids, batch = 3, 4, 20_000, 512
    assert (
        main(
            [
                "stream",
                "--run-dir",
                str(tmp_path / "s"),
                "--steps",
                str(steps),
                "--ids",
                str(ids),
                "--batch",
                str(batch),
                "--hbm-rows",
                "256",
                "--ddr-rows",
                "512",
            ]
        )
        == 0
    )
    printed = int(re.search(r"rows stored ([\d,]+)", capsys.readouterr().out).group(1).replace(",", ""))
    distinct = sum(
        np.unique(np.concatenate([zipf_ids(ids, 1.05, batch, seed=step * 131 + i) for step in range(steps)])).size
        for i in range(tables)
    )
    assert printed == distinct


def test_stream_replaces_only_its_own_run_and_checks_its_flags_first(tmp_path):
    """`tiered-emb stream --run-dir DIR` deleted DIR whatever it held, and a bad --policy
    deleted it before being reported: it now replaces only an earlier run of its own (or an
    empty directory), after every flag is checked."""
    from tiered_emb.cli import main
    from tiered_emb.errors import ConfigError

    small = ["--steps", "1", "--tables", "1", "--ids", "1000", "--batch", "64", "--hbm-rows", "16", "--ddr-rows", "16"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no run"):
        main(["stream", "--run-dir", str(precious), *small])
    assert (precious / "notes.txt").read_text() == "mine" and len(list(precious.iterdir())) == 1

    run = tmp_path / "run"
    assert main(["stream", "--run-dir", str(run), *small]) == 0
    made = sorted(p.name for p in run.iterdir())
    with pytest.raises(ConfigError, match="policy"):
        main(["stream", "--run-dir", str(run), "--policy", "foo", *small])
    assert sorted(p.name for p in run.iterdir()) == made  # the earlier run is still there
    assert main(["stream", "--run-dir", str(run), *small]) == 0  # its own run: replaced


def test_the_cli_tells_its_version_and_stream_documents_every_flag(capsys):
    from tiered_emb import __version__
    from tiered_emb.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tiered-emb {__version__}"
    with pytest.raises(SystemExit):
        main(["stream", "--help"])
    out = capsys.readouterr().out
    # argparse shows a default only beside a help text: 12 defaults, every flag documented
    assert out.count("(default:") == 12, out


def test_bench_gpu_without_a_gpu_exits_cleanly_having_measured_nothing(tmp_path, capsys):
    """bench/bench_gpu.py imports without a GPU and says why it stops (tests/step/device/test_gpu.py runs it on one)."""
    mod = _bench("bench_gpu")
    if mod.gpu_or_reason() is None:
        pytest.skip("a GPU is usable here: tests/step/device/test_gpu.py runs the benchmark")
    with pytest.raises(SystemExit) as exit_info:
        mod.main(["--json", str(tmp_path / "gpu.json")])
    assert exit_info.value.code == 2
    assert "no usable GPU here" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()


def test_bench_reliability_smoke(tmp_path):
    """``--quick``: both parts run, and the readers' part has its control (processes taking
    the readers' share of a core) beside the runs with and without readers."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rel.json"
    run = [sys.executable, str(root / "bench" / "bench_reliability.py"), "--quick", "--json", str(out)]
    subprocess.run(run, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(root)), timeout=600)
    got = json.loads(out.read_text())
    assert set(got["checksums"]["rows_per_s"]) == {"checked", "unchecked"}
    readers = got["readers"]
    assert readers["with_readers"]["reader_lookups_per_s"] > 0
    assert readers["with_cpu_burners"]["cpu_share_each"] > 0
    assert {"writer_steps_ratio", "burners_steps_ratio"} <= set(readers)


def test_bench_tiers_smoke(tmp_path):
    mod = _bench("bench_tiers")
    out = tmp_path / "tiers.json"
    args = ["--rows", "6000", "--dim", "8", "--bags", "64", "--bag-size", "8", "--warm-steps", "1", "--steps", "2"]
    mod.main([*args, "--json", str(out), "--plot", str(tmp_path / "tiers.png")])
    data = json.loads(out.read_text())
    assert set(data["configs"]) == {"resident", "ddr", "lmdb", "ddr+pipe", "lmdb+pipe"}
    for name in ("lmdb", "lmdb+pipe"):
        lmdb = data["configs"][name]
        assert lmdb["moved_rows"] > 0 and lmdb["moves"]["ssd_read"]["rows"] > 0
        assert lmdb["copy_reference"]["gather_s"] > 0 and data["ratios"][f"{name}_vs_resident"] > 0
        assert len(lmdb["step_s"]) == 2
    assert data["fresh_lookup"]["read_through_ratio"] > 0
    assert data["machine"]["cpu"]["model"]
    assert (tmp_path / "tiers.png").stat().st_size > 0
    # resident and ddr ran side by side, step by step; each did what it does alone
    assert data["configs"]["ddr"]["interleaved"] == ["resident", "ddr"] and data["ratios"]["ddr_vs_resident_paired"] > 0
    alone = mod.main([*args, "--configs", "resident,ddr", "--interleave", "", "--fresh-batch", "0", "--json", ""])
    assert "interleaved" not in alone["configs"]["ddr"]
    for key in ("moved_rows", "hbm_misses", "hbm_evictions"):
        assert alone["configs"]["ddr"][key] == data["configs"]["ddr"][key] > 0


def test_bench_memlimit_smoke(tmp_path):
    mod = _bench("bench_memlimit")
    if not mod.MEMLIMIT.exists():
        pytest.skip(f"no memlimit tool at {mod.MEMLIMIT}")
    out = tmp_path / "memlimit.json"
    shape = ["--steps", "4", "--tail", "2", "--batch", "2000", "--id-space", "1000000"]
    data = mod.main([*shape, "--hbm-rows", "1000", "--ddr-rows", "2000", "--headroom-mib", "512", "--json", str(out)])
    if "failed" in data["free"]:
        pytest.skip(f"memlimit cannot run here: {data['free']['memlimit']}")
    assert json.loads(out.read_text())["limited_over_free"] > 0
    assert len(data["limited"]["step_s"]) == 4 and data["free"]["peak_anon_mib"] > 0


def test_bench_lifecycle_smoke(tmp_path):
    mod = _bench("bench_lifecycle")
    out = tmp_path / "lifecycle.json"
    shape = ["--steps", "16", "--every", "4", "--batch", "256", "--window", "2000", "--shift", "100", "--ttl", "4"]
    small = ["--hbm-rows", "64", "--ddr-rows", "64", "--dim", "4", "--no-dlrm"]
    data = mod.main([*shape, *small, "--json", str(out), "--plot", str(tmp_path / "lifecycle.png")])
    stream = json.loads(out.read_text())["stream"]
    assert set(stream) == {"plain", "admit2", "admit5", "expire", "expire_admit2"}
    last = {n: r["points"][-1] for n, r in stream.items()}
    assert last["admit5"]["rows"] < last["admit2"]["rows"] < last["plain"]["rows"]
    assert last["expire"]["live_rows"] < last["plain"]["live_rows"]
    assert data["step_cost"]["admit2"] > 0
    assert (tmp_path / "lifecycle.png").stat().st_size > 0
