"""The SSD tier out of core: memory bounded by configuration whatever was written since the
checkpoint (peak RSS of child processes), and a kill -9 inside a checkpoint, a compaction or
a recovery reopens bitwise at a completed checkpoint."""

import json
import statistics
import subprocess
import sys

import numpy as np
import pytest

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.testing.reference import ReferenceStore

MiB = 1 << 20

_MEMORY = r"""
import json, sys
import numpy as np
from tiered_emb import SGD, TableConfig, TierConfig, TieredStore
from tiered_emb.testing import AnonPeak, crash

path, phase, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])

memory = AnonPeak()  # (sampled every 2 ms)
start, peak = memory.restart, memory.peak
tiers = TierConfig(hbm_rows=8192, device="cpu", budget_bytes=16 << 20, background_writes=False)
out = {}

def write_all(s, value):
    for start in range(0, rows, 1 << 16):
        ids = np.arange(start, min(rows, start + (1 << 16)))
        s.write("t", ids, np.full((ids.shape[0], 64), value, np.float32))
    s.flush()

if phase == "dirty":  # every row dirty in DDR, none written yet: the checkpoint writes them all
    big = TierConfig(hbm_rows=8192, ddr_rows=rows, device="cpu", budget_bytes=16 << 20, background_writes=False)
    s = TieredStore.create(path, [TableConfig("t", dim=64, num_rows=rows, optimizer=SGD(lr=0.1))], big, seed=1)
    for a in range(0, rows, 1 << 16):
        ids = np.arange(a, min(rows, a + (1 << 16)))
        s.apply_gradients("t", ids, np.full((ids.shape[0], 64), 1.0, np.float32))
    out["trained"] = s.peek("t", np.array([0, rows - 1]))[:, 0].tolist()
    out["before"] = start()
    s.checkpoint()
    out["written"] = s.engine.last_checkpoint_rows
    out["after"] = peak()
    s.close(checkpoint=False)
    s = TieredStore.open(path, big)
    out["row"] = s.peek("t", np.array([0, rows - 1]))[:, 0].tolist()
    s.close(checkpoint=False)
elif phase == "convert":  # a store of every row converted to float16, a chunk of the budget at a time
    from tiered_emb.apps.portable import convert_store
    s = TieredStore.create(path, [TableConfig("t", dim=64, num_rows=rows, optimizer=SGD(lr=0.1))], tiers, seed=1)
    write_all(s, 0.5)
    s.close()
    TieredStore.open(path, tiers).close()  # (loads what an open runs)
    out["before"] = start()
    convert_store(path, path + "_c", "float16", tiers, lossy=True)
    out["after"] = peak()
    with TieredStore.open(path + "_c", tiers) as c:
        out["row"] = c.peek("t", np.array([0, rows - 1]))[:, 0].tolist()
elif phase == "bulk":  # bulk writes straight to LMDB on the writer thread, the next encoded meanwhile
    bg = TierConfig(hbm_rows=8192, device="cpu", budget_bytes=16 << 20, background_writes=True)
    s = TieredStore.create(path, [TableConfig("t", dim=64, num_rows=rows, optimizer=SGD(lr=0.1))], bg, seed=1)
    s.write("t", np.arange(1 << 14), np.ones((1 << 14, 64), np.float32))  # (compiles what a bulk write runs)
    s.flush()
    out["before"] = start()
    write_all(s, 0.5)
    out["after"] = peak()
    out["row"] = s.peek("t", np.array([0, rows - 1]))[:, 0].tolist()
    s.close()
elif phase == "checkpoint":
    s = TieredStore.create(path, [TableConfig("t", dim=64, num_rows=rows, optimizer=SGD(lr=0.1))], tiers, seed=1)
    write_all(s, 0.5)  # every row written since the (empty) checkpoint
    out["before"] = start()
    s.checkpoint()
    out["written"] = s.engine.last_checkpoint_rows
    out["after"] = peak()
    write_all(s, 0.25)  # and again, left for the recovery
    crash(s)
else:
    w = TieredStore.create(path + "_warm", [TableConfig("t", dim=64, num_rows=rows)], tiers, seed=1)
    w.write("t", np.arange(100), np.ones((100, 64), np.float32))
    w.flush()
    crash(w)
    TieredStore.open(path + "_warm", tiers, restore="latest").close()  # (loads what an open runs)
    out["before"] = start()
    s = TieredStore.open(path, tiers, restore="latest")
    out["after"] = peak()
    out["index_bytes"] = s.engine.ssd.index_bytes()
    out["row"] = s.peek("t", np.array([rows - 1]))[0, :2].tolist()
    s.close(checkpoint=False)
print(json.dumps(out))
"""


