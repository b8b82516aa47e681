"""Kills at random instants and bit rot at random places, seeded: a store reopens bitwise at
a completed checkpoint, and damaged bytes are a typed error, never wrong rows.

A few seeds run in every CI run; many under ``-m slow`` (``python -m pytest -m slow
tests/tiers/ssd/test_crashes.py``)."""

import dataclasses
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.errors import CorruptStoreError
from tiered_emb.testing import random_updates
from tiered_emb.testing.reference import ReferenceStore

REPO = Path(__file__).resolve().parents[3]
TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=300, optimizer=SGD(lr=0.5)),
]
EVERY = 5  # steps between checkpoints

# trains with checkpoints every EVERY steps (write-backs of 32 rows, compaction of small
# stores on; argv[3]: the checkpoints kept), printing each completed checkpoint's step;
# "open" only reopens the store, "back N" reopens it at kept checkpoint N (dropping the later ones)
_TRAIN = r"""
import sys
from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.testing import random_updates
from tiered_emb.tiers.ssd.compaction import Compactor

path, phase = sys.argv[1], sys.argv[2]
Compactor.COMPACT_MIN_ROWS = 100
tables = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig(
        "b",
        dim=2,
        num_rows=300,
        optimizer=SGD(lr=0.5),
        min_count=3 if phase == "admit" else 1,
        ttl_steps=4 if phase == "expire" else None,
    ),
]
keep = int(sys.argv[3]) if phase == "train" and len(sys.argv) > 3 else None
tiers = TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", keep_checkpoints=keep)
if phase in ("open", "back"):
    print("opening", flush=True)
    TieredStore.open(path, tiers, snapshot=int(sys.argv[3]) if phase == "back" else None).close(checkpoint=False)
    print("opened", flush=True)
    sys.exit(0)
s = TieredStore.create(path, tables, tiers, seed=4)
s.engine.ssd.writeback_rows = 32
print("start", flush=True)
for step in range(1, 100_000):
    random_updates([s], tables, 1, seed=step, ids_below=300)
    if phase == "expire":
        s.advance_step()
    if phase == "delete":  # (deletions, and a purge of every stale copy every other checkpoint)
        deletions([s], tables, step)
        if step % 10 == 0:
            with s.engine.lock:
                s.engine.ssd.purge(["a", "b"])
    if step % 5 == 0:
        s.checkpoint()
        print(step, flush=True)
"""


def deletions(stores, tables, step: int) -> None:
    """Step ``step``'s deletions: 6 ids of each table, seeded by the step."""
    rng = np.random.default_rng(10_000 + step)
    for t in tables:
        ids = rng.integers(0, 300, 6)
        for s in stores:
            s.delete(t.name, ids)


_TRAIN = _TRAIN.replace(
    "from tiered_emb.testing import random_updates", "import numpy as np\nfrom tiered_emb.testing import random_updates"
)
_TRAIN = _TRAIN.replace(
    "path, phase = sys.argv[1], sys.argv[2]", inspect.getsource(deletions) + "\npath, phase = sys.argv[1], sys.argv[2]"
)


def _reference(steps: int, delete: bool = False, admit: bool = False, expire: bool = False) -> dict:
    tables = [TABLES[0], dataclasses.replace(TABLES[1], min_count=3)] if admit else TABLES
    if expire:
        tables = [TABLES[0], dataclasses.replace(TABLES[1], ttl_steps=4)]
    ref = ReferenceStore(tables, seed=4)
    for step in range(1, steps + 1):
        random_updates([ref], tables, 1, seed=step, ids_below=300)
        if expire:
            ref.advance_step()
        if delete:
            deletions([ref], TABLES, step)
    return {t.name: ref.peek_records(t.name, np.arange(300)) for t in TABLES}


def _rows(path: Path) -> dict:
    with TieredStore.open(path) as s:
        return {t.name: s.peek(t.name, np.arange(300), with_state=True) for t in TABLES}


