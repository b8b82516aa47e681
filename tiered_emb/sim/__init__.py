"""Cache-policy simulation: traces, policies, miss-ratio curves (standalone, no trainer).

>>> import numpy as np
>>> from tiered_emb.sim import simulate, zipf_ids
>>> trace = zipf_ids(10_000, 1.0, 100_000, seed=0)
>>> simulate(trace, 100, "lru") <= simulate(trace, 100, "belady")
True
"""

from tiered_emb.sim.engine import SIM_POLICIES, simulate
from tiered_emb.sim.mrc import MissRatioCurve, lru_curve, opt_curve
from tiered_emb.sim.policies import next_use_of, release_scratch
from tiered_emb.sim.traces import (
    drift_ids,
    read_column,
    read_criteo,
    read_npy,
    read_oracle_general,
    table_batches,
    write_npy,
    write_oracle_general,
    zipf_ids,
)

__all__ = [
    "SIM_POLICIES",
    "MissRatioCurve",
    "drift_ids",
    "lru_curve",
    "next_use_of",
    "opt_curve",
    "read_column",
    "read_criteo",
    "read_npy",
    "read_oracle_general",
    "release_scratch",
    "simulate",
    "table_batches",
    "write_npy",
    "write_oracle_general",
    "zipf_ids",
]