def _child(script, *args, timeout=600):
    p = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_checkpoint_and_recovery_memory_does_not_grow_with_the_rows_written(tmp_path):
    """One million rows of dim 64 (256 MiB of rows) written since the checkpoint: the
    checkpoint and the recovery at the latest write (restore="latest") each stay within the
    16 MiB budget and the SSD index (plus what a process's allocator keeps), far below the
    rows' bytes; before segments were a checkpoint's mark, both held every such row in
    memory several times over.  Measured: the peak of the child's anonymous memory,
    sampled every 2 ms (pages of ``data.mdb`` mapped by a read are the page cache's)."""
    rows = 1 << 20
    ck = _child(_MEMORY, tmp_path / "s", "checkpoint", rows)
    assert ck["written"] == 0  # (every row was in the segments already: the checkpoint moved its mark)
    assert ck["after"] - ck["before"] < 64 * MiB, ck
    rec = _child(_MEMORY, tmp_path / "s", "recover", rows)
    assert rec["row"] == [0.25, 0.25]
    assert rec["index_bytes"] <= 16 * rows + 8 * MiB  # sorted ids and locations, and a small hash of new ones
    assert rec["after"] - rec["before"] < rec["index_bytes"] + 96 * MiB, rec
    assert rec["after"] - rec["before"] < (256 * MiB) // 2, rec  # half the rows' bytes, stated plainly


def test_bulk_writes_on_the_writer_thread_hold_about_the_budget(tmp_path):
    """One million rows of dim 64 (256 MiB) written in calls of 16 MiB, each straight to
    LMDB on the writer thread while the next is copied and encoded: the transactions are a
    fifth of the 16 MiB budget, so what is in flight (rows, encoded segments, LMDB's pages,
    twice) stays near the budget, whatever was written.  Measured: 60-66 MiB over the
    start, of which 16 MiB is the caller's array; 106 MiB with transactions of the whole
    budget encoded ahead."""
    rows = 1 << 20
    bulk = _child(_MEMORY, tmp_path / "s", "bulk", rows)
    assert bulk["row"] == [0.5, 0.5]
    assert bulk["after"] - bulk["before"] < 96 * MiB, bulk


def test_convert_streams_within_the_budget(tmp_path):
    """One million rows of dim 64 (256 MiB in float32) converted to float16 into a new store,
    budget 16 MiB: the source's index and the new store's, a chunk of rows in both forms and
    the writes in flight, far below the rows' bytes."""
    rows = 1 << 20
    conv = _child(_MEMORY, tmp_path / "s", "convert", rows)
    assert conv["row"] == [0.5, 0.5]
    assert conv["after"] - conv["before"] < 96 * MiB, conv


def test_a_checkpoint_of_every_row_dirty_in_ddr_holds_a_chunk_at_a_time(tmp_path):
    """One million rows of dim 64 (256 MiB) dirty in DDR, none written since the
    checkpoint: the checkpoint writes them a quarter of the 16 MiB budget at a time, so its
    peak stays far below the rows' bytes (gathered whole, then sorted and encoded, it held
    them two to three times over); reopened, they read back."""
    rows = 1 << 20
    ck = _child(_MEMORY, tmp_path / "s", "dirty", rows)
    assert ck["written"] == rows
    assert ck["row"] == ck["trained"]
    assert ck["after"] - ck["before"] < 64 * MiB, ck


