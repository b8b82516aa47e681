"""The small job that compiles a first run's kernels beside it (tiered_emb/apps/warm.py)."""

from __future__ import annotations

import argparse
import time

from tiered_emb.apps import warm
from tiered_emb.cli import build_parser


def _args(**kw):
    return argparse.Namespace(device="cpu", policy="lookahead+sieve", **kw)


def test_the_small_job_has_the_runs_shape():
    cfg = {"dim": 64, "dtype": "bfloat16", "optimizer": "adam", "weight_decay": 0.01, "min_count": 2}
    cfg |= {"model": "dlrm", "lr_schedule": "cosine"}
    flags = warm.small_job(cfg, _args(), lookahead=0)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs["--dim"] == "64" and pairs["--dtype"] == "bfloat16" and pairs["--optimizer"] == "adam"
    assert pairs["--weight-decay"] == "0.01" and pairs["--min-count"] == "2" and pairs["--policy"] == "lookahead+sieve"
    assert pairs["--lookahead"] == "0" and pairs["--lr-schedule"] == "cosine" and pairs["--decay-steps"] == "4"
    assert int(pairs["--rows"]) > int(pairs["--hbm-rows"]) + int(pairs["--ddr-rows"])  # rows move between tiers
    parsed = build_parser().parse_args(["train", *flags, "--run-dir", "x"])  # flags the command takes
    assert (parsed.dim, parsed.dtype, parsed.optimizer, parsed.lookahead, parsed.policy) == (
        64,
        "bfloat16",
        "adam",
        0,
        "lookahead+sieve",
    )


def test_it_starts_only_on_a_cold_cache_on_the_cpu_when_allowed(tmp_path, monkeypatch):
    cold = tmp_path / "cache"
    cold.mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cold))
    monkeypatch.setenv("TIERED_EMB_WARM", "0")
    assert warm.cache_is_cold() and warm.start({"dim": 4}, _args(), 0) is None  # turned off
    monkeypatch.setenv("TIERED_EMB_WARM", "1")
    gpu = argparse.Namespace(device="cuda", policy="lru")
    assert warm.start({"dim": 4}, gpu, 0) is None
    (cold / "mod").mkdir()
    (cold / "mod" / "k.nbi").write_bytes(b"")
    assert not warm.cache_is_cold() and warm.start({"dim": 4}, _args(), 0) is None  # warm already
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "missing"))
    assert not warm.cache_is_cold()


def test_a_stopped_small_job_leaves_nothing_behind(tmp_path, monkeypatch):
    """Started on a cold cache, ended by the job: its process is reaped and its directory
    (under TMPDIR) removed; it wrote kernels into the cache it was given, nothing else."""
    cold, tmp = tmp_path / "cache", tmp_path / "tmp"
    cold.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cold))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("TIERED_EMB_WARM", "1")
    proc = warm.start({"dim": 4, "model": "dlrm"}, _args(), 0)
    assert proc is not None
    deadline = time.monotonic() + 120
    while not any(tmp.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(tmp.iterdir())  # its run directory, made once its handler for the end was set
    warm.stop(proc)
    assert proc.returncode == 0
    assert not any(tmp.iterdir())
