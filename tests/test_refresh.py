"""A reader's refresh moves its index on from the snapshot before (reading only the segments
written or rewritten since) and reads exactly what a reader built from scratch would:
after plain checkpoints, after compaction below the mark, and after the writer went back
to an older checkpoint and wrote other rows under the same segment numbers."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.testing import random_updates

TABLES = [
    TableConfig("a", dim=4, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=2, num_rows=3000, optimizer=SGD(lr=0.5)),
]
IDS = 3000
REPO = Path(__file__).resolve().parents[1]

# a reader process: on each line of stdin, refresh (to the snapshot named, or the newest)
# and answer the epoch, the digest of every row of both tables and how refreshes went
READER = """
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


def _digest(store) -> str:
    h = hashlib.sha256()
    for t in ("a", "b"):
        h.update(store.peek(t, np.arange(IDS), with_state=True).tobytes())
    return h.hexdigest()


class _Reader:
    def __init__(self, path: Path):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-c", READER, str(path)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def refresh(self, snapshot: int | None = None) -> tuple[int, str, dict]:
        self.proc.stdin.write(f"{'' if snapshot is None else snapshot}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the reader process ended"
        epoch, digest, refreshes = json.loads(line)
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
    reader = _Reader(path)
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
        s.ssd.compact(["a", "b"])
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