_KILLED = r"""
import os, signal, sys
import numpy as np
from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.testing import random_updates
from tiered_emb.tiers.ssd.checkpoint import Checkpointer
from tiered_emb.tiers.ssd.compaction import Compactor
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.segments import SegmentLog

path, point, nth, phase = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
Compactor.COMPACT_MIN_ROWS = 100
cls, name = {
    "segments": (SegmentLog, "put"),             # inside any write of segments (write-back, checkpoint)
    "meta": (Checkpointer, "put_meta"),          # inside the checkpoint's own transaction
    "compaction": (Compactor, "needed"),        # inside a compaction's transaction
    "indexing": (SegmentLog, "locate"),          # after a commit, before the index follows it
    "recovery": (LmdbEnv, "write"),              # while a store opens: deleting what came after its checkpoint
}[point]
real, calls = getattr(cls, name), [0]

def dying(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)

setattr(cls, name, dying)
tables = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=300, optimizer=SGD(lr=0.5)),
]
tiers = TierConfig(hbm_rows=8, ddr_rows=8, device="cpu")
if phase == "open":
    TieredStore.open(path, tiers).close(checkpoint=False)
    sys.exit(0)
s = TieredStore.create(path, tables, tiers, seed=4)
s.engine.ssd.writeback_rows = 32
for step in range(1, 41):
    random_updates([s], tables, 1, seed=step, ids_below=300)
    if step % 5 == 0:
        s.checkpoint()
        print(step, flush=True)
if phase == "crash":  # rows written after the last checkpoint, then a kill
    random_updates([s], tables, 3, seed=99, ids_below=300)
    s.flush()
    os.kill(os.getpid(), signal.SIGKILL)
s.close()
print("end", flush=True)
"""

TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=300, optimizer=SGD(lr=0.5)),
]


def _reference(steps):
    ref = ReferenceStore(TABLES, seed=4)
    from tiered_emb.testing import random_updates

    for step in range(1, steps + 1):
        random_updates([ref], TABLES, 1, seed=step, ids_below=300)
    return {t.name: ref.peek_records(t.name, np.arange(300)) for t in TABLES}


def _rows(path):
    with TieredStore.open(path) as s:
        return {t.name: s.peek(t.name, np.arange(300), with_state=True) for t in TABLES}


_MANY_TABLES = r"""
import sys
import numpy as np
from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.testing import AnonPeak

root = sys.argv[1]
tables = [TableConfig(f"t{i:02d}", dim=4, optimizer=RowWiseAdagrad(lr=0.1)) for i in range(26)]
rng = np.random.default_rng(0)
tiers = TierConfig(hbm_rows=256, ddr_rows=0, device="cpu", budget_bytes=64 << 20)
with TieredStore.create(root + "/warm", tables[:2], tiers) as s:  # (compiles what the steps and merges run)
    for _ in range(3):
        for t in tables[:2]:
            s.apply_gradients(t.name, rng.integers(0, 10**9, 10_000), np.ones((10_000, 4), np.float32))
memory = AnonPeak()
before = memory.restart()
with TieredStore.create(root + "/s", tables, tiers) as s:
    for _ in range(8):
        for t in tables:
            s.apply_gradients(t.name, rng.integers(0, 10**9, 10_000), np.ones((10_000, 4), np.float32))
    rows = sum(v["ssd"]["rows"] for v in s.stats().values())
print(memory.peak() - before, rows)
"""