def _killed_at(args: list[str], after: str, delay: float) -> list[str]:
    """Run the child with ``args``; once it printed ``after``, kill it (SIGKILL) ``delay``
    seconds later, or let it end; its output lines."""
    p = subprocess.Popen(
        [sys.executable, "-c", _TRAIN, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    lines = []
    while True:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.strip() == after:
            break
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    lines += p.stdout.read().split()
    p.stdout.close()
    p.wait()
    assert p.returncode in (0, -signal.SIGKILL), f"the child failed by itself (exit {p.returncode})"
    return lines


def _crash_and_recover(tmp_path: Path, seed: int, phase: str = "train") -> None:
    rng = np.random.default_rng(seed)
    path = tmp_path / "s"
    lines = _killed_at([str(path), phase], "start", float(rng.uniform(0.0, 3.0)))
    done = [int(x) for x in lines if x.isdigit()]
    last = done[-1] if done else 0
    # a kill while the store opens (deleting what came after its checkpoint), at a random instant
    _killed_at([str(path), "open"], "opening", float(rng.uniform(0.0, 0.3)))
    got = _rows(path)
    # the checkpoint whose commit came just before the kill may not have printed its step
    for steps in (last, last + EVERY):
        want = _reference(steps, phase == "delete", phase == "admit", phase == "expire")
        if all(np.array_equal(got[t], want[t]) for t in got):
            if phase in ("admit", "expire"):  # the counts / the counter and logs came back: 8 more steps
                with TieredStore.open(path) as s:
                    for step in range(steps + 1, steps + 9):
                        random_updates([s], TABLES, 1, seed=step, ids_below=300)
                        if phase == "expire":
                            s.advance_step()
                    more = {t.name: s.peek(t.name, np.arange(300), with_state=True) for t in TABLES}
                want = _reference(steps + 8, admit=phase == "admit", expire=phase == "expire")
                assert all(np.array_equal(more[t], want[t]) for t in more), f"seed {seed}: {phase} state not restored"
            return
    raise AssertionError(f"seed {seed}: reopened rows are no completed checkpoint's (last printed: {last})")


@pytest.mark.parametrize("seed", range(3))
def test_a_kill_at_a_random_instant_reopens_at_a_completed_checkpoint(tmp_path, seed):
    _crash_and_recover(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 40))
def test_many_kills_at_random_instants(tmp_path, seed):
    _crash_and_recover(tmp_path, seed)


@pytest.mark.parametrize("seed", range(3))
def test_a_kill_while_rows_are_deleted_and_purged_loses_and_resurrects_nothing(tmp_path, seed):
    """Deletions every step and a purge every 10: killed at a random instant (deleting,
    compacting, checkpointing), the store reopens at a completed checkpoint: no deleted row
    back, no row lost."""
    _crash_and_recover(tmp_path, seed, "delete")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 30))
def test_many_kills_while_rows_are_deleted(tmp_path, seed):
    _crash_and_recover(tmp_path, seed, "delete")


@pytest.mark.parametrize("seed", range(2))
def test_a_kill_while_rows_expire_reopens_at_a_completed_checkpoint(tmp_path, seed):
    """Table b's rows expire 4 steps after their last update, every step: after a kill the
    rows (their last update included) are those of one completed checkpoint."""
    _crash_and_recover(tmp_path, seed, "expire")


@pytest.mark.parametrize("seed", range(2))
def test_a_kill_under_admission_reopens_with_the_counts_of_its_checkpoint(tmp_path, seed):
    """Table b admits ids at their third sighting: after a kill the rows and the counts are
    those of one completed checkpoint (the next steps admit as an uninterrupted run would)."""
    _crash_and_recover(tmp_path, seed, "admit")


