"""A Hypothesis state machine: tiny tiers against a dict model, every row checked after each step."""

import copy
import os
import shutil
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiered_emb import SGD, Adagrad, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.cache.policies import BASE_POLICIES
from tiered_emb.testing import crash
from tiered_emb.testing.reference import ReferenceStore
from tiered_emb.tiers.hbm import stride_of
from tiered_emb.tiers.pool import slot_floats

TABLES = [
    TableConfig("r", dim=3, optimizer=RowWiseAdagrad(lr=0.3)),
    TableConfig("s", dim=2, num_rows=12, optimizer=Adagrad(lr=0.2)),
    TableConfig("g", dim=4, optimizer=SGD(lr=0.1)),
    # narrow rows: the updates round stochastically, keyed by (seed, table, id, column, step, update)
    TableConfig("h", dim=3, dtype="float16", optimizer=RowWiseAdagrad(lr=0.3)),
    TableConfig("b", dim=2, num_rows=12, dtype="bfloat16", optimizer=Adagrad(lr=0.2)),
    TableConfig("q", dim=5, dtype="int8", optimizer=SGD(lr=0.1)),
    TableConfig("m", dim=3, optimizer=Adagrad(lr=0.2), state_dtype="bfloat16"),
]
NAMES = [t.name for t in TABLES]
ID_SPACE = 12

ids_st = st.lists(st.integers(0, ID_SPACE - 1), min_size=0, max_size=9)
HBM_SLOT, DDR_SLOT = (4 * f for f in slot_floats(TABLES))
# hbm_rows 12 holds table "s" whole (num_rows=12): its HBM is then direct, row id in slot id
tiers_st = st.builds(
    TierConfig,
    hbm_rows=st.integers(1, 5) | st.just(12),
    ddr_rows=st.integers(0, 4),
    policy=st.sampled_from(BASE_POLICIES),
    device=st.just("cpu"),
    ssd_compression=st.sampled_from([None, 1]),
    background_writes=st.booleans(),
) | st.builds(  # one HBM and one DDR tier shared by the tables, sized in bytes (not always whole slots)
    TierConfig,
    hbm_bytes=st.integers(HBM_SLOT, 12 * HBM_SLOT),
    ddr_bytes=st.integers(0, 8 * DDR_SLOT),
    policy=st.sampled_from(BASE_POLICIES),
    device=st.just("cpu"),
    background_writes=st.booleans(),
)
OWN_ROW = {t.name: (4 * stride_of(t.record_width), 4 * t.record_width) for t in TABLES if t.name in ("s", "q")}


@st.composite
def reserved_tiers_st(draw):
    """Shared tiers with bytes set apart for tables s (12 rows: whole from 12 HBM rows on) and q."""
    reserved = {
        name: (draw(st.integers(hbm, 13 * hbm)), draw(st.integers(0, 3 * ddr))) for name, (hbm, ddr) in OWN_ROW.items()
    }
    return TierConfig(
        hbm_bytes=sum(h for h, _ in reserved.values()) + draw(st.integers(HBM_SLOT, 8 * HBM_SLOT)),
        ddr_bytes=sum(d for _, d in reserved.values()) + draw(st.integers(0, 6 * DDR_SLOT)),
        reserved=reserved,
        policy=draw(st.sampled_from(BASE_POLICIES)),
        device="cpu",
    )


tiers_st = tiers_st | reserved_tiers_st()


class StoreMachine(RuleBasedStateMachine):
    @initialize(tiers=tiers_st, writeback_rows=st.sampled_from([1, 3, 1 << 16]))
    def create(self, tiers, writeback_rows):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "store")
        self.writeback_rows = writeback_rows  # evicted rows waiting in memory before an LMDB write
        self.store = self._with_writeback(TieredStore.create(self.path, TABLES, tiers, seed=5))
        self.model = ReferenceStore(TABLES, seed=5)
        self._checkpointed()

    def _checkpointed(self):
        self.checkpointed = copy.deepcopy((self.model.rows, self.model.updates))

    def _with_writeback(self, store):
        store.engine.ssd.writeback_rows = self.writeback_rows
        return store

    @rule(table=st.sampled_from(NAMES), ids=ids_st)
    def lookup(self, table, ids):
        ids = np.array(ids, dtype=np.int64)
        np.testing.assert_array_equal(self.store.lookup(table, ids), self.model.lookup(table, ids))

    @rule(table=st.sampled_from(NAMES), ids=ids_st, scale=st.floats(-2, 2, width=32))
    def write(self, table, ids, scale):
        ids = np.array(ids, dtype=np.int64)
        dim = self.model.tables[table].dim
        rows = np.arange(ids.shape[0] * dim, dtype=np.float32).reshape(-1, dim) * np.float32(scale)
        self.store.write(table, ids, rows)
        self.model.write(table, ids, rows)

    @rule(table=st.sampled_from(NAMES), ids=ids_st, seed=st.integers(0, 2**16))
    def apply_gradients(self, table, ids, seed):
        ids = np.array(ids, dtype=np.int64)
        dim = self.model.tables[table].dim
        g = np.random.default_rng(seed).standard_normal((ids.shape[0], dim)).astype(np.float32)
        self.store.apply_gradients(table, ids, g)
        self.model.apply_gradients(table, ids, g)

    @rule()
    def flush(self):
        self.store.flush()

    @rule()
    def checkpoint(self):
        self.store.checkpoint()
        self._checkpointed()

    @rule(tiers=tiers_st)
    def close_and_reopen(self, tiers):
        self.store.close()
        self.store = self._with_writeback(TieredStore.open(self.path, tiers=tiers))
        self._checkpointed()

    @rule(tiers=tiers_st)
    def crash_and_reopen(self, tiers):
        # no close(): whatever was not checkpointed is gone, the checkpoint is intact
        crash(self.store)
        self.store = self._with_writeback(TieredStore.open(self.path, tiers=tiers))
        self.model.rows, self.model.updates = copy.deepcopy(self.checkpointed)

    @invariant()
    def every_row_matches(self):
        if not hasattr(self, "store"):
            return
        ids = np.arange(ID_SPACE)
        for t in NAMES:
            np.testing.assert_array_equal(self.store.peek(t, ids, with_state=True), self.model.peek_records(t, ids))

    @invariant()
    def shared_tiers_within_their_bytes(self):
        """A shared tier's rows, every table's together, never take more than its bytes (a
        reserved table's tiers of its own within theirs, the budget for all)."""
        tiers = self.store.engine.tiers if hasattr(self, "store") else None
        if tiers is None or not tiers.shared:
            return
        stats = self.store.stats()
        for tier, budget in (("hbm", tiers.hbm_bytes), ("ddr", tiers.ddr_bytes)):
            assert sum(stats[t][tier]["bytes"] for t in NAMES) <= budget
        for name, hbm, ddr in tiers.reserved:  # (a row of its own HBM padded as the tier pads it)
            held = (stats[name][k]["rows"] * OWN_ROW[name][i] for i, k in enumerate(("hbm", "ddr")))
            assert next(held) <= hbm and next(held) <= ddr

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    settings.default, max_examples=max(200, settings.default.max_examples), stateful_step_count=30
)
