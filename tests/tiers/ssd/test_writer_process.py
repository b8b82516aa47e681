"""The LMDB writer process of background write-backs (tiers/ssd/writer_main.py, writer_client.py)."""

import io
import os
import signal
import sys
import threading
import time

import lmdb
import numba
import numpy as np
import pytest

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.errors import CorruptStoreError
from tiered_emb.testing import random_updates
from tiered_emb.testing.reference import ReferenceStore
from tiered_emb.tiers.ssd import WRITER_PROCESS, codec, writer_main
from tiered_emb.tiers.ssd.segments import SegmentLog
from tiered_emb.tiers.ssd.writer_client import WriterProcess

pytestmark = pytest.mark.skipif(not WRITER_PROCESS, reason="background writes use a thread on this OS")

TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=3, num_rows=500, optimizer=SGD(lr=0.5)),
]


def _steps(s, ref, steps, seed=0, n=40):
    random_updates((s, ref), TABLES, steps, seed, n, ids_below=500)


def _pending(s) -> dict:
    """Every key and value of every ``p:`` database (after the writes in flight)."""
    s.engine.ssd.wait_writes()
    with s.engine.ssd.lmdb.env.begin() as txn:
        return {
            t: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=s.engine.ssd.lmdb.pending[t])] for t in sorted(s.tables)
        }


def _store(path, background, **kw):
    s = TieredStore.create(
        path, TABLES, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", background_writes=background, **kw), seed=2
    )
    s.engine.ssd.writeback_rows = 16  # a write-back transaction every few steps
    return s


def _equals_reference(path, ref):
    """The store at ``path``, reopened at its checkpoint, holds the reference's rows and states."""
    ids = np.arange(500)
    with TieredStore.open(path) as s:
        for t in TABLES:
            np.testing.assert_array_equal(s.peek(t.name, ids, with_state=True), ref.peek_records(t.name, ids))


@pytest.mark.parametrize("compression", [None, 3])
def test_the_writer_process_writes_what_this_process_writes(tmp_path, compression):
    """Same keys and bytes in ``p:`` as the in-process writer, and the same rows after reopening."""
    a = _store(tmp_path / "a", True, ssd_compression=compression)
    b = _store(tmp_path / "b", False, ssd_compression=compression)
    ref = ReferenceStore(TABLES, seed=2)
    _steps(a, ref, 12)
    _steps(b, None, 12)
    assert (
        a.engine.ssd.writer_handle() is not None and a.engine.ssd.writer_handle().poll() is None
    )  # the process wrote them
    assert b.engine.ssd.writer_handle() is None
    pa, pb = _pending(a), _pending(b)
    assert pa == pb and sum(a.engine.ssd.pending_rows(t)["live"] for t in pa) > 100
    for t, segments in pa.items():  # the index holds every id of the segments
        held = set()
        for _, v in segments:
            n = codec.SEGMENT_HEADER.unpack_from(v)[3]
            held |= set(np.frombuffer(v, "<i8", n, codec.SEGMENT_HEADER.size).tolist())
        assert a.engine.ssd.pending_ids(t).tolist() == sorted(held)
    proc = a.engine.ssd.writer_handle()
    a.close()
    b.close()
    assert proc.returncode == 0  # close() ended it
    _equals_reference(tmp_path / "a", ref)


def test_a_killed_writer_process_loses_nothing(tmp_path):
    """Its write is rolled back and raised (typed) by the next operation before it changes
    anything; the rows wait in memory, and the next write starts a new process."""
    s = _store(tmp_path / "s", True)
    ref = ReferenceStore(TABLES, seed=2)
    _steps(s, ref, 6)
    s.engine.ssd.wait_writes()
    first = s.engine.ssd.writer_handle()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    raised, rng = [], np.random.default_rng(5)
    for step in range(30):
        for t in TABLES:
            ids = rng.integers(0, 500, 40)
            g = rng.standard_normal((40, t.dim)).astype(np.float32)
            before = s.peek(t.name, ids, with_state=True)
            try:
                s.apply_gradients(t.name, ids, g)
            except CorruptStoreError as err:
                assert "writer process" in str(err)
                assert s.peek(t.name, ids, with_state=True).tobytes() == before.tobytes()  # nothing changed
                raised.append(step)
                s.apply_gradients(t.name, ids, g)
            ref.apply_gradients(t.name, ids, g)
    assert len(raised) == 1
    assert (
        s.engine.ssd.writer_handle() is not None
        and s.engine.ssd.writer_handle() is not first
        and s.engine.ssd.writer_handle().poll() is None
    )
    s.close()
    _equals_reference(tmp_path / "s", ref)


