"""A job's first run, its kernels compiled beside it in a process of its own that shares the
kernel cache.

Numba compiles a kernel the first time a process calls it and saves the machine code in
the kernel cache (:mod:`tiered_emb._kernel_cache`), where every later process loads it.
The first ``tiered-emb train`` after an install (or after any change to the source)
therefore compiles every kernel it uses, one after another on the step's thread.  When
the cache holds no kernel yet, the job starts this module beside it.  Where the job's
table shape (dtype, optimizer, weight decay, admission, model; any dim and policy) is the
default job's, it compiles the kernels of :data:`KERNELS` (the default job's, with their
signatures, in the order that job first calls them; those made for a dim are made for
the job's, those that take a policy take the job's; ``python -m tiered_emb.apps.warm
--record tiered_emb/apps/kernels.json`` writes the list) from the last to the first,
while the job compiles from the first: each compile takes a lock of its kernel and
signature (:mod:`tiered_emb._compiles`), so a kernel one process is compiling is loaded
by the other from the cache, and the two compile different kernels at once.  For a job
of another shape (whose kernels take other types) it runs a small job of that shape
instead, which calls the kernels in the job's order: 4,096 rows a table, tiers a
sixteenth of that, a few steps of 64 samples, in a temporary directory it removes at its
end.

The job's rows and results do not depend on it: a kernel is the same machine code
whichever process compiled it.  It ends by itself, is ended when the job ends, and is
silent: a failure in it only leaves the kernels to the job.  ``TIERED_EMB_WARM=0`` turns
it off.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tiered_emb import _compiles

#: The default job's kernels and signatures, in the order it first calls them (see the module doc).
KERNELS = Path(__file__).resolve().parent / "kernels.json"

#: The flags of the job the small one copies (they choose which kernels are compiled).
SHAPE_FLAGS = ("dim", "dtype", "optimizer", "weight_decay", "min_count", "model", "policy", "lr_schedule")


def cache_is_cold() -> bool:
    """Whether the kernel cache in use holds no compiled kernel yet (none at all: unknown)."""
    where = os.environ.get("NUMBA_CACHE_DIR")
    if not where or not Path(where).is_dir():
        return False
    return next(Path(where).rglob("*.nbi"), None) is None


def small_job(cfg: dict, args, lookahead: int, ddr: bool = True) -> list[str]:
    """The ``tiered-emb train`` flags of the small job for a run of ``cfg`` (its config) and
    ``args`` (its flags), ``lookahead`` batches ahead (0 or more, as the run's), with a DDR
    tier where the run has one (its kernels, or those of HBM's victims written back)."""
    flags = ["--rows", "4096", "--hbm-rows", "256", "--ddr-rows", "256" if ddr else "0", "--batch", "64"]
    flags += ["--steps", "4", "--eval-batches", "1", "--lookahead", str(lookahead)]
    for key in SHAPE_FLAGS:
        value = cfg.get(key, getattr(args, key, None))
        if value is not None:
            flags += ["--" + key.replace("_", "-"), str(value)]
    if cfg.get("lr_schedule", "constant") != "constant":
        flags += ["--decay-steps", "4"]
    return flags


def start(cfg: dict, args, lookahead: int, ddr: bool = True) -> subprocess.Popen | None:
    """Start the small job beside a run of ``cfg`` where the kernel cache is cold (None: not
    started: a warm cache, ``TIERED_EMB_WARM=0``, a GPU run, or no process could start)."""
    if os.environ.get("TIERED_EMB_WARM", "1") == "0" or getattr(args, "device", "cpu") != "cpu":
        return None
    if not cache_is_cold():
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "tiered_emb.apps.warm", *small_job(cfg, args, lookahead, ddr)],
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


def shape_of(flags: list[str]) -> dict[str, str]:
    """The :data:`SHAPE_FLAGS` among a small job's ``flags`` (pairs of flag and value)."""
    wanted = {"--" + key.replace("_", "-") for key in SHAPE_FLAGS}
    return {flag: value for flag, value in zip(flags[::2], flags[1::2], strict=False) if flag in wanted}


def compile_kernels(shape: dict[str, str], path: Path = KERNELS) -> bool:
    """Compile the kernels listed in ``path`` (see the module doc), the last first, for a
    run of ``shape`` (:func:`shape_of`); returns whether they are that run's.  The kernels
    made for a dim are made for the run's, and those that take a policy take the run's
    (its :class:`~tiered_emb.cache.policies.PolicyTag` type).  Nothing (False) where the
    list's run had another shape but for its dim and policy, or the file is missing,
    unreadable, or of another Numba."""
    from tiered_emb.cache.policies import POLICIES, PolicyType

    try:
        listed = json.loads(path.read_text())
        entries, version, recorded = listed["kernels"], listed["numba"], listed["shape"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    free = {"--dim": None, "--policy": None}
    if {**recorded, **free} != {**shape, **free}:  # (other types: of no use to this run)
        return False
    dim = int(shape["--dim"]) if "--dim" in shape else None
    spec = POLICIES.get(shape.get("--policy", recorded.get("--policy", "")))
    if spec is None:
        return False
    code = spec.code

    def retype(t):
        return PolicyType(code) if isinstance(t, PolicyType) else t

    return _compiles.compile_listed(entries[::-1], version, dim, retype) > 0


def record(path: Path, flags: list[str]) -> int:
    """Run ``tiered-emb train`` with ``flags`` and write the kernels it calls, and its shape,
    to ``path`` (:data:`KERNELS`'s format); returns how many kernels."""
    import numba

    from tiered_emb.apps.dlrm_config import run_config
    from tiered_emb.cli import build_parser

    args = build_parser().parse_args(["train", *flags, "--run-dir", "-"])
    shape = shape_of(small_job(run_config(args), args, 0))
    with _compiles.recording() as entries:
        _small(flags)
    listed = {"numba": numba.__version__, "shape": shape, "kernels": entries}
    path.write_text(json.dumps(listed, indent=0) + "\n")
    return len(entries)


def _small(flags: list[str]) -> None:
    """Run ``tiered-emb train`` with ``flags`` in a directory of its own, removed at the end."""
    where = tempfile.mkdtemp(prefix="tiered_emb_warm_")
    try:
        from tiered_emb.cli import main as cli

        cli(["train", *flags, "--quiet", "--run-dir", where + "/run"])
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Compile the listed kernels, then run the small job (``argv``: its flags) unless the
    list is of a run of the same shape.  With ``--record PATH`` first in ``argv``: run
    ``tiered-emb train`` with the flags after PATH (none: the default job, whose kernels
    :data:`KERNELS` lists) and write its kernels to PATH instead."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record"]:
        print(f"{record(Path(argv[1]), argv[2:])} kernels written to {argv[1]}")
        return 0
    signal.signal(signal.SIGTERM, _ended)
    with contextlib.suppress(Exception):
        if not compile_kernels(shape_of(argv)):  # (the run's kernels listed: it calls no other)
            _small(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
