"""``tiered-emb bench`` and bench/bench_policies.py at tiny sizes, so they never rot."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tiered_emb.cli import main
from tiered_emb.errors import ConfigError, MissingExtraError, TraceFileError
from tiered_emb.sim import bench
from tiered_emb.sim.bench import parse_count, parse_sizes

ROOT = Path(__file__).resolve().parents[2]


def test_parse():
    assert parse_count("20M") == 20_000_000 and parse_count("10k") == 10_000 and parse_count("7") == 7
    assert parse_sizes("0.1%,1%,50", 10_000) == [("0.1%", 10), ("1%", 100), ("50", 50)]
    with pytest.raises(ConfigError, match=r"e\.g\."):
        parse_count("lots")


def test_bench_policies(tmp_path, capsys):
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    assert (
        main(
            [
                "bench",
                "policies",
                "--trace",
                "zipf:1.0",
                "--ids",
                "2k",
                "--requests",
                "20k",
                "--cache",
                "1%,10%",
                "--policies",
                "lru,lfu,fifo,clock,sieve,s3fifo,arc,belady,lru-store",
                "--repeats",
                "1",
                "--json",
                str(out),
                "--plot",
                str(png),
                "--no-progress",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "belady" in table and "Mreq/s" in table
    res = json.loads(out.read_text())
    assert res["seed"] == 0 and "numba" in res["machine"]["versions"]
    by = {(r["policy"], r["cache_objects"]): r["hits"] for r in res["results"]}
    assert by[("lru", 20)] == by[("lru-store", 20)]
    assert all(by[(p, c)] <= by[("belady", c)] for p, c in by)
    assert png.stat().st_size > 0


@pytest.mark.parametrize("trace", ["drift:1.0", "tables:1.2,0.8"])
def test_bench_mrc(tmp_path, capsys, trace):
    out = tmp_path / "m.json"
    assert (
        main(
            [
                "bench",
                "mrc",
                "--trace",
                trace,
                "--ids",
                "1k",
                "--requests",
                "10k",
                "--cache",
                "1%,10%",
                "--repeats",
                "1",
                "--json",
                str(out),
                "--plot",
                str(tmp_path / "m.png"),
                "--no-progress",
            ]
        )
        == 0
    )
    mrc = json.loads(out.read_text())["mrc"]
    assert all(r["opt_hit_ratio"] >= r["lru_hit_ratio"] for r in mrc["sizes"])


def test_file_traces(tmp_path, capsys):
    p = tmp_path / "t.txt"
    p.write_text("".join(f"{i % 3} {i * 7 % 50}\n" for i in range(500)))
    assert (
        main(
            [
                "bench",
                "policies",
                "--trace",
                f"txt:{p}:1",
                "--cache",
                "10",
                "--policies",
                "lru,belady",
                "--repeats",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "belady" in capsys.readouterr().out


def test_without_matplotlib_the_run_is_refused_before_it_starts(tmp_path, capsys, monkeypatch):
    """--plot without matplotlib was reported after the whole run, with exit status 0."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    args = ["bench", "policies", "--ids", "1k", "--requests", "5k", "--cache", "1%", "--policies", "lru"]
    with pytest.raises(MissingExtraError, match="--plot needs matplotlib") as e:
        main([*args, "--repeats", "1", "--plot", str(tmp_path / "x.png"), "--no-progress"])
    assert "pip install 'tiered-emb[bench]'" in e.value.hint
    assert capsys.readouterr().out == ""  # nothing ran
    assert not (tmp_path / "x.png").exists()


def test_unknown_trace_and_policy():
    with pytest.raises(ConfigError, match="unknown trace"):
        main(["bench", "policies", "--trace", "pareto:1", "--no-progress"])
    with pytest.raises(ConfigError, match="choose from"):
        main(["bench", "policies", "--ids", "1k", "--requests", "1k", "--policies", "mru", "--no-progress"])