def test_a_full_map_is_grown_for_the_writer_process(tmp_path):
    """The process reports a full map without writing; this side grows its map and sends the
    write again, and the process takes the new size."""
    s = TieredStore.create(
        tmp_path / "s",
        [TableConfig("w", dim=64, optimizer=SGD(lr=0.5))],
        TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", map_size_bytes=1 << 20),
        seed=2,
    )
    s.engine.ssd.writeback_rows = 4096
    ref = ReferenceStore([TableConfig("w", dim=64, optimizer=SGD(lr=0.5))], seed=2)
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = rng.integers(0, 1 << 30, 512)
        g = rng.standard_normal((512, 64)).astype(np.float32)
        s.apply_gradients("w", ids, g)
        ref.apply_gradients("w", ids, g)
    s.engine.ssd.wait_writes()
    assert s.engine.ssd.failed_write is None and s.engine.ssd.writer_handle() is not None
    assert s.engine.ssd.lmdb.map_size() > 1 << 20 and s.engine.ssd.pending_rows("w")["live"] > 4096
    s.close()
    with TieredStore.open(tmp_path / "s") as s:
        some = np.unique(np.random.default_rng(1).integers(0, 1 << 30, 512))
        np.testing.assert_array_equal(s.peek("w", some, with_state=True), ref.peek_records("w", some))


def _serve(monkeypatch, frames: bytes, parent: int, ppids):
    """Run the writer's main() here on ``frames``; os.getppid() answers from ``ppids``."""
    calls = iter(ppids)
    monkeypatch.setattr(writer_main.os, "getppid", lambda: next(calls, -1))
    monkeypatch.setattr(sys, "argv", ["writer_main.py", str(parent)])
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(frames)))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out))
    writer_main.main()
    return out.getvalue()


def _env_for_writer(tmp_path):
    """An LMDB environment with a ``p:a`` database, and the hello frame a writer opens it with."""
    path = tmp_path / "env"
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=4)
    env.open_db(b"p:a")
    env.close()
    return path, codec.frame_bytes(
        {"path": str(path), "map_size": 1 << 24, "max_dbs": 4, "max_readers": 64, "compression": None, "dbs": ["p:a"]}
    )


def _write_request(ids, rows, map_size, seq=0):
    head = {"map_size": map_size, "parts": [["p:a", seq, int(ids.shape[0]), int(rows.shape[1])]]}
    return codec.frame_bytes(head) + ids.tobytes() + rows.tobytes()


def test_an_orphaned_writer_never_commits(tmp_path, monkeypatch):
    """Its parent gone (re-parented) by the time LMDB's writer lock is taken, a write is
    rolled back: a store opened by another process since must not get stale rows."""
    path, hello = _env_for_writer(tmp_path)
    ids, rows = np.arange(3, dtype=np.int64), np.ones((3, 2), np.float32)
    frames = hello + _write_request(ids, rows, 1 << 24) + _write_request(ids + 10, rows, 1 << 24, seq=1)
    # the parent is there at the start, for the first commit, then gone for the second
    out = _serve(monkeypatch, frames, parent=777, ppids=[777, 777, 1])
    replies = []
    stream = io.BytesIO(out)
    while (r := codec.read_frame(stream)) is not None:
        replies.append(r)
    assert replies == [{"ok": True}, {"ok": True}]  # no reply to the second: it ended
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=4)
    with env.begin() as txn:
        got = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=env.open_db(b"p:a", txn=txn))]
    env.close()
    assert got == [(codec.segment_key(0), bytes(codec.encode_segment(ids, rows, None, 0)))]
    # started by a parent already gone: it writes nothing at all
    assert _serve(monkeypatch, frames, parent=777, ppids=[1]) == b""


