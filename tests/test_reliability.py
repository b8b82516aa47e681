"""Defects found by trying the store's promises (issue: trust the bytes), each a regression test."""

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.prefetch import lookahead
from tiered_emb.tiers.ssd.codec import PerThread


def test_each_thread_compresses_and_decompresses_with_its_own_zstd_context():
    """zstandard's contexts are not thread-safe: the step and the prefetch thread sharing one
    read back garbage, and a false CorruptStoreError stopped the run."""
    made = []
    per_thread = PerThread(lambda: made.append(object()) or made[-1])
    seen = {}

    def use(name):
        seen[name] = (per_thread.context(), per_thread.context())

    threads = [threading.Thread(target=use, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"][0] is seen["a"][1] and seen["b"][0] is seen["b"][1]  # one context a thread, kept
    assert seen["a"][0] is not seen["b"][0] and len(made) == 2


def test_compressed_rows_read_ahead_beside_the_step_read_back_bitwise(tmp_path):
    """With ``ssd_compression`` and read-ahead the step and the lookahead thread decompress at
    once; the run trains to the end and every row equals a run without read-ahead."""
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 20_000, 2_048) for _ in range(120)]
    runs = []
    for read_ahead in (3, 0):
        tiers = TierConfig(hbm_rows=256, ddr_rows=256, device="cpu", ssd_compression=3)
        cfg = TableConfig("t", dim=16, optimizer=RowWiseAdagrad(lr=0.05))
        with TieredStore.create(tmp_path / f"r{read_ahead}", [cfg], tiers, seed=1) as s:
            for step, ids in enumerate(lookahead(s, batches, lambda b: {"t": b}, 3, read_ahead=read_ahead)):
                s.apply_gradients("t", ids, np.full((ids.shape[0], 16), 0.01, np.float32))
                if step % 5 == 4:
                    s.flush()
            runs.append(s.peek("t", np.arange(20_000), with_state=True))
    assert runs[0].tobytes() == runs[1].tobytes()


def test_losing_a_create_race_is_store_exists_and_leaves_the_winner_alone(tmp_path, monkeypatch):
    """Another process's create() makes the directory between this one's look and its mkdir:
    StoreExistsError (a caller falls back to open() on it), not ConfigError, and the
    winner's directory is left as it was."""
    from tiered_emb import _directory
    from tiered_emb.errors import StoreExistsError

    path = tmp_path / "s"
    real = _directory.refuse_existing
    looks = []

    def winner_makes_it_meanwhile(p):
        real(p)
        looks.append(p)
        if len(looks) == 2:  # the look just before the mkdir (create() looks once before, too)
            p.mkdir()
            (p / "winner").write_text("mine")

    monkeypatch.setattr(_directory, "refuse_existing", winner_makes_it_meanwhile)
    with pytest.raises(StoreExistsError, match="another create"):
        TieredStore.create(path, [TableConfig("t", dim=4)], TierConfig(hbm_rows=4, device="cpu"))
    assert (path / "winner").read_text() == "mine" and sorted(p.name for p in path.iterdir()) == ["winner"]


_CRASHING_LOOP = r"""
import sys
import numpy as np
from tiered_emb import TableConfig, TierConfig, TieredStore
from tiered_emb.prefetch import lookahead
s = TieredStore.create(sys.argv[1], [TableConfig("t", dim=4)], TierConfig(hbm_rows=64, device="cpu"))
batches = lookahead(s, [np.arange(8)] * 10, lambda b: {"t": b}, 3, load_ahead=1)
for i, b in enumerate(batches):
    s.apply_gradients("t", b, np.ones((8, 4), np.float32))
    if i == 2:
        raise RuntimeError("step failed")
"""


def test_a_training_loop_that_crashes_exits(tmp_path):
    """A step raising inside a lookahead loop held by a variable reached the top level, and the
    interpreter waited forever at exit for a prefetch thread that no longer ran: a crashed job
    that never ends is invisible to a scheduler.  It exits with the step's error now."""
    p = subprocess.run(
        [sys.executable, "-c", _CRASHING_LOOP, str(tmp_path / "s")], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1 and "RuntimeError: step failed" in p.stderr
    assert "Exception ignored" not in p.stderr


def _tmpfs(tmp_path, size: str):
    """A tmpfs of ``size`` at ``tmp_path / "disk"`` (root only: mounting needs it)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MiB tmpfs filled to the last block."""
    for mnt in _tmpfs(tmp_path, "2m"):
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / 'fill'}", "bs=4k", "count=1000"], capture_output=True)
        yield mnt


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs, empty."""
    yield from _tmpfs(tmp_path, "16m")


_CREATE = r"""
import sys
from tiered_emb import TableConfig, TierConfig, TieredStore
from tiered_emb.errors import StoreFullError
try:
    TieredStore.create(sys.argv[1], [TableConfig("t", dim=4)], TierConfig(hbm_rows=4, device="cpu"))
except StoreFullError as err:
    print("StoreFullError:", err)
