"""Learning-rate schedules: ``store.set_learning_rate``, the rate in every checkpoint, and torch's
``lr_scheduler`` driving the rows through :class:`~tiered_emb.torch.TieredOptimizer`.

- the rows under a schedule equal, bitwise, the reference store stepped with the same rates,
  and torch.optim's dense rows within float rounding;
- each checkpoint keeps the rates: reopen, ``open(snapshot=n)`` and readers see that
  checkpoint's; a run killed with SIGKILL mid-schedule resumes bitwise;
- bad rates are typed errors that change nothing.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tiered_emb import (
    SGD,
    Adagrad,
    Adam,
    ConfigError,
    RowWiseAdagrad,
    TableConfig,
    TierConfig,
    TieredStore,
    UnknownTableError,
)
from tiered_emb.errors import ReadOnlyError, StoreClosedError
from tiered_emb.testing.reference import ReferenceStore

ROWS, DIM = 30, 4
REPO = Path(__file__).resolve().parents[2]


def _store(path, opt=None, keep=1, tables=("t",)):
    opt = opt or RowWiseAdagrad(lr=0.1)
    cfgs = [TableConfig(n, DIM, ROWS, optimizer=opt) for n in tables]
    tiers = TierConfig(hbm_rows=6, ddr_rows=4, device="cpu", keep_checkpoints=keep)
    return TieredStore.create(path, cfgs, tiers, seed=3), cfgs


def _batch(step: int):
    rng = np.random.default_rng(step)
    ids = rng.integers(0, ROWS, 24)
    return ids, rng.normal(0.0, 1.0, (24, DIM)).astype(np.float32)


def test_a_new_rate_applies_from_the_next_update_as_in_the_reference(tmp_path):
    store, cfgs = _store(tmp_path / "s", Adam(lr=0.01, weight_decay=0.1, weight_decay_mode="decoupled"))
    ref = ReferenceStore(cfgs, seed=3)
    for step, lr in enumerate([0.01, 0.02, 0.0, 0.005]):
        store.set_learning_rate("t", lr)
        ref.set_learning_rate("t", lr)
        store.apply_gradients("t", *_batch(step))
        ref.apply_gradients("t", *_batch(step))
    ids = np.arange(ROWS)
    assert store.peek("t", ids, with_state=True).tobytes() == ref.peek_records("t", ids).tobytes()
    assert store.engine.table_config("t").optimizer.lr == 0.005
    store.close()


def test_none_sets_every_table(tmp_path):
    store, _ = _store(tmp_path / "s", tables=("a", "b"))
    store.set_learning_rate(None, 0.25)
    assert [c.optimizer.lr for c in store.tables.values()] == [0.25, 0.25]
    store.close()


@pytest.mark.parametrize("lr", [float("nan"), -0.1, float("inf"), "0.1", True, None, 1e39])
def test_a_bad_rate_is_a_config_error_and_changes_nothing(tmp_path, lr):
    store, _ = _store(tmp_path / "s", tables=("a", "b"))
    with pytest.raises(ConfigError, match="lr="):
        store.set_learning_rate(None, lr)
    assert [c.optimizer.lr for c in store.tables.values()] == [0.1, 0.1]
    store.close()


def test_a_rate_decoupled_decay_cannot_take_is_refused_for_every_table(tmp_path):
    store, _ = _store(tmp_path / "s", SGD(lr=0.1, weight_decay=0.5, weight_decay_mode="decoupled"), tables=("a", "b"))
    with pytest.raises(ConfigError, match="1 - lr \\* weight_decay"):
        store.set_learning_rate(None, 2.0)
    assert [c.optimizer.lr for c in store.tables.values()] == [0.1, 0.1]
    store.close()


def test_unknown_tables_closed_stores_and_readers_refuse(tmp_path):
    store, _ = _store(tmp_path / "s")
    with pytest.raises(UnknownTableError):
        store.set_learning_rate("nope", 0.1)
    store.close()
    with pytest.raises(StoreClosedError):
        store.set_learning_rate("t", 0.1)
    with TieredStore.open(tmp_path / "s", mode="r") as reader, pytest.raises(ReadOnlyError):
        reader.set_learning_rate("t", 0.1)


def test_each_checkpoint_keeps_its_rates(tmp_path):
    path = tmp_path / "s"
    store, _ = _store(path, keep=8, tables=("a", "b"))
    epochs = {}
    for lr in (0.5, 0.25, 0.125):
        store.set_learning_rate("a", lr)
        store.apply_gradients("a", *_batch(0))
        epochs[store.checkpoint()] = lr
    store.set_learning_rate("a", 9.0)  # after the last checkpoint: given up with the rows
    store.close(checkpoint=False)
    with TieredStore.open(path) as s:
        assert s.engine.table_config("a").optimizer.lr == 0.125
        assert s.engine.table_config("b").optimizer.lr == 0.1
    with TieredStore.open(path, mode="r") as r:
        assert r.tables["a"].optimizer.lr == 0.125
        first = min(epochs)
        r.refresh(first)
        assert r.table_config("a").optimizer.lr == epochs[first]
    with TieredStore.open(path, snapshot=first) as s:
        assert s.engine.table_config("a").optimizer.lr == epochs[first]
    with TieredStore.open(path) as s:  # the run restarted from there
        assert s.engine.table_config("a").optimizer.lr == epochs[first]


# ------------------------------------------------------------------ torch's schedulers
torch = pytest.importorskip("torch")
from tiered_emb.torch import TieredEmbeddingBag, TieredOptimizer  # noqa: E402

SCHEDULES = {
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=0.001),
    "warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
        ],
        milestones=[2],
    ),
}


def _bags(step: int):
    """Eight bags of ids (offsets) and the gradient of their pooled output."""
    rng = np.random.default_rng(100 + step)
    lengths = rng.integers(1, 4, 8)
    ids = rng.integers(0, ROWS, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return ids, offsets, lengths, rng.normal(0.0, 1.0, (8, DIM)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_torch_scheduler_drives_the_rows_as_the_reference(tmp_path, name):
    """The scheduler's rate on the table's group reaches each step's update, bitwise."""
    store, cfgs = _store(tmp_path / "s", RowWiseAdagrad(lr=0.2, weight_decay=0.05))
    ref = ReferenceStore(cfgs, seed=3)
    bag = TieredEmbeddingBag(store, "t", mode="sum")
    dense = torch.nn.Linear(DIM, 1)
    opt = TieredOptimizer(torch.nn.ModuleList([bag, dense]), torch.optim.SGD(dense.parameters(), lr=0.2))
    schedule = SCHEDULES[name](opt)
    seen = []
    for step in range(6):
        ids, offsets, lengths, grad = _bags(step)
        opt.zero_grad()
        bag(torch.from_numpy(ids), torch.from_numpy(offsets)).backward(torch.from_numpy(grad))
        lr = opt.param_groups[-1]["lr"]
        assert opt.param_groups[0]["lr"] == lr  # the dense group follows the same schedule
        seen.append(lr)
        opt.step()
        schedule.step()
        ref.set_learning_rate("t", lr)
        ref.apply_gradients("t", ids, np.repeat(grad, lengths, axis=0))
    assert len(set(seen)) > 2  # the schedule moved the rate
    all_ids = np.arange(ROWS)
    assert store.peek("t", all_ids, with_state=True).tobytes() == ref.peek_records("t", all_ids).tobytes()
    store.close()


