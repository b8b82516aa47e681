"""No call into a Numba kernel takes Numba's slow dispatch once a store is warm.

A call of a jitted function that leaves an argument to its default (or passes a type not
seen yet) goes through ``Dispatcher._compile_for_args``, a hundred times the fast path
(docs/lab.md has what ``CacheTier.find`` cost the DLRM job).  This test runs
the store's paths (lookup, the fused and held pooled updates, prefetch and the pipeline,
admission, expiry, delete, peek, checkpoint) twice to warm them, then counts the slow
dispatches of a third round: at most two a kernel (the first call of a signature not met
yet also goes through it, once: which of the update's paths a pooled step takes depends
on when the prefetch thread pinned its rows), where a call left to a default takes it
every time.
"""

import collections

import numba.core.dispatcher as dispatcher
import numpy as np
import pytest

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore

torch = pytest.importorskip("torch")
from tiered_emb.torch import TieredEmbeddingBag, TieredOptimizer, TrainPipeline  # noqa: E402


def _round(s, bags, seed: int) -> None:
    opt = TieredOptimizer(torch.nn.ModuleList(bags))
    for step in range(4):
        rng = np.random.default_rng(seed * 10 + step)
        ids = torch.from_numpy(rng.integers(0, 400, (64, 4)))
        opt.zero_grad()
        sum(b(ids).sum() for b in bags).backward()
        opt.step()
        s.lookup("a", rng.integers(0, 2000, 300))
        s.apply_gradients("b", rng.integers(0, 500, 100), np.ones((100, 8), np.float32))
        s.delete("a", rng.integers(0, 2000, 5))
        s.peek("b", [1, 2])
    opt.release()
    batches = [torch.from_numpy(np.random.default_rng(seed * 10 + i).integers(0, 400, (64, 4))) for i in range(4)]
    pipe = TrainPipeline(
        s,
        torch.nn.ModuleList(bags),
        None,
        lambda b: {"a": b.reshape(-1).numpy(), "b": b.reshape(-1).numpy()},
        lambda m, b: m[0](b).sum() + m[1](b).sum(),
        lookahead_batches=2,
    )
    for _ in pipe.run(iter(batches)):
        pass
    s.checkpoint()


def test_a_warm_store_takes_no_slow_numba_dispatch(tmp_path, monkeypatch):
    tables = [
        TableConfig("a", 8, None, optimizer=RowWiseAdagrad(0.1), min_count=2, ttl_steps=3),
        TableConfig("b", 8, 500, optimizer=RowWiseAdagrad(0.1)),
    ]
    tiers = TierConfig(hbm_rows=256, ddr_rows=256, device="cpu", policy="lookahead+lru")
    s = TieredStore.create(tmp_path / "s", tables, tiers)
    bags = [TieredEmbeddingBag(s, "a"), TieredEmbeddingBag(s, "b")]
    _round(s, bags, 0)
    _round(s, bags, 1)
    slow = collections.Counter()
    real = dispatcher.Dispatcher._compile_for_args

    def counted(self, *args, **kwargs):
        slow[f"{self.py_func.__module__}.{self.py_func.__name__}"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(dispatcher.Dispatcher, "_compile_for_args", counted)
    _round(s, bags, 2)
    s.close()
    assert max(slow.values(), default=0) <= 2, f"slow Numba dispatches in a warm round: {dict(slow)}"