def test_the_writer_puts_a_segment_the_trainer_encoded_as_it_is(tmp_path, monkeypatch):
    """A part sent as an encoded value is put byte for byte: the same value as the writer
    encodes from the rows (and from a part of either form in one write)."""
    path, hello = _env_for_writer(tmp_path)
    ids, rows = np.arange(5, dtype=np.int64) * 7, np.arange(10, dtype=np.float32).reshape(5, 2)
    value = codec.encode_segment(ids, rows, None, 1)
    encoded = codec.frame_bytes({"map_size": 1 << 24, "parts": [["p:a", 1, int(value.nbytes)]]}) + value.tobytes()
    frames = hello + _write_request(ids, rows, 1 << 24, seq=0) + encoded
    out = _serve(monkeypatch, frames, parent=777, ppids=[777] * 10)
    stream = io.BytesIO(out)
    assert [codec.read_frame(stream) for _ in range(3)] == [{"ok": True}] * 3
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=4)
    with env.begin() as txn:
        got = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=env.open_db(b"p:a", txn=txn))]
    env.close()
    assert got == [
        (codec.segment_key(0), bytes(codec.encode_segment(ids, rows, None, 0))),
        (codec.segment_key(1), value.tobytes()),
    ]


def test_a_writer_whose_input_ends_mid_write_commits_nothing(tmp_path, monkeypatch):
    path, hello = _env_for_writer(tmp_path)
    whole = _write_request(np.arange(3, dtype=np.int64), np.ones((3, 2), np.float32), 1 << 24)
    with pytest.raises(SystemExit):
        _serve(monkeypatch, hello + whole[:-5], parent=777, ppids=[777] * 10)
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=4)
    with env.begin() as txn:
        assert txn.stat(env.open_db(b"p:a", txn=txn))["entries"] == 0
    env.close()


def test_the_writer_process_ends_with_a_killed_trainer(tmp_path):
    """A trainer killed outright leaves no writer behind (its input closes), and the store
    opens again at its checkpoint."""
    import subprocess

    script = f"""
import sys, numpy as np
from tiered_emb import TableConfig, TieredStore, TierConfig, SGD
s = TieredStore.create({str(tmp_path / "s")!r}, [TableConfig("a", dim=4, optimizer=SGD(lr=0.5))],
                       TierConfig(hbm_rows=4, ddr_rows=4, device="cpu"), seed=1)
s.engine.ssd.writeback_rows = 8
rng = np.random.default_rng(0)
for _ in range(20):
    s.apply_gradients("a", rng.integers(0, 1000, 16), np.ones((16, 4), np.float32))
s.engine.ssd.wait_writes()
print(s.engine.ssd.writer_pid(), flush=True)
sys.stdin.read()
"""
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as trainer:
        try:
            child = int(trainer.stdout.readline())
            assert _alive(child)
        finally:
            trainer.kill()
            trainer.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    if _alive(child):
        pytest.fail("the writer process outlived its trainer")
    with TieredStore.open(tmp_path / "s") as s:  # at its checkpoint: the one create() made
        assert s.epoch == 0 and s.stats()["a"]["ssd"]["rows"] == 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_writer_process_that_cannot_start_leaves_the_writes_to_the_thread(tmp_path, monkeypatch):
    """No python that runs the writer (a frozen or embedded app): a warning, then the writer
    thread writes itself, as before the writer process; nothing lost, nothing left open."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    s = _store(tmp_path / "s", True)
    ref = ReferenceStore(TABLES, seed=2)
    with pytest.warns(RuntimeWarning, match="writer process .* could not start .* thread from now on"):
        _steps(s, ref, 12)
        s.engine.ssd.wait_writes()
    assert (
        s.engine.ssd.writer_process is False
        and s.engine.ssd.writer_handle() is None
        and s.engine.ssd.failed_write is None
    )
    assert sum(s.engine.ssd.pending_rows(t)["live"] for t in s.tables) > 0  # written by the thread
    s.close()
    _equals_reference(tmp_path / "s", ref)


@pytest.mark.parametrize(
    "case",
    ["no interpreter", "another program", "a silent program", "frozen", "a Path in sys.path", "warnings are errors"],
)
def test_every_writer_that_cannot_start_leaves_the_writes_to_the_thread(tmp_path, monkeypatch, case):
    """An embedded or frozen app (sys.executable none, or the app itself, which answers
    anything or nothing), and odd sys.path entries, fall back to the writer thread; under
    -W error the warning does not fail the write."""
    import warnings

    if case in ("no interpreter", "warnings are errors"):
        monkeypatch.setattr(sys, "executable", None)
    elif case == "another program":
        monkeypatch.setattr(sys, "executable", "/bin/echo")  # prints its arguments: not a frame
    elif case == "a silent program":
        silent = tmp_path / "app.sh"
        silent.write_text("#!/bin/sh\nsleep 30\n")
        silent.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(silent))
        monkeypatch.setattr(WriterProcess, "START_TIMEOUT_S", 1)
    elif case == "frozen":
        monkeypatch.setattr(sys, "frozen", True, raising=False)
    elif case == "a Path in sys.path":
        monkeypatch.setattr(sys, "path", [*sys.path, tmp_path, "a" + os.pathsep + "b"])
    s = _store(tmp_path / "s", True)
    ref = ReferenceStore(TABLES, seed=2)
    with warnings.catch_warnings(record=case != "warnings are errors") as seen:
        warnings.simplefilter("error" if case == "warnings are errors" else "always")
        _steps(s, ref, 12)
        s.engine.ssd.wait_writes()
    assert s.engine.ssd.failed_write is None
    if case == "a Path in sys.path":  # those entries are left out; the writer runs
        assert s.engine.ssd.writer_handle() is not None and s.engine.ssd.writer_process
    else:
        assert s.engine.ssd.writer_process is False and s.engine.ssd.writer_handle() is None
        if case != "warnings are errors":
            assert any("thread from now on" in str(w.message) for w in seen)
    s.close()
    _equals_reference(tmp_path / "s", ref)


def _writers_of_this_process() -> list[int]:
    """Pids of the running writer processes started by this process."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"writer_main.py") for a in args) and str(os.getpid()).encode() in args and _alive(int(pid)):
            found.append(int(pid))
    return found


