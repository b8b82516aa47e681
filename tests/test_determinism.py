"""Bitwise determinism across Numba thread counts (the other axes: state machine and test_prefetch)."""

import os
import subprocess
import sys

SCRIPT = r"""
import hashlib, sys, tempfile
import numpy as np
from tiered_emb import Adam, Adagrad, RowWiseAdagrad, TableConfig, TieredStore, TierConfig
from tiered_emb.sim.traces import zipf_ids
tables = [TableConfig("r", dim=64, optimizer=RowWiseAdagrad(lr=0.1)), TableConfig("a", dim=16, optimizer=Adam()),
          TableConfig("g", dim=32, optimizer=Adagrad(lr=0.1)),
          TableConfig("h", dim=24, dtype="float16", optimizer=RowWiseAdagrad(lr=0.1)),
          TableConfig("b", dim=8, dtype="bfloat16", optimizer=Adam()),
          TableConfig("q", dim=20, dtype="int8", optimizer=Adagrad(lr=0.1))]
h = hashlib.sha256()
tiers = eval(sys.argv[1])  # (the test's own expression)
with TieredStore.create(tempfile.mkdtemp() + "/s", tables, tiers, seed=11) as s:
    for step in range(6):
        for t in tables:
            ids = zipf_ids(50_000, 1.05, 20_000, seed=step * 7 + t.dim)
            rows = s.lookup(t.name, ids)
            s.apply_gradients(t.name, ids, np.sin(rows * np.float32(3.0)) + np.float32(0.01 * step))
    for t in tables:
        h.update(s.peek(t.name, np.arange(50_000), with_state=True).tobytes())
print(h.hexdigest())
"""


PER_TABLE = 'TierConfig(4000, 2000, "lfu", "cpu")'
# one HBM and one DDR tier for the six tables, about as many rows in all as above in one table's
SHARED = 'TierConfig(policy="lfu", device="cpu", hbm_bytes=4000 * 400, ddr_bytes=2000 * 400)'


def _digest(threads: int, tiers: str = PER_TABLE) -> str:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", SCRIPT, tiers], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_rows_and_states_identical_for_one_and_two_threads():
    one, two = _digest(1), _digest(2)
    assert len(one) == 64 and one == two


def test_tiers_shared_by_the_tables_give_the_same_bytes_on_any_thread_count():
    assert _digest(1, SHARED) == _digest(2, SHARED) == _digest(2)


def test_signed_zero_matches_the_reference_byte_for_byte(tmp_path):
    """Duplicate ids' gradients are summed in batch order from +0.0 in the store's kernels
    and in the reference alike: a -0.0 gradient element is +0.0 once summed, and a -0.0
    weight keeps its sign under it (assert_array_equal would not see the sign; bytes do)."""
    import numpy as np

    from tiered_emb import SGD, Adagrad, Adam, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
    from tiered_emb.step.plan import plan_bags
    from tiered_emb.testing.reference import ReferenceStore

    ids = np.array([5, 6])
    rows = np.array([[-0.0, 1.0, -0.0, 2.0], [-0.0, -0.0, 3.0, 4.0]], np.float32)
    g = np.array([[-0.0, 0.5, -0.0, 0.25], [-0.0, -0.0, 0.5, 0.5]], np.float32)
    for k, opt in enumerate([SGD(0.1), Adagrad(0.1), RowWiseAdagrad(0.1), Adam()]):
        cfg = TableConfig("t", dim=4, optimizer=opt)
        ref = ReferenceStore([cfg], seed=1)
        ref.write("t", ids, rows)
        ref.apply_gradients("t", ids, g)
        with TieredStore.create(tmp_path / f"s{k}", [cfg], TierConfig(8, 8, "lru", "cpu"), seed=1) as s:
            s.write("t", ids, rows)
            s.apply_gradients("t", ids, g)
            assert s.peek("t", ids, with_state=True).tobytes() == ref.peek_records("t", ids).tobytes(), opt.name
        with TieredStore.create(tmp_path / f"p{k}", [cfg], TierConfig(8, 8, "lru", "cpu"), seed=1) as s:
            s.write("t", ids, rows)
            plan = plan_bags(ids, np.array([0, 1, 2]))  # each id a bag of its own: the fused path
            _, fwd = s.engine.lookup_pooled("t", plan)
            s.engine.apply_pooled_gradients("t", fwd, g)
            assert s.peek("t", ids, with_state=True).tobytes() == ref.peek_records("t", ids).tobytes(), opt.name
