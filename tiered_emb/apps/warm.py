"""A job's first run, its kernels compiled beside it: a small job of the same shape in a
process of its own, sharing the kernel cache.

Numba compiles a kernel the first time a process calls it and saves the machine code in
the kernel cache (:mod:`tiered_emb._kernel_cache`), where every later process loads it.
The first ``tiered-emb train`` after an install (or after any change to the source)
therefore compiles every kernel it uses, one after another on the step's thread, and
takes about twice as long as the next.  When the cache holds no kernel yet, the job
starts this module beside it: the job's table shape (dim, dtype, optimizer, weight decay,
admission, policy, model, lookahead), 4,096 rows a table, tiers a sixteenth of that,
a few steps of 64 samples, in a temporary directory it removes at its end.  A kernel it
compiles first is loaded by the job when the job gets there, so the two processes share
the compiling.  The job's rows and results do not depend on it: a kernel is the same
machine code whichever process compiled it.  It ends by itself within seconds of the
job's first steps, is ended when the job ends, and is silent: a failure in it only
leaves the kernels to the job.  ``TIERED_EMB_WARM=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

#: The flags of the job the small one copies (they choose which kernels are compiled).
SHAPE_FLAGS = ("dim", "dtype", "optimizer", "weight_decay", "min_count", "model", "policy", "lr_schedule")


def cache_is_cold() -> bool:
    """Whether the kernel cache in use holds no compiled kernel yet (none at all: unknown)."""
    where = os.environ.get("NUMBA_CACHE_DIR")
    if not where or not Path(where).is_dir():
        return False
    return next(Path(where).rglob("*.nbi"), None) is None


def small_job(cfg: dict, args, lookahead: int) -> list[str]:
    """The ``tiered-emb train`` flags of the small job for a run of ``cfg`` (its config) and
    ``args`` (its flags), ``lookahead`` batches ahead (0 or more, as the run's)."""
    flags = ["--rows", "4096", "--hbm-rows", "256", "--ddr-rows", "256", "--batch", "64"]
    flags += ["--steps", "4", "--eval-batches", "1", "--lookahead", str(lookahead)]
    for key in SHAPE_FLAGS:
        value = cfg.get(key, getattr(args, key, None))
        if value is not None:
            flags += ["--" + key.replace("_", "-"), str(value)]
    if cfg.get("lr_schedule", "constant") != "constant":
        flags += ["--decay-steps", "4"]
    return flags


def start(cfg: dict, args, lookahead: int) -> subprocess.Popen | None:
    """Start the small job beside a run of ``cfg`` where the kernel cache is cold (None: not
    started: a warm cache, ``TIERED_EMB_WARM=0``, a GPU run, or no process could start)."""
    if os.environ.get("TIERED_EMB_WARM", "1") == "0" or getattr(args, "device", "cpu") != "cpu":
        return None
    if not cache_is_cold():
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "tiered_emb.apps.warm", *small_job(cfg, args, lookahead)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, TIERED_EMB_WARM="0"),  # (it starts none of its own)
        )
    except OSError:
        return None


def stop(proc: subprocess.Popen | None) -> None:
    """End the small job if it still runs (it removes its directory) and reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ended(signum, frame) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """Run the small job (``argv``: its flags) in a directory of its own, removed at the end."""
    signal.signal(signal.SIGTERM, _ended)
    where = tempfile.mkdtemp(prefix="tiered_emb_warm_")
    try:
        from tiered_emb.cli import main as cli

        with contextlib.suppress(Exception):
            cli(["train", *(sys.argv[1:] if argv is None else argv), "--quiet", "--run-dir", where + "/run"])
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
