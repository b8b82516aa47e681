"""Readers beside the writer: ``TieredStore.open(path, mode="r")`` in other processes sees
completed checkpoints only, bitwise, and changes nothing; ``tiered-emb verify`` / ``inspect``."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tiered_emb import SGD, RowWiseAdagrad, StoreReader, TableConfig, TierConfig, TieredStore
from tiered_emb.cli import main as cli
from tiered_emb.errors import ConfigError, ReadOnlyError, StoreNotFoundError
from tiered_emb.testing import faults, flip_bit, random_updates

TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=3000, optimizer=SGD(lr=0.5)),
]
IDS = 3000
REPO = Path(__file__).resolve().parents[1]

# a reader process: refresh, read every row of both tables, note (epoch, digest), until told
# to stop; a file ``out.ready`` once it has read (its kernels compiled: a cold cache takes seconds)
READER = """
import hashlib, json, os, sys, time
from pathlib import Path
import numpy as np
from tiered_emb import TieredStore
path, out, stop = sys.argv[1:4]
seen = []
with TieredStore.open(path, mode="r") as r:
    while not os.path.exists(stop):
        epoch = r.refresh()
        h = hashlib.sha256()
        for t in ("a", "b"):
            h.update(r.peek(t, np.arange(3000), with_state=True).tobytes())
        seen.append([epoch, h.hexdigest()])
        if len(seen) == 1:
            Path(out + ".ready").touch()
        time.sleep(0.02)  # (four readers on this machine's cores: the writer keeps one)