def test_warmup_then_cosine_equals_torch_optim_on_dense_rows(tmp_path):
    """Every row touched every step: Adagrad with L2 decay under SequentialLR as torch.optim.Adagrad."""
    store, _ = _store(tmp_path / "s", Adagrad(lr=0.1, eps=1e-10, weight_decay=0.01))
    ids = np.arange(ROWS)
    w = torch.nn.Parameter(torch.from_numpy(store.peek("t", ids).copy()))
    theirs = torch.optim.Adagrad([w], lr=0.1, eps=1e-10, weight_decay=0.01)
    bag = TieredEmbeddingBag(store, "t", mode="sum")
    ours = TieredOptimizer(bag)
    schedules = [SCHEDULES["sequential"](o) for o in (ours, theirs)]
    rng = np.random.default_rng(0)
    for _ in range(6):
        g = torch.from_numpy(rng.normal(0.0, 1.0, (ROWS, DIM)).astype(np.float32))
        ours.zero_grad()
        bag(torch.from_numpy(ids), torch.from_numpy(ids)).backward(g)  # one row a bag
        w.grad = g
        ours.step()
        theirs.step()
        for s in schedules:
            s.step()
    np.testing.assert_allclose(store.peek("t", ids), w.detach().numpy(), rtol=1e-6, atol=1e-7)
    store.close()


