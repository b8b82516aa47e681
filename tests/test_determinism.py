"""Bitwise determinism across Numba thread counts (the other axes: state machine and test_prefetch)."""
import hashlib
import os
import subprocess
import sys

SCRIPT = r"""
import hashlib, sys, tempfile
import numpy as np
from tiered_emb import Adam, Adagrad, RowWiseAdagrad, TableConfig, TieredStore, TierConfig
from tiered_emb.sim.traces import zipf_ids
tables = [TableConfig("r", dim=64, optimizer=RowWiseAdagrad(lr=0.1)), TableConfig("a", dim=16, optimizer=Adam()),
          TableConfig("g", dim=32, optimizer=Adagrad(lr=0.1))]
h = hashlib.sha256()
with TieredStore.create(tempfile.mkdtemp() + "/s", tables, TierConfig(4000, 2000, "lfu", "cpu"), seed=11) as s:
    for step in range(6):
        for t in tables:
            ids = zipf_ids(50_000, 1.05, 20_000, seed=step * 7 + t.dim)
            rows = s.lookup(t.name, ids)
            s.apply_gradients(t.name, ids, np.sin(rows * np.float32(3.0)) + np.float32(0.01 * step))
    for t in tables:
        h.update(s.peek(t.name, np.arange(50_000), with_state=True).tobytes())
print(h.hexdigest())
"""


def _digest(threads: int) -> str:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_rows_and_states_identical_for_one_and_two_threads():
    one, two = _digest(1), _digest(2)
    assert len(one) == 64 and one == two