@pytest.mark.parametrize("table", ["sized", "default"])
def test_compare_libcachesim(tmp_path, capsys, table):
    pytest.importorskip("libcachesim")
    out = tmp_path / "c.json"
    assert (
        main(
            [
                "bench",
                "policies",
                "--ids",
                "5k",
                "--requests",
                "30k",
                "--cache",
                "1%,10%",
                "--policies",
                "lru,lfu,fifo,clock,sieve,s3fifo,arc,belady",
                "--compare",
                "libcachesim",
                "--repeats",
                "1",
                "--libcachesim-table",
                table,
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["results"]
    ours = {(r["policy"], r["cache_objects"]): r["hits"] for r in rows if r["engine"] == "tiered_emb"}
    theirs = {(r["policy"], r["cache_objects"]): r["hits"] for r in rows if r["engine"] == "libcachesim"}
    assert set(theirs) == set(ours)
    assert ours == theirs  # every shared policy, to the request, whatever its table
    powers = {r["hashpower"] for r in rows if r["engine"] == "libcachesim"}
    assert powers == ({None} if table == "default" else {10})  # 2 * 500 objects -> 2^10 buckets


def test_libcachesim_table_names():
    from tiered_emb.sim.compare import libcachesim_hashpower, libcachesim_peer

    assert libcachesim_hashpower(100_000) == 18 and libcachesim_hashpower(3) == 10
    assert libcachesim_hashpower(100_000, "default") is None
    with pytest.raises(ConfigError, match="choose from sized, default"):
        libcachesim_hashpower(10, "huge")
    with pytest.raises(ConfigError, match="choose from sized, default"):
        with libcachesim_peer(np.arange(4), table="huge"):
            pass


def test_bench_script_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_policies", ROOT / "bench" / "bench_policies.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = [
        "--ids",
        "2k",
        "--requests",
        "10k",
        "--repeats",
        "1",
        "--mrc-repeats",
        "1",
        "--json",
        str(tmp_path / "p.json"),
        "--plot",
        str(tmp_path / "p.png"),
        "--quiet",
    ]
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        args.append("--no-libcachesim")
    assert mod.main(args) == 0
    assert "mrc" in json.loads((tmp_path / "p.json").read_text())


SMALL = ["--ids", "1000", "--requests", "5000", "--no-progress", "--repeats", "1"]


@pytest.mark.parametrize("cache", ["0%", "nan%", "inf%", "-1%"])
def test_bad_cache_sizes(cache):
    # 0% was silently one object; nan% / inf% a raw ValueError / OverflowError
    with pytest.raises(ConfigError, match=r"cache size|not a count"):
        parse_sizes(cache, 1000)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--policies", ","], "names no policy"),  # ran nothing, exit 0
        (["--repeats", "0"], "--repeats"),  # StatisticsError
        (["--seed", "-1"], "--seed"),  # ValueError from numpy
        (["--ids", "0"], "--rows 0"),  # IndexError (--ids: the old spelling of --rows)
        (["--requests", "-1"], "--requests"),  # ValueError
        (["--requests", "0"], "requests=0"),  # an empty run
        (["--trace", "zipf:nan"], "skew"),  # one id, hit ratio 0.9998
        (["--trace", "tables:1.0,1.0", "--pooling", "x"], "pooling"),  # ValueError
        (["--trace", "tables:1.0,1.0", "--pooling", "0"], "pooling"),  # ZeroDivisionError
        (["--trace", "tables:1.0,1.0", "--batch", "0"], "batch"),  # ZeroDivisionError
    ],
)
def test_bad_policies_arguments(extra, match):
    args = ["bench", "policies", *SMALL, "--cache", "10", "--policies", "lru"]
    with pytest.raises(ConfigError, match=match):
        main(args + extra)


def test_bad_mrc_and_lookahead_arguments(tmp_path):
    with pytest.raises(ConfigError, match="--repeats"):  # UnboundLocalError
        main(["bench", "mrc", *SMALL[:-2], "--cache", "10", "--repeats", "0"])
    with pytest.raises(ConfigError, match="--load-ahead"):
        main(["bench", "lookahead", *SMALL, "--cache", "10", "--window", "1", "--load-ahead", "2"])
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(TraceFileError, match="no ids"):  # IndexError in the curve's sampling
        main(["bench", "mrc", "--trace", f"csv:{empty}", "--cache", "10%", "--no-progress", "--repeats", "1"])


def test_negative_request_cap_on_a_file(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("1\n2\n3\n4\n5\n")
    with pytest.raises(ConfigError, match="negative"):  # tr[:-2] dropped the last two requests
        bench.load_trace(f"csv:{p}", 1000, -2, 0)
    assert bench.load_trace(f"csv:{p}", 1000, 0, 0)[0].tolist() == [1, 2, 3, 4, 5]
    assert bench.load_trace(f"csv:{p}", 1000, 3, 0)[0].tolist() == [1, 2, 3]


def test_caches_far_larger_than_the_trace(capsys):
    # 10**12 objects: numpy could not allocate the cache (3.6 TiB) nor the lookahead tiers
    assert main(["bench", "policies", *SMALL, "--cache", "1000000000000", "--policies", "lru,belady"]) == 0
    out = capsys.readouterr().out
    assert (
        main(
            [
                "bench",
                "lookahead",
                "--ids",
                "1000",
                "--requests",
                "5000",
                "--cache",
                "100000000000",
                "--no-progress",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    assert out.count("1,000,000,000,000") == 2


def test_unwritable_output_is_refused_before_the_run(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="--json"):  # NotADirectoryError, after the run
        main(["bench", "policies", *SMALL, "--cache", "10", "--policies", "lru", "--json", str(f / "x.json")])
    assert capsys.readouterr().out == ""  # nothing ran
    with pytest.raises(ConfigError, match="--json"):
        bench.write_json(f / "x.json", {})


def test_shell_command_prints_a_typed_error_without_a_traceback():
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tiered_emb.cli import main; sys.exit(main())",
            "bench",
            "policies",
            "--ids",
            "1000",
            "--requests",
            "1000",
            "--cache",
            "0%",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "error:" in r.stderr and "Hint:" in r.stderr and "Traceback" not in r.stderr


def test_bench_script_fails_when_the_peer_counts_other_hits(tmp_path, monkeypatch, capsys):
    """Every shared policy is defined as libCacheSim's: a peer hit count that differs is a
    failed run (exit status 1, the JSON still written with same_hits false)."""
    from contextlib import contextmanager

    import tiered_emb.sim.compare as compare

    @contextmanager
    def off_by_one_peer(trace, workdir=None, table="sized"):
        from tiered_emb.sim.engine import simulate

        yield lambda policy, cap: (1.0, simulate(trace, cap, policy) + (policy == "fifo"))

    monkeypatch.setattr(compare, "libcachesim_peer", off_by_one_peer)
    spec = importlib.util.spec_from_file_location("bench_policies", ROOT / "bench" / "bench_policies.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "p.json"
    assert (
        mod.main(
            [
                "--ids",
                "2k",
                "--requests",
                "10k",
                "--repeats",
                "1",
                "--no-mrc",
                "--policies",
                "lru,fifo",
                "--json",
                str(out),
                "--quiet",
            ]
        )
        == 1
    )
    rows = [r for r in json.loads(out.read_text())["results"] if r["engine"] == "libcachesim"]
    assert {r["policy"]: r["same_hits"] for r in rows} == {"lru": True, "fifo": False}
    assert "fifo at" in capsys.readouterr().err