def test_a_bad_rate_from_a_schedule_is_refused_at_step_with_nothing_changed(tmp_path):
    store, _ = _store(tmp_path / "s")
    bag = TieredEmbeddingBag(store, "t")
    opt = TieredOptimizer(bag)
    ids, offsets, _, grad = _bags(0)
    bag(torch.from_numpy(ids), torch.from_numpy(offsets)).backward(torch.from_numpy(grad))
    before = store.peek("t", np.arange(ROWS), with_state=True)
    opt.param_groups[-1]["lr"] = float("nan")
    with pytest.raises(ConfigError, match="lr=nan"):
        opt.step()
    assert store.peek("t", np.arange(ROWS), with_state=True).tobytes() == before.tobytes()
    assert store.engine.table_config("t").optimizer.lr == 0.1
    store.close()


def test_the_optimizer_state_keeps_the_table_rates(tmp_path):
    store, _ = _store(tmp_path / "s", tables=("a", "b"))
    model = torch.nn.ModuleList([TieredEmbeddingBag(store, "a"), TieredEmbeddingBag(store, "b")])
    opt = TieredOptimizer(model)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()  # (nothing held: no row changes)
    schedule.step()
    state = opt.state_dict()
    assert [(g["table"], g["lr"]) for g in state["tables"]] == [("a", 0.05), ("b", 0.05)]
    again = TieredOptimizer(model)
    torch.optim.lr_scheduler.StepLR(again, step_size=1, gamma=0.5)
    again.load_state_dict(state)
    assert [g["lr"] for g in again.param_groups] == [0.05, 0.05]
    with pytest.raises(ConfigError, match="same model"):
        TieredOptimizer(model[0]).load_state_dict(state)
    store.close()


# ------------------------------------------------------------------ kill -9 mid-schedule
_RUN = textwrap.dedent(
    """
    import io, os, signal, sys
    import numpy as np, torch
    from tiered_emb import TieredStore, TableConfig, TierConfig, RowWiseAdagrad
    from tiered_emb.torch import TieredEmbeddingBag, TieredOptimizer

    path, kill_at, steps = sys.argv[1], int(sys.argv[2]), 9
    if os.path.exists(path):
        store = TieredStore.open(path)
    else:
        cfg = TableConfig("t", 4, 30, optimizer=RowWiseAdagrad(lr=0.2, weight_decay=0.05))
        store = TieredStore.create(path, [cfg], TierConfig(6, 4, device="cpu"), seed=3)
    torch.manual_seed(0)
    bag, dense = TieredEmbeddingBag(store, "t"), torch.nn.Linear(4, 1)
    opt = TieredOptimizer(torch.nn.ModuleList([bag, dense]), torch.optim.SGD(dense.parameters(), lr=0.2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.8**s)
    start = 0
    if store.extra is not None:
        saved = torch.load(io.BytesIO(store.extra))
        start = saved["step"]
        dense.load_state_dict(saved["dense"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
    for step in range(start, steps):
        rng = np.random.default_rng(step)
        ids = torch.from_numpy(rng.integers(0, 30, 16))
        offsets = torch.arange(0, 16, 2)
        opt.zero_grad()
        dense(bag(ids, offsets)).sum().backward()
        opt.step()
        sched.step()
        if step % 3 == 2:
            buf = io.BytesIO()
            state = {"step": step + 1, "dense": dense.state_dict(), "opt": opt.state_dict()}
            torch.save(dict(state, sched=sched.state_dict()), buf)
            store.checkpoint(extra=buf.getvalue())
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    store.close()
    """
)


def _run(tmp_path, path, kill_at: int) -> int:
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(script), str(path), str(kill_at)], env=env, capture_output=True)
    return done.returncode


def test_a_run_killed_mid_schedule_resumes_bitwise(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert _run(tmp_path, whole, -1) == 0
    assert _run(tmp_path, killed, 4) == -signal.SIGKILL  # after step 4: steps 3-4 are given up
    assert _run(tmp_path, killed, -1) == 0  # resumed from the checkpoint after step 2
    with TieredStore.open(whole, mode="r") as a, TieredStore.open(killed, mode="r") as b:
        ids = np.arange(30)
        assert a.peek("t", ids, with_state=True).tobytes() == b.peek("t", ids, with_state=True).tobytes()
        assert a.table_config("t").optimizer.lr == b.table_config("t").optimizer.lr
    assert os.path.exists(killed)