Path(out).write_text(json.dumps(seen))
"""


def _digest(store) -> str:
    h = hashlib.sha256()
    for t in ("a", "b"):
        h.update(store.peek(t, np.arange(IDS), with_state=True).tobytes())
    return h.hexdigest()


def _tiers():
    return TierConfig(hbm_rows=64, ddr_rows=64, device="cpu")


def _train(path, checkpoints: int, readers: int, tmp: Path) -> tuple[dict, list]:
    """Train a store at ``path`` through ``checkpoints`` checkpoints with ``readers`` reader
    processes beside it; returns the digest of every checkpoint and what each reader saw."""
    digests = {}
    with TieredStore.create(path, TABLES, _tiers(), seed=5) as s:
        digests[s.epoch] = _digest(s)
        stop = tmp / "stop"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        procs = [
            subprocess.Popen([sys.executable, "-c", READER, str(path), str(tmp / f"r{k}.json"), str(stop)], env=env)
            for k in range(readers)
        ]
        deadline = time.monotonic() + 300
        while not all((tmp / f"r{k}.json.ready").exists() for k in range(readers)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a reader did not start"
            time.sleep(0.05)
        for k in range(checkpoints):
            random_updates([s], TABLES, 6, seed=k, n=200, ids_below=IDS)
            s.checkpoint()
            digests[s.epoch] = _digest(s)
        time.sleep(0.5 if readers else 0)
        stop.touch()
        for p in procs:
            assert p.wait(timeout=120) == 0
        final = _digest(s)
    seen = [json.loads((tmp / f"r{k}.json").read_text()) for k in range(readers)]
    return dict(digests, final=final), seen


def test_four_readers_see_only_completed_checkpoints_and_change_nothing(tmp_path):
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    digests, seen = _train(tmp_path / "with" / "s", 20, 4, tmp_path / "with")
    alone, _ = _train(tmp_path / "without" / "s", 20, 0, tmp_path / "without")
    assert digests == alone  # the writer's run is bitwise the same with readers beside it
    for reads in seen:
        assert reads, "a reader read nothing"
        for epoch, digest in reads:
            assert digests[epoch] == digest, f"a reader saw epoch {epoch} not as it was checkpointed"
    assert len({e for reads in seen for e, _ in reads}) > 1  # readers did move with the writer


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_readers_lookup_of_repeated_ids_in_any_order_is_the_writers(tmp_path, dtype):
    """Ids repeated, out of order, some never written: the reader's ``lookup`` and ``peek``
    (weights alone and whole records) answer row for row what the writer's ``peek`` did at
    the checkpoint, for rows held in float32 and in narrower types."""
    tables = [TableConfig("a", dim=6, num_rows=5000, dtype=dtype, optimizer=RowWiseAdagrad(lr=0.1))]
    ids = np.random.default_rng(5).integers(0, 5000, 3000)  # (many repeats; ids above 2,000 never written)
    with TieredStore.create(tmp_path / "s", tables, _tiers(), seed=1) as s:
        random_updates([s], tables, 3, n=400, ids_below=2000)
        weights, records = s.peek("a", ids), s.peek("a", ids, with_state=True)
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        np.testing.assert_array_equal(r.lookup("a", ids), weights)
        np.testing.assert_array_equal(r.peek("a", ids), weights)
        np.testing.assert_array_equal(r.peek("a", ids, with_state=True), records)
        assert r.lookup("a", ids).flags["C_CONTIGUOUS"]


def test_a_reader_cannot_change_a_store(tmp_path):
    with TieredStore.create(tmp_path / "s", TABLES, _tiers(), seed=1) as s:
        random_updates([s], TABLES, 3, n=50, ids_below=IDS)
        want = s.peek("a", np.arange(IDS), with_state=True)
    stamp = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s" / "lmdb").iterdir() if p.name != "lock.mdb"}
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        assert isinstance(r, StoreReader)
        np.testing.assert_array_equal(r.peek("a", np.arange(IDS), with_state=True), want)
        for call in (lambda: r.write("a", [1], np.ones((1, 4))), r.checkpoint, r.flush):
            with pytest.raises(ReadOnlyError, match="read-only"):
                call()
        with pytest.raises(ReadOnlyError):
            r.apply_gradients("a", [1], np.ones((1, 4), np.float32))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s" / "lmdb").iterdir() if p.name != "lock.mdb"} == stamp
    with pytest.raises(ConfigError, match="mode"):
        TieredStore.open(tmp_path / "s", mode="rw")
    with pytest.raises(ConfigError, match="tiers"):
        TieredStore.open(tmp_path / "s", tiers=_tiers(), mode="r")
    with pytest.raises(StoreNotFoundError):
        TieredStore.open(tmp_path / "none", mode="r")
    with TieredStore.open(tmp_path / "s") as s, pytest.raises(ConfigError, match="another process"):
        TieredStore.open(tmp_path / "s", mode="r")  # (LMDB maps a file once a process)


def test_a_reader_killed_in_its_snapshot_leaves_no_stale_slot(tmp_path):
    with TieredStore.create(tmp_path / "s", TABLES, _tiers(), seed=1) as s:
        random_updates([s], TABLES, 3, n=50, ids_below=IDS)
        s.checkpoint()
        code = "import sys, time\nfrom tiered_emb import TieredStore\nr = TieredStore.open(sys.argv[1], mode='r')\n"
        code += "print('open', flush=True)\ntime.sleep(600)\n"
        p = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "s")],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert p.stdout.readline().strip() == "open"
        assert str(p.pid) in faults.lmdb_readers(s)
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        s.checkpoint()  # frees the slots of dead readers
        assert str(p.pid) not in faults.lmdb_readers(s)


def test_verify_and_inspect_from_the_command_line(tmp_path, capsys):
    with TieredStore.create(tmp_path / "s", TABLES, _tiers(), seed=1) as s:
        random_updates([s], TABLES, 3, n=50, ids_below=IDS)
        # beside the writer, from another process: clean
        env = dict(os.environ, PYTHONPATH=str(REPO))
        run = [sys.executable, "-m", "tiered_emb.cli", "verify", "--json", str(tmp_path / "s")]
        got = subprocess.run(run, capture_output=True, text=True, env=env, check=False)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["damaged"] == []
    assert cli(["inspect", "--json", str(tmp_path / "s")]) == 0
    listed = json.loads(capsys.readouterr().out)
    with TieredStore.open(tmp_path / "s", mode="r") as r:
        assert listed["tables"]["b"]["rows"] == r.stats()["b"]["ssd"]["rows"] > 0
    tiers = _tiers()
    assert listed["tiers"]["hbm"] == {
        "rows_per_table": tiers.hbm_rows,
        "bytes": {t.name: tiers.hbm_rows * 4 * t.record_width for t in sorted(TABLES, key=lambda t: t.name)},
    }
    flip_bit(tmp_path / "s", "b")  # one bit of a row: exit status 1, the table named
    assert cli(["verify", str(tmp_path / "s")]) == 1
    assert "fail their checksums" in capsys.readouterr().err


# refresh moves the reader's index on from the snapshot before, reading only the segments
# written or rewritten since, and reads what a reader built from scratch would.
# A reader process: on each line of stdin, refresh (to the snapshot named, or the newest)
# and answer the epoch, the digest of every row of both tables and how refreshes went
STEPPED_READER = """
import hashlib, json, sys
import numpy as np
from tiered_emb import TieredStore
with TieredStore.open(sys.argv[1], mode="r") as r:
    for line in sys.stdin:
        epoch = r.refresh(int(line) if line.strip() else None)
        h = hashlib.sha256()
        for t in ("a", "b"):
            h.update(r.peek(t, np.arange(3000), with_state=True).tobytes())
        print(json.dumps([epoch, h.hexdigest(), r.refreshes]), flush=True)
