"""``tiered-emb bench`` and bench/bench_policies.py at tiny sizes, so they never rot."""
import builtins
import importlib.util
import json
from pathlib import Path

import pytest

from tiered_emb.cli import main
from tiered_emb.errors import ConfigError
from tiered_emb.sim.bench import parse_count, parse_sizes

ROOT = Path(__file__).resolve().parents[2]


def test_parse():
    assert parse_count("20M") == 20_000_000 and parse_count("10k") == 10_000 and parse_count("7") == 7
    assert parse_sizes("0.1%,1%,50", 10_000) == [("0.1%", 10), ("1%", 100), ("50", 50)]
    with pytest.raises(ConfigError, match="e.g."):
        parse_count("lots")


def test_bench_policies(tmp_path, capsys):
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    assert main(["bench", "policies", "--trace", "zipf:1.0", "--ids", "2k", "--requests", "20k", "--cache",
                 "1%,10%", "--policies", "lru,lfu,fifo,clock,sieve,s3fifo,arc,belady,lru-store", "--repeats", "1",
                 "--json", str(out), "--plot", str(png), "--no-progress"]) == 0
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
    assert main(["bench", "mrc", "--trace", trace, "--ids", "1k", "--requests", "10k", "--cache", "1%,10%",
                 "--repeats", "1", "--json", str(out), "--plot", str(tmp_path / "m.png"), "--no-progress"]) == 0
    mrc = json.loads(out.read_text())["mrc"]
    assert all(r["opt_hit_ratio"] >= r["lru_hit_ratio"] for r in mrc["sizes"])


def test_file_traces(tmp_path, capsys):
    p = tmp_path / "t.txt"
    p.write_text("".join(f"{i % 3} {i * 7 % 50}\n" for i in range(500)))
    assert main(["bench", "policies", "--trace", f"txt:{p}:1", "--cache", "10", "--policies", "lru,belady",
                 "--repeats", "1", "--no-progress"]) == 0
    assert "belady" in capsys.readouterr().out


def test_without_matplotlib(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert main(["bench", "policies", "--ids", "1k", "--requests", "5k", "--cache", "1%", "--policies", "lru",
                 "--repeats", "1", "--plot", str(tmp_path / "x.png"), "--no-progress"]) == 0
    assert "pip install 'tiered-emb[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_unknown_trace_and_policy():
    with pytest.raises(ConfigError, match="unknown trace"):
        main(["bench", "policies", "--trace", "pareto:1", "--no-progress"])
    with pytest.raises(ConfigError, match="choose from"):
        main(["bench", "policies", "--ids", "1k", "--requests", "1k", "--policies", "mru", "--no-progress"])


def test_compare_libcachesim(tmp_path, capsys):
    pytest.importorskip("libcachesim")
    out = tmp_path / "c.json"
    assert main(["bench", "policies", "--ids", "5k", "--requests", "30k", "--cache", "1%,10%", "--policies",
                 "lru,lfu,fifo,clock,sieve,s3fifo,arc,belady", "--compare", "libcachesim", "--repeats", "1",
                 "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())["results"]
    ours = {(r["policy"], r["cache_objects"]): r["hits"] for r in rows if r["engine"] == "tiered_emb"}
    theirs = {(r["policy"], r["cache_objects"]): r["hits"] for r in rows if r["engine"] == "libcachesim"}
    assert set(theirs) == set(ours)
    assert ours == theirs  # every shared policy, to the request


def test_bench_script_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_policies", ROOT / "bench" / "bench_policies.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = ["--ids", "2k", "--requests", "10k", "--repeats", "1", "--mrc-repeats", "1", "--json", str(tmp_path / "p.json"),
            "--plot", str(tmp_path / "p.png"), "--quiet"]
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        args.append("--no-libcachesim")
    assert mod.main(args) == 0
    assert "mrc" in json.loads((tmp_path / "p.json").read_text())