"""


def test_create_on_a_full_disk_is_store_full_and_leaves_nothing(full_disk):
    """LMDB writes its lock file through a memory map: on a full disk the process died of
    SIGBUS (exit 135) and left a half-made directory.  Now a StoreFullError, nothing left,
    and a create() once there is room succeeds."""
    path = full_disk / "s"
    p = subprocess.run([sys.executable, "-c", _CREATE, str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("StoreFullError:"), (p.returncode, p.stdout, p.stderr)
    assert not path.exists()
    (full_disk / "fill").unlink()
    TieredStore.create(path, [TableConfig("t", dim=4)], TierConfig(hbm_rows=4, device="cpu")).close()


# trains a store on the disk at argv[1], checkpoints, fills the disk, trains on: prints
# each checkpoint's digest and the error; "free" then frees the disk and checkpoints again,
# "kill" dies (os._exit) after the error
_FILLS_UP = r"""
import hashlib, os, sys
import numpy as np
from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.errors import StoreFullError
from tiered_emb.testing import random_updates
from tiered_emb.testing.reference import ReferenceStore
disk, then, where = sys.argv[1:4]
tables = [TableConfig("t", dim=16, num_rows=200_000, optimizer=RowWiseAdagrad(lr=0.1))]
rows = 60_000 if where == "checkpoint" else 256  # (the rows stay in HBM and DDR, or are written back)
s = TieredStore.create(f"{disk}/s", tables, TierConfig(hbm_rows=rows, ddr_rows=rows, device="cpu"), seed=3)
s.engine.ssd.writeback_rows = 256 if where == "write-back" else s.engine.ssd.writeback_rows
ref = ReferenceStore(tables, seed=3)
everything = np.arange(200_000)
def digest():
    return hashlib.sha256(s.peek("t", everything, with_state=True).tobytes()).hexdigest()
random_updates([s, ref], tables, 5, seed=1, n=2000, ids_below=200_000)
s.checkpoint()
print("checkpoint", digest(), flush=True)
with open(f"{disk}/fill", "wb") as f:
    try:
        while True:
            f.write(bytes(65536))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        pass
at = "training"
try:
    random_updates([s, ref], tables, 20, seed=2, n=2000, ids_below=200_000)
    at = "checkpoint"
    s.checkpoint()
    print("no error", flush=True)
except StoreFullError:
    print("StoreFullError", at, flush=True)
if then == "kill":
    os._exit(1)
os.unlink(f"{disk}/fill")
s.checkpoint()
print("after", digest(), np.array_equal(s.peek("t", everything, with_state=True), ref.peek_records("t", everything)))
s.close()
"""


def _fill_up(disk, then: str, where: str) -> list[str]:
    run = [sys.executable, "-c", _FILLS_UP, str(disk), then, where]
    p = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert p.returncode == (1 if then == "kill" else 0), p.stderr[-2000:]
    return p.stdout.split("\n")


def test_a_disk_that_fills_at_a_checkpoint_loses_nothing(small_disk):
    """The disk fills while the rows changed since the checkpoint are written: StoreFullError
    (rolled back), the store goes on; once there is room the next checkpoint has every update,
    and the store reopens at it bitwise."""
    out = _fill_up(small_disk, "free", "checkpoint")
    assert out[1] == "StoreFullError checkpoint", out
    assert out[2].startswith("after ") and out[2].endswith(" True"), out
    with TieredStore.open(small_disk / "s") as s:
        got = hashlib.sha256(s.peek("t", np.arange(200_000), with_state=True).tobytes()).hexdigest()
    assert got == out[2].split()[1]


@pytest.mark.parametrize("where", ["checkpoint", "write-back"])
def test_a_process_that_dies_on_a_full_disk_reopens_at_its_last_checkpoint(small_disk, where):
    """Full while checkpointing, or while writing evicted rows back: after the error the
    process dies; the store reopens bitwise at the checkpoint before."""
    where_error = {"checkpoint": "checkpoint", "write-back": "training"}
    out = _fill_up(small_disk, "kill", where)
    assert out[0].startswith("checkpoint ") and out[1] == f"StoreFullError {where_error[where]}", out
    (small_disk / "fill").unlink()
    with TieredStore.open(small_disk / "s") as s:
        got = hashlib.sha256(s.peek("t", np.arange(200_000), with_state=True).tobytes()).hexdigest()
    assert got == out[0].split()[1]


_RACER = r"""
import os, sys, time
from tiered_emb import TableConfig, TierConfig, TieredStore
from tiered_emb.errors import TieredEmbError
path, go = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.001)
try:
    TieredStore.create(path, [TableConfig("t", dim=4)], TierConfig(hbm_rows=4, device="cpu")).close()
    print("created")
except TieredEmbError as err:
    print(type(err).__name__)
"""


@pytest.mark.parametrize("round_", range(3))
def test_racing_creates_from_several_processes_make_one_store(tmp_path, round_):
    """Five processes create() one path at once: one makes it, each other is told it exists
    (or is being made: locked), and the store that results opens whole."""
    path, go = tmp_path / "s", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, str(path), str(go)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(5)
    ]
    time.sleep(2.0)  # (every racer has imported the package and waits)
    go.touch()
    outcomes = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outcomes.count("created") == 1, outcomes
    assert set(outcomes) <= {"created", "StoreExistsError", "StoreLockedError"}, outcomes
    with TieredStore.open(path) as s:
        assert s.lookup("t", np.array([1])).shape == (1, 4)