"""


class _SteppedReader:
    """A reader process running ``script`` on the store at ``path``, a line of stdin a step."""

    def __init__(self, path: Path, script: str = STEPPED_READER):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-c", script, str(path)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def step(self, line: str = "") -> list:
        """Send ``line``; the JSON line the reader answers."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, "the reader process ended"
        return json.loads(answer)

    def refresh(self, snapshot: int | None = None) -> tuple[int, str, dict]:
        epoch, digest, refreshes = self.step("" if snapshot is None else str(snapshot))
        return epoch, digest, refreshes

    def close(self) -> None:
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=60)
        self.proc.stdout.close()
        assert rc == 0


def test_refresh_reads_only_what_changed_and_reads_it_right(tmp_path):
    path = tmp_path / "s"
    tiers = TierConfig(hbm_rows=64, ddr_rows=64, device="cpu", keep_checkpoints=3)
    digests = {}
    s = TieredStore.create(path, TABLES, tiers, seed=5)
    random_updates([s], TABLES, 6, seed=0, n=200, ids_below=IDS)
    digests[s.checkpoint()] = _digest(s)
    reader = _SteppedReader(path)
    try:
        epoch, digest, went = reader.refresh()
        assert digest == digests[epoch] and went == {
            "indexed": 1,
            "caught_up": 1,
            "segments_read": 0,
            "segments_gone": 0,
        }
        for k in range(1, 4):  # plain checkpoints: caught up, reading only the new segments
            random_updates([s], TABLES, 6, seed=k, n=200, ids_below=IDS)
            digests[s.checkpoint()] = _digest(s)
            epoch, digest, went = reader.refresh()
            assert (epoch, digest) == (s.epoch, digests[s.epoch])
        assert went["indexed"] == 1 and went["caught_up"] == 4 and went["segments_gone"] == 0
        read_before = went["segments_read"]
        # a compaction below the mark rewrites the segments the reader indexed
        s.engine.ssd.compact(["a", "b"])
        epoch, digest, went = reader.refresh()
        assert digest == digests[epoch] and went["caught_up"] == 5 and went["segments_gone"] > 0
        assert went["segments_read"] > read_before
        random_updates([s], TABLES, 6, seed=9, n=200, ids_below=IDS)
        digests[s.checkpoint()] = _digest(s)
        epoch, digest, went = reader.refresh()
        assert (epoch, digest) == (s.epoch, digests[s.epoch])
        # nothing changed: nothing read
        read_before = went["segments_read"]
        assert reader.refresh()[1] == digest and reader.refresh()[2]["segments_read"] == read_before
        # an older kept checkpoint, then the newest again
        older = sorted(digests)[-2]
        assert reader.refresh(older)[:2] == (older, digests[older])
        assert reader.refresh()[:2] == (s.epoch, digests[s.epoch])
        # the writer goes back to an older checkpoint and writes other rows under the same numbers
        s.close()
        s = TieredStore.open(path, snapshot=older)
        random_updates([s], TABLES, 6, seed=77, n=200, ids_below=IDS)
        newest = s.checkpoint()
        want = _digest(s)
        epoch, digest, went = reader.refresh()
        assert (epoch, digest) == (newest, want)
    finally:
        s.close()
        reader.close()
    with TieredStore.open(path, mode="r") as fresh:  # a reader built from scratch agrees
        assert _digest(fresh) == want


def test_refresh_over_segment_numbers_past_the_ones_indexed_before(tmp_path):
    """The reader's per-segment arrays are sized by the numbers it has indexed (64 at least);
    a catch-up over newer numbers counted their rows before growing them (a ValueError, the
    index half moved on).  Many checkpoints between two refreshes take the numbers past it."""
    path = tmp_path / "s"
    tables = [TableConfig("a", dim=128, optimizer=SGD(lr=0.5)), TABLES[1]]
    s = TieredStore.create(path, tables, _tiers(), seed=3)
    random_updates([s], tables, 1, seed=0, n=50, ids_below=IDS)
    s.checkpoint()
    reader = _SteppedReader(path)
    try:
        reader.refresh()  # (the reader has opened: its map is the file's size now)
        # past the map the reader took at its start (taking up a bigger one builds the index again)
        for k in range(4):
            random_updates([s], tables, 1, seed=100 + k, n=IDS, ids_below=IDS)
            s.checkpoint()
        epoch, digest, went = reader.refresh()
        assert (epoch, digest) == (s.epoch, _digest(s)), went
        indexed = went["indexed"]
        for k in range(1, 70):  # a segment a table a checkpoint: numbers past the arrays' 64 or 128
            random_updates([s], tables, 1, seed=k, n=20, ids_below=IDS)
            s.checkpoint()
        epoch, digest, went = reader.refresh()
        assert (epoch, digest) == (s.epoch, _digest(s)), went
        assert went["indexed"] == indexed and went["segments_read"] >= 2 * 69, went
    finally:
        s.close()
        reader.close()


