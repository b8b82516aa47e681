"""The window's record of a batch's pins (one kernel) against the masks it stands for."""

import numpy as np
import pytest

from tiered_emb.prefetch.window import pins_recorded


@pytest.mark.parametrize("n", [0, 1, 2, 7, 300])
def test_a_batchs_pins_leave_its_list_and_land_in_its_slots(n):
    """``aligned[todo[at]] = slots``, and ``todo`` / ``uids`` keep the entries not in ``at``,
    in their order: as the NumPy masks the kernel replaced, for any subset ``at``."""
    rng = np.random.default_rng(n)
    for _ in range(20):
        todo = rng.permutation(max(2 * n, 1))[:n].astype(np.int64)
        uids = rng.integers(0, 1 << 40, n, dtype=np.int64)
        at = np.sort(rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False)).astype(np.int64)
        slots = rng.integers(0, 1 << 20, at.shape[0], dtype=np.int64)
        aligned = np.full(max(2 * n, 1), -1, dtype=np.int64)
        want = aligned.copy()
        want[todo[at]] = slots
        rest = np.ones(n, dtype=bool)
        rest[at] = False

        left_todo, left_uids = pins_recorded(todo, uids, at, slots, aligned)

        assert aligned.tolist() == want.tolist()
        assert left_todo.tolist() == todo[rest].tolist()
        assert left_uids.tolist() == uids[rest].tolist()
