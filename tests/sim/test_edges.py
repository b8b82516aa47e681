"""Arguments at the edges that once hung, crashed (SIGSEGV) or raised untyped errors.

The cases that could hang or crash run in a child interpreter with a time limit, so a
regression fails one test instead of stopping the suite."""

import subprocess
import sys

import numpy as np
import pytest

from tiered_emb.errors import ConfigError
from tiered_emb.sim import lru_curve, opt_curve
from tiered_emb.sim import policies as P
from tiered_emb.sim.lookahead import batch_uniques, store_hits, window_belady_hits
from tiered_emb.testing import sim_reference as ref

TRACE = np.array([1, 2, 1, 3, 1, 2, 4, 2, 5, 1], dtype=np.int64)


def _in_child(code: str, timeout: float = 60.0) -> str:
    """stdout of ``code`` run by a fresh interpreter; fails on a hang, a crash or an error."""
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s")
    assert p.returncode == 0, f"exit {p.returncode} (-11: SIGSEGV): {p.stderr[-600:]}"
    return p.stdout.strip()


@pytest.mark.parametrize(
    "index,small,ghost",
    [("hash", 0.1, -1.0), ("dense", 0.1, float("nan")), ("dense", 1.5, 0.9), ("hash", float("inf"), 0.9)],
)
def test_s3fifo_ratios_out_of_range_are_config_errors(index, small, ghost):
    """A negative ghost ratio sized the hash index below the residents (an endless probe);
    a small queue above 1 left the main queue negative (a pop of an empty ring)."""
    out = _in_child(f"""
import numpy as np
from tiered_emb.errors import ConfigError
from tiered_emb.sim import policies as P
try:
    P.s3fifo_hits((np.arange(400) % 37).astype(np.int64), 30, np.zeros(0, np.uint8), index={index!r},
                  small_ratio=float("{small}"), ghost_ratio=float("{ghost}"))
except ConfigError:
    print("ConfigError")
""")
    assert out == "ConfigError"


@pytest.mark.parametrize("small,ghost", [(0.0, 0.0), (1.0, 0.0), (0.5, 3.0)])
def test_s3fifo_ratios_at_the_bounds_match_the_reference(small, ghost):
    tr = (np.arange(400) % 37).astype(np.int64)
    got = P.s3fifo_hits(tr, 30, np.zeros(0, np.uint8), small_ratio=small, ghost_ratio=ghost)
    assert got == sum(ref.s3fifo(tr.tolist(), 30, small, ghost))


@pytest.mark.parametrize("batch_size", [2**40, 2**62])
def test_a_batch_larger_than_the_trace_is_one_batch(batch_size):
    """Its scratch was allocated at batch_size entries: MemoryError / ValueError."""
    u, off = batch_uniques(TRACE, batch_size)
    u1, off1 = batch_uniques(TRACE, TRACE.shape[0])
    assert u.tolist() == u1.tolist() and off.tolist() == off1.tolist()


def test_windows_past_the_trace_are_the_whole_trace():
    """window near 2**63 overflowed ``t + window`` in the windowed Belady (SIGSEGV), and the
    store's lookahead looped once per window batch (2**40: hours).  Any window from the
    number of batches on sees the same."""
    out = _in_child("""
import numpy as np
from tiered_emb.sim.lookahead import batch_uniques, store_hits, window_belady_hits
u, off = batch_uniques(np.array([1, 2, 1, 3, 1, 2, 4, 2, 5, 1]), 2)
nb = off.shape[0] - 1
print(window_belady_hits(u, off, 3, 2**63 - 1) == window_belady_hits(u, off, 3, nb),
      store_hits(u, off, 4, "lookahead+lru", 2**40) == store_hits(u, off, 4, "lookahead+lru", nb),
      store_hits(u, off, 4, "lookahead+lfu", 2**40, load_ahead=2**39)
      == store_hits(u, off, 4, "lookahead+lfu", nb, load_ahead=nb))
""")
    assert out == "True True True"


def test_window_belady_and_store_hits_agree_for_windows_from_the_batch_count_on():
    u, off = batch_uniques(TRACE, 2)
    nb = off.shape[0] - 1
    for w in (nb, nb + 1, 50):
        assert window_belady_hits(u, off, 3, w) == window_belady_hits(u, off, 3, nb)
        assert store_hits(u, off, 4, "lookahead+lru", w) == store_hits(u, off, 4, "lookahead+lru", nb)


def test_uint64_sizes_past_int64_are_huge_not_negative():
    tr = np.array([1, 2, 1, 3, 1, 2])
    c = lru_curve(tr)
    assert c.at(np.array([2**63 + 5], dtype=np.uint64)).tolist() == [int(c.hits[-1])]
    oc = opt_curve(tr, np.array([1, 2**63 + 5], dtype=np.uint64))
    assert oc.hits[-1] == tr.shape[0] - oc.distinct_ids
    with pytest.raises(ConfigError, match="negative"):
        c.at(np.array([-1]))