def test_the_writer_starts_before_the_first_write_back_that_needs_it(tmp_path):
    """A quarter of ``writeback_rows`` waiting starts the process (beside the steps that fill
    the buffer); the first write-back then goes to it; a store closed before any write-back
    ends a process started early."""
    before = set(_writers_of_this_process())
    s = _store(tmp_path / "s", True)
    ssd = s.engine.ssd
    rows = np.ones((3, 5), np.float32)
    ssd.write_pending({"a": (np.arange(3), rows)}, durable=False)  # (3 < 16 // 4)
    time.sleep(0.5)
    assert set(_writers_of_this_process()) == before
    ssd.write_pending({"a": (np.arange(3, 6), rows)}, durable=False)  # 6 waiting
    deadline = time.monotonic() + 60
    while set(_writers_of_this_process()) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    (early,) = set(_writers_of_this_process()) - before
    assert ssd.writer_handle() is None  # (not taken: no write-back has needed it yet)
    ssd.write_pending({"a": (np.arange(6, 16), np.ones((10, 5), np.float32))}, durable=False)
    ssd.wait_writes()
    assert ssd.writer_handle().pid == early and ssd.failed_write is None
    s.close()

    s = _store(tmp_path / "t", True)
    s.engine.ssd.write_pending({"a": (np.arange(6), np.ones((6, 5), np.float32))}, durable=False)
    deadline = time.monotonic() + 60
    while set(_writers_of_this_process()) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    (early,) = set(_writers_of_this_process()) - before
    s.close()
    assert not _alive(early)


def test_a_store_dropped_without_close_ends_its_writer(tmp_path):
    import gc

    s = _store(tmp_path / "s", True)
    _steps(s, None, 12)
    s.engine.ssd.wait_writes()
    proc = s.engine.ssd.writer_handle()
    del s
    gc.collect()
    assert proc.returncode is not None  # reaped, its pipes closed (no ResourceWarning: they are errors here)