def test_the_hashes_of_new_ids_share_the_budget_across_tables(tmp_path):
    """26 tables, each taking 10,000 new ids a step (updated, so written back): the SSD
    index's hashes of new ids take a quarter of ``budget_bytes`` for all the tables
    together, not each (which would be 26 quarters: 465 MiB here), so a child process's
    anonymous memory grows by the budget and the index's bytes a row."""
    out = subprocess.run([sys.executable, "-c", _MANY_TABLES, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    grown, rows = (int(x) for x in out.stdout.split())
    assert rows > 1_500_000
    bound = 64 * MiB + 20 * rows + 24 * MiB  # the budget, the index (12-16 bytes a row) and its hash, slack
    assert grown < bound, (grown / MiB, bound / MiB)


@pytest.mark.parametrize(
    ("point", "nth"),
    [("segments", 3), ("segments", 8), ("meta", 4), ("compaction", 1), ("compaction", 3), ("indexing", 9)],
)
def test_a_kill_inside_a_write_reopens_at_a_completed_checkpoint(tmp_path, point, nth):
    p = subprocess.run(
        [sys.executable, "-c", _KILLED, str(tmp_path / "s"), point, str(nth), "train"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    done = [int(x) for x in p.stdout.split() if x.isdigit()]
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr[-2000:])
    last = done[-1] if done else 0
    got = _rows(tmp_path / "s")
    # the checkpoint whose commit came just before the kill may not have printed
    wants = [_reference(last), _reference(last + 5)]
    assert any(all(np.array_equal(got[t], w[t]) for t in got) for w in wants), (point, nth, last)


def test_a_kill_while_a_store_opens_reopens_at_its_checkpoint(tmp_path):
    """Opening at the checkpoint deletes the segments written after it, a transaction at a
    time: killed at the first or between two, the next open finishes the work."""
    p = subprocess.run(
        [sys.executable, "-c", _KILLED, str(tmp_path / "s"), "segments", "0", "crash"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -9 and "40" in p.stdout.split(), p.stderr[-2000:]
    want = _reference(40)
    for nth in (1, 2):
        p = subprocess.run(
            [sys.executable, "-c", _KILLED, str(tmp_path / "s"), "recovery", str(nth), "open"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == -9, p.stderr[-2000:]
    got = _rows(tmp_path / "s")
    assert all(np.array_equal(got[t], want[t]) for t in want)


def test_a_batch_larger_than_the_budget_is_refused_and_changes_nothing(tmp_path):
    from tiered_emb.errors import ConfigError

    tables = [TableConfig("t", dim=64, optimizer=SGD(lr=0.5))]
    tiers = TierConfig(hbm_rows=1 << 14, device="cpu", budget_bytes=MiB)
    with TieredStore.create(tmp_path / "s", tables, tiers, seed=1) as s:
        s.apply_gradients("t", np.arange(10), np.ones((10, 64), np.float32))
        before = s.peek("t", np.arange(5000), with_state=True)
        with pytest.raises(ConfigError, match="budget_bytes"):  # 5,000 rows of 256 bytes: 1.2 MiB
            s.apply_gradients("t", np.arange(5000), np.ones((5000, 64), np.float32))
        with pytest.raises(ConfigError, match="budget_bytes"):
            s.lookup("t", np.arange(5000))
        assert s.peek("t", np.arange(5000), with_state=True).tobytes() == before.tobytes()
        s.lookup("t", np.arange(4000))  # (1,024,000 bytes: within the budget)


def test_a_bulk_write_over_the_budget_changes_nothing(tmp_path):
    """The rows of a bulk write that are not resident go straight to LMDB, the others through
    the tiers: the budget is checked for the whole batch (as for any) before either is written."""
    from tiered_emb.errors import ConfigError

    tables = [TableConfig("t", dim=64, optimizer=SGD(lr=0.5))]
    tiers = TierConfig(hbm_rows=16, ddr_rows=8192, device="cpu", budget_bytes=MiB)  # 4,096 rows of 256 bytes
    with TieredStore.create(tmp_path / "s", tables, tiers, seed=1) as s:
        for a in range(0, 6000, 3000):
            s.lookup("t", np.arange(a, a + 3000))  # 6,000 rows resident (DDR)
        ids = np.arange(12000)
        before = s.peek("t", ids)
        with pytest.raises(ConfigError, match="budget_bytes"):
            s.write("t", ids, np.ones((12000, 64), np.float32))
        assert s.peek("t", ids).tobytes() == before.tobytes()


def test_compaction_of_segments_larger_than_the_setting_now(tmp_path):
    """Segments written without compression hold up to 65,536 rows, with it 1,024: a store
    reopened with compression compacts the larger ones all the same (the run's numbers hold
    what it keeps)."""
    tables = [TableConfig("a", dim=4, optimizer=SGD(lr=0.5))]
    with TieredStore.create(tmp_path / "s", tables, TierConfig(hbm_rows=8, device="cpu"), seed=1) as s:
        s.write("a", np.arange(4000), np.ones((4000, 4), np.float32))
        s.flush()
        s.write("a", np.arange(2000), np.full((2000, 4), 2, np.float32))
    with TieredStore.open(tmp_path / "s", TierConfig(hbm_rows=8, device="cpu", ssd_compression=3)) as s:
        with s.engine.lock:
            s.engine.ssd.compact(["a"])
        assert s.engine.ssd.compactor.runs > 0
        got = s.peek("a", np.arange(4000))
        assert (got[:2000] == 2).all() and (got[2000:] == 1).all()


def test_bench_scale_quick_measures_every_part(tmp_path):
    """``bench/bench_scale.py --quick``: the I/O rates beside their peers, the long run's
    samples and checkpoints (rows written, not the checkpoint's number), the reopen."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "scale.json"
    run = [
        sys.executable,
        str(root / "bench" / "bench_scale.py"),
        "--quick",
        "--json",
        str(out),
        "--dir",
        str(tmp_path),
    ]
    subprocess.run(run, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(root)), timeout=600)
    got = json.loads(out.read_text())
    io, r = got["io"], got["run"]
    assert io["warm_rows_per_s"]["ours"] > 0 and io["warm_rows_per_s"]["memmap"] > 0 and io["import_rows_per_s"] > 0
    for key in ("bulk_write", "bulk_write_cold", "checkpoint_quarter", "checkpoint_all", "checkpoint_all_cold"):
        w = io[key]
        assert len(w["rows_per_s_each"]) == 3 and len(w["disk_MBps_each"]) == 4 and min(w["rows_per_s_each"]) > 0
        assert w["rows_per_s"] == statistics.median(w["rows_per_s_each"])
        assert w["vs_disk"] == pytest.approx(w["rows_per_s"] * io["dim"] * 4 / (w["disk_MBps"] * 1e6))
    assert r["steps"] == len(r["samples"]) and r["samples"][-1]["rows_stored"] > 0
    assert r["last_tenth_vs_warm_tenth"] > 0 and r["last_vs_warm_same_phase"] > 0
    assert r["reference"] and all(0 <= s < r["steps"] and x > 0 for s, x in r["reference"])  # (the drift)
    assert r["last_tenth_vs_warm_tenth_over_reference"] == pytest.approx(
        r["last_tenth_vs_warm_tenth"] / r["reference_last_tenth_vs_warm_tenth"]
    )
    warm, last, tenth = r["same_phase_steps"]  # (each window begins just after a checkpoint)
    assert {warm, last} <= {c["step"] for c in r["checkpoints"]} and tenth <= warm < last <= r["steps"] - tenth
    assert [c["rows_written"] for c in r["checkpoints"][:3]] != [1, 2, 3]
    assert sum(c["rows_written"] for c in r["checkpoints"]) > 0
    assert r["reopen"]["seconds"] > 0 and r["reopen"]["peak_rss_anon"] > 0
    assert 0 < r["reopen"]["index_bytes"] <= r["samples"][-1]["index_bytes"]  # (merged: no hash of new ids)
