"""Numba's cache directory is named by the package's source: kernels never mix versions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tiered_emb import _kernel_cache


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("def f():\n    return 2\n")
    (root / "notes.txt").write_text("not source")
    return root


def test_the_hash_follows_every_source_file_and_nothing_else(tmp_path):
    root = _tree(tmp_path / "pkg")
    first = _kernel_cache.source_hash(root)
    assert _kernel_cache.source_hash(root) == first
    (root / "notes.txt").write_text("changed, but not source")
    assert _kernel_cache.source_hash(root) == first
    (root / "sub" / "b.py").write_text("def f():\n    return 3\n")  # an inlined helper's module
    changed = _kernel_cache.source_hash(root)
    assert changed != first
    (root / "sub" / "b.py").rename(root / "sub" / "c.py")  # the same bytes under another name
    assert _kernel_cache.source_hash(root) not in (first, changed)


def test_the_directory_is_beside_the_sources_or_in_the_home_cache(tmp_path, monkeypatch):
    root = _tree(tmp_path / "pkg")
    got = _kernel_cache.cache_dir(root)
    assert got == root / "__pycache__" / f"kernels-{_kernel_cache.source_hash(root)}"
    monkeypatch.setattr(_kernel_cache.os, "access", lambda path, mode: False)
    monkeypatch.setattr(_kernel_cache.Path, "home", staticmethod(lambda: tmp_path / "home"))
    assert _kernel_cache.cache_dir(root) == tmp_path / "home" / ".cache" / "tiered_emb" / got.name


def test_older_directories_are_pruned_but_the_newest_two_and_recent_ones(tmp_path):
    cache = tmp_path / "__pycache__"
    ages = {"old0": 4, "old1": 3, "old2": 2, "old3": 1, "busy": 0}  # hours
    for name, hours in ages.items():
        d = cache / f"kernels-{name}"
        d.mkdir(parents=True)
        (d / "k.nbi").write_text("x")
        t = time.time() - 3600 * hours - 60
        os.utime(d, (t, t))
    (cache / "not-ours").mkdir()
    current = cache / "kernels-new"
    current.mkdir()
    _kernel_cache.prune_older(current)
    # the two newest older ones (busy, old3) kept; old2 and old1 gone; old0 too
    assert sorted(p.name for p in cache.iterdir()) == ["kernels-busy", "kernels-new", "kernels-old3", "not-ours"]
    for name in ("recent1", "recent2"):  # two more, touched now
        (cache / f"kernels-{name}").mkdir()
    _kernel_cache.prune_older(current)
    # the newest two by count (recent1, recent2), busy for being touched within the hour;
    # old3, past both, goes
    assert sorted(p.name for p in cache.glob("kernels-*")) == [
        "kernels-busy",
        "kernels-new",
        "kernels-recent1",
        "kernels-recent2",
    ]


def _cache_dir_in_child(env: dict) -> str:
    code = "import tiered_emb, numba; print(numba.config.CACHE_DIR)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_the_package_points_numba_at_it_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    got = Path(_cache_dir_in_child(env))
    assert got.name == f"kernels-{_kernel_cache.source_hash()}"
    assert got.is_dir()
    assert _cache_dir_in_child({**env, "NUMBA_CACHE_DIR": "/tmp/mine"}) == "/tmp/mine"


def test_the_directory_survives_numba_reloading_its_config():
    """Numba reloads its config from the environment when a NUMBA_* variable changes (at a
    compile): the directory is in the environment too, so the reload keeps it."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    code = (
        "import os, numba, tiered_emb\n"
        "before = numba.config.CACHE_DIR\n"
        "os.environ['NUMBA_OPT'] = '2'\n"
        "numba.core.config.reload_config()\n"
        "print(before == numba.config.CACHE_DIR != '')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