def test_a_fork_does_not_keep_the_writer_alive(tmp_path):
    """A process forked from the trainer (a data loader's workers) inherits the writer's
    pipe; it is pointed at /dev/null there, so close() ends the writer at once."""
    s = _store(tmp_path / "s", True)
    _steps(s, None, 12)
    s.engine.ssd.wait_writes()
    proc = s.engine.ssd.writer_handle()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: wait until told to go
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 3 and proc.returncode == 0  # it quit, not killed after a wait
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def test_ctrl_c_is_the_trainers_not_the_writers(tmp_path):
    """The writer runs in a session of its own and ignores SIGINT: a Ctrl-C (sent to the
    terminal's process group) or a signal to the job's group is the trainer's to handle."""
    s = _store(tmp_path / "s", True)
    _steps(s, None, 12)
    s.engine.ssd.wait_writes()
    proc = s.engine.ssd.writer_handle()
    assert os.getpgid(proc.pid) != os.getpgid(0)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None
    _steps(s, None, 12, seed=1)
    s.engine.ssd.wait_writes()
    assert s.engine.ssd.failed_write is None and s.engine.ssd.writer_handle() is proc
    s.close()


def test_a_dead_writer_does_not_kill_a_trainer_with_default_sigpipe(tmp_path):
    """A trainer that restored SIGPIPE's default action (a common CLI idiom) gets the typed
    error when its writer has died, not a SIGPIPE that kills it; nor does close() after
    its writer died (its quit frame goes into a dead pipe)."""
    import subprocess

    script = f"""
import os, signal, numpy as np
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
from tiered_emb import TableConfig, TieredStore, TierConfig, SGD
from tiered_emb.errors import CorruptStoreError
s = TieredStore.create({str(tmp_path / "s")!r}, [TableConfig("a", dim=4, optimizer=SGD(lr=0.5))],
                       TierConfig(hbm_rows=4, ddr_rows=4, device="cpu"), seed=1)
s.engine.ssd.writeback_rows = 8
rng = np.random.default_rng(0)
def steps(n):
    raised = 0
    for _ in range(n):
        try:
            s.apply_gradients("a", rng.integers(0, 1000, 16), np.ones((16, 4), np.float32))
        except CorruptStoreError:
            raised += 1
    return raised
def kill_writer():
    s.engine.ssd.wait_writes()
    p = s.engine.ssd.writer_handle()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
steps(10)
kill_writer()
print("raised", steps(20), flush=True)
kill_writer()  # the new one, idle: close() tells it to quit through a dead pipe
s.close()
print("closed", flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split("\n")[:2] == ["raised 1", "closed"]


_FAULTS = r"""
import json, resource, sys
from tiered_emb.tiers.ssd.writer_main import tune_allocator
if sys.argv[1] == "on":
    assert tune_allocator(256 << 20)