# a reader process whose catch-up fails midway (after its first table), or whose index build
# fails ("load"), on the refreshes named
FAILING_READER = """
import hashlib, json, sys
import numpy as np
from tiered_emb import TieredStore
from tiered_emb.tiers.ssd.segments import SegmentLog
plain, calls = SegmentLog.catch_up, [0]
fail = {"once": None}
def catch_up(self, plan):
    calls[0] += 1
    if fail["once"] is not None and calls[0] % 2 == 0:
        kind, fail["once"] = fail["once"], None
        raise (MemoryError if kind == "error" else KeyboardInterrupt)()
    plain(self, plan)
SegmentLog.catch_up = catch_up
plain_load = SegmentLog.load
def load(self, table, below=None):
    if fail["once"] == "load":
        fail["once"] = None
        raise MemoryError()
    plain_load(self, table, below)
SegmentLog.load = load
def digest(r):
    h = hashlib.sha256()
    for t in ("a", "b"):
        h.update(r.peek(t, np.arange(3000), with_state=True).tobytes())
    return h.hexdigest()
with TieredStore.open(sys.argv[1], mode="r") as r:
    for line in sys.stdin:
        fail["once"] = line.strip() or None
        try:
            epoch = r.refresh()
        except BaseException as err:
            try:
                digest(r)
                after = "read"
            except Exception as e:
                after = type(e).__name__
            print(json.dumps([type(err).__name__, after, r.refreshes]), flush=True)
            continue
        print(json.dumps([epoch, digest(r), r.refreshes]), flush=True)
"""


def test_a_catch_up_that_fails_midway_never_mixes_two_checkpoints(tmp_path):
    """A refresh whose catch-up failed after its first table left that table at the new
    checkpoint and the other at the old one, and the snapshot's mark at the old: reads mixed
    two checkpoints.  A failed catch-up is now followed by a build from scratch; one that is
    interrupted drops the snapshot (reads refuse) until the next refresh."""
    path = tmp_path / "s"
    s = TieredStore.create(path, TABLES, _tiers(), seed=3)
    random_updates([s], TABLES, 3, seed=0, n=200, ids_below=IDS)
    s.checkpoint()
    reader = _SteppedReader(path, FAILING_READER)
    refresh = reader.step

    try:
        refresh()
        random_updates([s], TABLES, 3, seed=1, n=200, ids_below=IDS)
        s.checkpoint()
        epoch, digest, went = refresh("error")  # built from scratch instead
        assert (epoch, digest) == (s.epoch, _digest(s)) and went["indexed"] == 2, went
        random_updates([s], TABLES, 3, seed=2, n=200, ids_below=IDS)
        s.checkpoint()
        assert refresh("interrupt")[:2] == ["KeyboardInterrupt", "StoreClosedError"]
        epoch, digest, went = refresh()
        assert (epoch, digest) == (s.epoch, _digest(s)) and went["indexed"] == 3, went
    finally:
        s.close()
        reader.close()


def test_a_refresh_that_took_up_a_grown_map_and_failed_keeps_no_dead_snapshot(tmp_path):
    """Taking up a map the writer grew ends every transaction of the reader's process, the old
    snapshot's too; a refresh that then failed pinned that ended transaction back: reads
    through it raised CorruptStoreError ("restore from a backup") of a sound store, and reads
    by offset went on in pages the writer was free to reuse.  It now drops the snapshot."""
    path = tmp_path / "s"
    tables = [TableConfig("a", dim=128, optimizer=SGD(lr=0.5)), TABLES[1]]
    s = TieredStore.create(path, tables, _tiers(), seed=3)
    random_updates([s], tables, 1, seed=0, n=50, ids_below=IDS)
    s.checkpoint()
    reader = _SteppedReader(path, FAILING_READER)
    refresh = reader.step

    try:
        refresh()  # (the reader has opened: its map is the file's size now)
        for k in range(4):  # past the map the reader took at its start
            random_updates([s], tables, 1, seed=100 + k, n=IDS, ids_below=IDS)
            s.checkpoint()
        assert refresh("load")[:2] == ["MemoryError", "StoreClosedError"]
        epoch, digest, _ = refresh()
        assert (epoch, digest) == (s.epoch, _digest(s))
    finally:
        s.close()
        reader.close()