def _crash_going_back(tmp_path: Path, seed: int) -> None:
    """Kills while a store that keeps 3 checkpoints trains (each checkpoint drops the oldest),
    then while it reopens at one of them (dropping the later ones): every checkpoint it
    still lists reads back bitwise, and it opens at one of them."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "s"
    lines = _killed_at([str(path), "train", "3"], "start", float(rng.uniform(0.5, 3.0)))
    done = [int(x) for x in lines if x.isdigit()]
    with TieredStore.open(path, mode="r") as r:  # (epoch k is step k * EVERY: one checkpoint each)
        kept = r.snapshots()
    assert kept[-1] * EVERY >= (done[-1] if done else 0)
    back = int(rng.choice(kept))
    _killed_at([str(path), "back", str(back)], "opening", float(rng.uniform(0.0, 0.3)))
    s = TieredStore.open(path)
    epoch, listed = s.epoch, s.snapshots()
    got = {t.name: s.peek(t.name, np.arange(300), with_state=True) for t in TABLES}
    s.close(checkpoint=False)  # (a checkpoint would drop the oldest)
    assert epoch in (back, kept[-1]) and set(listed) <= set(kept), (seed, epoch, listed, kept)
    assert all(np.array_equal(got[t], w) for t, w in _reference(epoch * EVERY).items()), (seed, epoch)
    for e in listed:
        with TieredStore.open(path, mode="r", snapshot=e) as r:
            rows = {t.name: r.peek(t.name, np.arange(300), with_state=True) for t in TABLES}
        assert all(np.array_equal(rows[t], w) for t, w in _reference(e * EVERY).items()), (seed, e)


@pytest.mark.parametrize("seed", range(2))
def test_a_kill_while_checkpoints_are_dropped_keeps_every_listed_one(tmp_path, seed):
    _crash_going_back(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 30))
def test_many_kills_while_checkpoints_are_dropped(tmp_path, seed):
    _crash_going_back(tmp_path, seed)


# reads a damaged store: prints "rows <digest>" when it opened and read every row,
# "error <type>" for a typed error
_READ = r"""
import hashlib, sys
import numpy as np
from tiered_emb import TieredStore
from tiered_emb.errors import TieredEmbError
try:
    with TieredStore.open(sys.argv[1]) as s:
        h = hashlib.sha256()
        for t in ("a", "b"):
            h.update(s.peek(t, np.arange(300), with_state=True).tobytes())
    print("rows", h.hexdigest())
except TieredEmbError as err:
    print("error", type(err).__name__)
"""


def _rot(tmp_path: Path, seed: int) -> str:
    """Flip bits at 8 random places of data.mdb's used pages of a trained store; what a read
    of every row then gives."""
    path = tmp_path / "s"
    tiers = TierConfig(hbm_rows=8, ddr_rows=8, device="cpu")
    with TieredStore.create(path, TABLES, tiers, seed=4) as s:
        random_updates([s], TABLES, 20, seed=1, ids_below=300)
        s.checkpoint()
        want = {t.name: s.peek(t.name, np.arange(300), with_state=True) for t in TABLES}
    import hashlib

    h = hashlib.sha256()
    for t in ("a", "b"):
        h.update(want[t].tobytes())
    data = path / "lmdb" / "data.mdb"
    blob = bytearray(data.read_bytes())
    rng = np.random.default_rng(seed)
    for at in rng.integers(0, len(blob), 8).tolist():
        blob[at] ^= 1 << int(rng.integers(0, 8))
    data.write_bytes(bytes(blob))
    p = subprocess.run(
        [sys.executable, "-c", _READ, str(path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
        check=False,
    )
    out = p.stdout.split()
    if p.returncode < 0:  # (LMDB itself aborts on some damaged B-tree pages: no row was read wrong)
        return f"signal {-p.returncode}"
    assert out and out[0] in ("rows", "error"), p.stderr[-2000:]
    if out[0] == "rows":
        assert out[1] == h.hexdigest(), f"seed {seed}: a damaged store read back wrong rows"
        return "rows"
    return out[1]


@pytest.mark.parametrize("seed", range(4))
def test_bit_rot_is_an_error_or_harmless_never_wrong_rows(tmp_path, seed, record_property):
    outcome = _rot(tmp_path, seed)
    record_property("outcome", outcome)  # (tallied in docs/durability.md: --junitxml)
    assert outcome in ("rows", CorruptStoreError.__name__, "signal 6", "signal 11")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 100))
def test_much_bit_rot(tmp_path, seed, record_property):
    outcome = _rot(tmp_path, seed)
    record_property("outcome", outcome)
    assert outcome in ("rows", CorruptStoreError.__name__, "signal 6", "signal 11")