counts = []
for _ in range(4):  # a transaction's worth of blocks as large as LMDB's and the segments', then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [bytearray(17 << 20) for _ in range(4)]
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del blocks
print(json.dumps(counts))
"""

_GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


@pytest.mark.skipif(not _GLIBC, reason="glibc's allocator only")
def test_a_tuned_allocator_keeps_a_large_writes_pages_for_the_next(tmp_path):
    """Four blocks of 17 MiB allocated, filled and freed, four times: glibc by default gives
    them back and faults every page in again each time (4 KiB each: about 17,400 faults);
    tuned (:func:`writer_main.tune_allocator`) only the first time."""
    import json
    import subprocess

    got = {}
    for mode in ("off", "on"):
        p = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        got[mode] = json.loads(p.stdout)
    first = 4 * (17 << 20) // 4096
    assert all(n > first // 2 for n in got["off"]), got
    assert got["on"][0] > first // 2 and max(got["on"][1:]) < first // 20, got


def test_a_store_tunes_the_allocator_only_when_asked(tmp_path, monkeypatch):
    """``TierConfig.tune_malloc``: this process's thresholds set from the budget at the
    store's first write, and the writer process told the same in its first frame; False:
    neither."""
    tuned, hellos = [], []
    monkeypatch.setattr("tiered_emb.tiers.ssd.writer.tune_allocator", lambda b: tuned.append(b) or True)
    real = codec.frame_bytes

    def frame(head):
        if "path" in head:  # (the first frame)
            hellos.append(head)
        return real(head)

    monkeypatch.setattr("tiered_emb.tiers.ssd.writer_client.frame_bytes", frame)
    for tune in (False, True):
        _store(tmp_path / str(tune), True, tune_malloc=tune, budget_bytes=64 << 20).close()
        tuned.clear()
        tiers = TierConfig(hbm_rows=8, ddr_rows=8, device="cpu", tune_malloc=tune, budget_bytes=64 << 20)
        s = TieredStore.open(tmp_path / str(tune), tiers)
        assert tuned == []  # (an open writes nothing: it leaves the allocator alone)
        s.engine.ssd.writeback_rows = 16
        _steps(s, ReferenceStore(TABLES, seed=2), 30)
        s.engine.ssd.wait_writes()
        assert s.engine.ssd.writer_handle() is not None
        s.close(checkpoint=False)
    assert tuned == [16 << 20]  # (a quarter of the budget)
    assert [h["malloc_trim"] for h in hellos] == [0, 16 << 20]


def test_the_writer_process_tunes_its_allocator_as_told(tmp_path, monkeypatch):
    path, hello = _env_for_writer(tmp_path)
    told = []
    monkeypatch.setattr(writer_main, "tune_allocator", lambda b: told.append(b) or True)
    _serve(monkeypatch, hello, parent=777, ppids=[777] * 10)
    head = {"path": str(path), "map_size": 1 << 24, "max_dbs": 4, "max_readers": 64, "compression": None}
    _serve(monkeypatch, codec.frame_bytes(dict(head, dbs=["p:a"], malloc_trim=1 << 28)), parent=777, ppids=[777] * 10)
    assert told == [1 << 28]


@pytest.mark.parametrize("shared_max", [1 << 22, 64, 0])
def test_segments_reach_the_writer_through_shared_memory_or_the_pipe(tmp_path, shared_max):
    """Segments encoded here go through the region both processes map when they fit it
    (4 MiB), down the pipe when they do not (64 bytes) or where there is no region (0):
    the same keys and bytes in ``p:`` either way, over writes that grow the region."""
    from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv

    lmdb_env = LmdbEnv(tmp_path / "env", ["a"], 1 << 24)
    proc = WriterProcess(lmdb_env, None, ["a"], shared_max=shared_max)
    try:
        want, seq = [], 0
        for n in (3, 2000, 40_000, 5):  # segments of 100 B to 2 MiB: the region grows twice
            ids = np.arange(n, dtype=np.int64) * 3
            rows = np.random.default_rng(n).standard_normal((n, 13)).astype(np.float32)
            values = [codec.encode_segment(ids[k::2], rows[k::2], None, seq + k) for k in range(2)]
            assert proc.write([("a", seq + k, ids[k::2], v) for k, v in enumerate(values)], 1 << 24) == {"ok": True}
            want += [(codec.segment_key(seq + k), v.tobytes()) for k, v in enumerate(values)]
            seq += 2
        used, fd = proc.shared is not None, proc.shared_fd
    finally:
        proc.close()
    if fd is not None:  # close() let the region go
        with pytest.raises(OSError):
            os.fstat(fd)
    assert used == (shared_max > 64 and hasattr(os, "memfd_create"))  # (Linux: the region; elsewhere the pipe)
    with lmdb_env.env.begin() as txn:
        got = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=lmdb_env.pending["a"])]
    lmdb_env.env.close()
    assert got == want


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one Numba thread is all there is here")
def test_the_writer_thread_runs_its_kernels_on_one_thread(tmp_path, monkeypatch):
    """The writer thread cuts and encodes each write-back with Numba's kernels on itself
    alone: a parallel kernel there would start an OpenMP team of its own, whose idle
    workers spin on the cores the step is using (as the prefetch thread's would)."""
    seen = []
    cut = SegmentLog.cut

    def counted(self, *args, **kw):
        if threading.current_thread() is not threading.main_thread():
            seen.append(numba.get_num_threads())
        return cut(self, *args, **kw)

    monkeypatch.setattr(SegmentLog, "cut", counted)
    s = _store(tmp_path / "s", True)
    _steps(s, None, 12)
    s.engine.ssd.wait_writes()
    s.close()
    assert seen and set(seen) == {1}
