"""Training habits that must not train wrongly: loss scaling (GradScaler), gradient clipping,
gradient accumulation, eval() / no_grad(), DistributedDataParallel.  Each test checks the
rows (and the dense weights) against a run that is right by construction."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import (  # noqa: E402
    SGD,
    Adagrad,
    ConfigError,
    DistributedError,
    NonFiniteGradientError,
    RowWiseAdagrad,
    TableConfig,
    TierConfig,
    TieredStore,
)
from tiered_emb.torch import TieredEmbedding, TieredEmbeddingBag, TieredOptimizer  # noqa: E402

ROWS, DIM = 40, 4


def _store(tmp_path, name, optimizer=None, hbm_rows=64):
    return TieredStore.create(
        tmp_path / name,
        [TableConfig("t", dim=DIM, num_rows=ROWS, optimizer=optimizer or RowWiseAdagrad(lr=0.2))],
        TierConfig(hbm_rows=hbm_rows, ddr_rows=8, device="cpu"),
        seed=7,
    )


def _state(store) -> bytes:
    return store.peek("t", np.arange(ROWS), with_state=True).tobytes()


class Net(torch.nn.Module):
    def __init__(self, store):
        super().__init__()
        torch.manual_seed(0)
        self.emb = TieredEmbeddingBag(store, "t", mode="sum")
        self.lin = torch.nn.Linear(DIM, 1)

    def forward(self, ids, offsets):
        return self.lin(self.emb(ids, offsets)).squeeze(1)


def _batch(step):
    rng = np.random.default_rng(step)
    ids = torch.from_numpy(rng.integers(0, ROWS, 24))
    return ids, torch.arange(0, 24, 3), torch.from_numpy(rng.standard_normal(8).astype(np.float32))


def _loss(net, step):
    ids, offsets, y = _batch(step)
    return ((net(ids, offsets) - y) ** 2).mean()


def _train(store, steps, scaler=None, held=True, skip_at=None):
    """``steps`` steps of ``Net``; ``skip_at``: a step whose embedding gradient holds inf."""
    net = Net(store)
    dense = torch.optim.SGD(net.lin.parameters(), lr=0.1)
    opt = TieredOptimizer(net, dense) if held else dense
    for step in range(steps):
        opt.zero_grad()
        loss = _loss(net, step)
        if step == skip_at:
            loss = loss + (net.emb(*_batch(step)[:2]) * float("inf")).sum()
        _backward_and_step(loss, opt, scaler)
    return net


def _backward_and_step(loss, opt, scaler) -> None:
    """One step's backward and optimizer step, through ``scaler`` when there is one."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_held_updates_are_bitwise_the_fused_ones(tmp_path):
    with _store(tmp_path, "a") as fused, _store(tmp_path, "b") as held:
        net_f, net_h = _train(fused, 5, held=False), _train(held, 5)
        assert _state(fused) == _state(held)
        assert torch.equal(net_f.lin.weight, net_h.lin.weight)


def test_grad_scaler_trains_bitwise_as_without_it(tmp_path):
    """GradScaler(init_scale=1024): the rows get the unscaled gradient (a power of two divides
    exactly), so the rows and the dense weights are bitwise those of a run without scaling."""
    with _store(tmp_path, "a") as plain, _store(tmp_path, "b") as scaled:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        net_p, net_s = _train(plain, 6, held=False), _train(scaled, 6, scaler=scaler)
        assert scaler.get_scale() == 1024.0  # no step skipped
        assert _state(plain) == _state(scaled)
        assert torch.equal(net_p.lin.weight, net_s.lin.weight)


@pytest.mark.parametrize("where", ["embedding", "dense"])
def test_a_step_the_scaler_skips_leaves_the_rows_unchanged(tmp_path, where):
    """inf in the embedding gradient, or only in the dense one: the scaler skips the whole step."""
    with _store(tmp_path, "s") as s:
        net = Net(s)
        opt = TieredOptimizer(net, torch.optim.SGD(net.lin.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        _loss(net, 0).backward()
        opt.step()  # the rows of a first step, so the skipped one has rows to leave alone
        before, lin = _state(s), net.lin.weight.detach().clone()
        opt.zero_grad()
        loss = _loss(net, 1)
        if where == "embedding":
            loss = loss + (net.emb(*_batch(1)[:2]) * float("inf")).sum()
        scaler.scale(loss).backward()
        if where == "dense":
            net.lin.bias.grad.fill_(float("inf"))
        assert all(bool(p.grad.isfinite().all()) for p in net.lin.parameters()) == (where == "embedding")
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 512.0
        assert _state(s) == before and torch.equal(net.lin.weight, lin)
        opt.zero_grad()  # the skipped step's gradients are dropped; the next step trains as usual
        scaler.scale(_loss(net, 2)).backward()
        scaler.step(opt)
        assert _state(s) != before


def test_a_skipped_step_then_training_matches_a_run_that_never_saw_it(tmp_path):
    with _store(tmp_path, "a") as ref, _store(tmp_path, "b") as s:
        scaler = torch.amp.GradScaler("cpu", init_scale=2048.0, backoff_factor=0.5)
        _train(s, 5, scaler=scaler, skip_at=2)
        net = Net(ref)  # the same steps without step 2, unscaled
        dense = torch.optim.SGD(net.lin.parameters(), lr=0.1)
        for step in (0, 1, 3, 4):
            dense.zero_grad()
            _loss(net, step).backward()
            dense.step()
        assert _state(s) == _state(ref)


def test_clip_grad_norm_includes_the_embedding_gradients(tmp_path):
    """The clipped step against torch's nn.EmbeddingBag + Linear with clip_grad_norm_ over both."""
    with _store(tmp_path, "s", optimizer=SGD(0.5)) as s:
        net = Net(s)
        ref_emb = torch.nn.EmbeddingBag.from_pretrained(
            torch.from_numpy(s.peek("t", np.arange(ROWS)).copy()), freeze=False, mode="sum"
        )
        ref_lin = torch.nn.Linear(DIM, 1)
        ref_lin.load_state_dict(net.lin.state_dict())
        ref_params = [ref_emb.weight, *ref_lin.parameters()]
        ref_opt = torch.optim.SGD(ref_params, lr=0.5)
        opt = TieredOptimizer(net, torch.optim.SGD(net.lin.parameters(), lr=0.5))
        for step in range(3):
            ids, offsets, y = _batch(step)
            opt.zero_grad()
            ref_opt.zero_grad()
            (((net(ids, offsets) - y) ** 2).mean() * 50).backward()
            (((ref_lin(ref_emb(ids, offsets)).squeeze(1) - y) ** 2).mean() * 50).backward()
            norm = opt.clip_grad_norm_(1.0)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
            assert float(norm) > 1.0  # the clip acts
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
            opt.step()
            ref_opt.step()
        torch.testing.assert_close(torch.from_numpy(s.peek("t", np.arange(ROWS))), ref_emb.weight.detach())
        torch.testing.assert_close(net.lin.weight, ref_lin.weight)


def test_clip_under_a_scaler_unscales_first(tmp_path):
    with _store(tmp_path, "a") as plain, _store(tmp_path, "b") as scaled:
        for s, scaler in ((plain, None), (scaled, torch.amp.GradScaler("cpu", init_scale=4096.0))):
            net = Net(s)
            opt = TieredOptimizer(net, torch.optim.SGD(net.lin.parameters(), lr=0.1))
            loss = _loss(net, 0) * 100
            (loss if scaler is None else scaler.scale(loss)).backward()
            norm = opt.clip_grad_norm_(0.5, scaler)
            if scaler is None:
                opt.step()
                plain_norm = norm
            else:
                scaler.step(opt)
                assert torch.equal(norm, plain_norm)
        assert _state(plain) == _state(scaled)


def test_gradient_accumulation_held_is_one_step_on_the_summed_gradient(tmp_path):
    """Two micro-batches, one step: as torch's Adagrad over an nn.EmbeddingBag; the fused
    default instead takes one step per backward (as documented)."""
    with (
        _store(tmp_path, "a", optimizer=Adagrad(lr=0.1)) as s,
        _store(tmp_path, "b", optimizer=Adagrad(lr=0.1)) as fused,
    ):
        ref = torch.nn.EmbeddingBag.from_pretrained(
            torch.from_numpy(s.peek("t", np.arange(ROWS)).copy()), freeze=False, mode="sum"
        )
        ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=1e-10)
        bag = TieredEmbeddingBag(s, "t", mode="sum")
        opt = TieredOptimizer(bag)
        fused_bag = TieredEmbeddingBag(fused, "t", mode="sum")
        g = torch.linspace(-1.0, 1.0, 8 * DIM).reshape(8, DIM)
        for micro in range(2):
            ids, offsets, _ = _batch(micro)
            bag(ids, offsets).backward(g)
            ref(ids, offsets).backward(g)
            fused_bag(ids, offsets).backward(g)
            if micro == 0:
                assert _state(fused) != _state(s)  # fused: updated already; held: not yet
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(torch.from_numpy(s.peek("t", np.arange(ROWS))), ref.weight.detach())
        assert not np.allclose(fused.peek("t", np.arange(ROWS)), s.peek("t", np.arange(ROWS)))


def test_held_nonfinite_gradient_raises_at_step_and_changes_nothing(tmp_path):
    with _store(tmp_path, "s") as s:
        net = Net(s)
        opt = TieredOptimizer(net, torch.optim.SGD(net.lin.parameters(), lr=0.1))
        before, lin = _state(s), net.lin.weight.detach().clone()
        (_loss(net, 0) + (net.emb(*_batch(0)[:2]) * float("nan")).sum()).backward()
        with pytest.raises(NonFiniteGradientError):
            opt.step()
        assert _state(s) == before and torch.equal(net.lin.weight, lin)
        with pytest.raises(ConfigError, match="closure"):
            opt.step(lambda: None)
        with pytest.raises(ConfigError, match="holds no tiered module"):
            TieredOptimizer(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("module", ["bag", "embedding"])
def test_eval_and_no_grad_never_update_rows(tmp_path, module):
    with _store(tmp_path, "s", optimizer=SGD(0.5)) as s:
        mod = TieredEmbeddingBag(s, "t", mode="sum") if module == "bag" else TieredEmbedding(s, "t")
        ids = torch.tensor([1, 2, 2, 5])

        def run(weights=None):
            return mod(ids, torch.tensor([0, 2]), weights) if module == "bag" else mod(ids)

        before = _state(s)
        with torch.no_grad():
            assert not run().requires_grad
        mod.eval()
        assert not run().requires_grad
        if module == "bag":  # per_sample_weights still get their gradient in eval(), as in torch
            w = torch.ones(4, requires_grad=True)
            run(w).sum().backward()
            assert w.grad is not None and w.grad.abs().sum() > 0
        assert _state(s) == before
        mod.train()
        run().sum().backward()
        assert _state(s) != before


def test_ddp_is_refused_with_a_typed_error(tmp_path):
    """A real gloo process group (one rank): wrapping is fine, the first forward is refused."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with _store(tmp_path, "s") as s:
            ddp = torch.nn.parallel.DistributedDataParallel(Net(s))
            before = _state(s)
            with pytest.raises(DistributedError, match="DistributedDataParallel") as e:
                ddp(*_batch(0)[:2])
            assert "one process" in str(e.value)
            assert _state(s) == before
            Net(s)(*_batch(0)[:2])  # the same model unwrapped trains as usual
    finally:
        dist.destroy_process_group()


# one rank of two (gloo): a store of its own, the model in DDP; prints what its forward did
_RANK = r"""
import sys
import numpy as np, torch, torch.distributed as dist
from tiered_emb import TableConfig, TierConfig, TieredStore, DistributedError
from tiered_emb.torch import TieredEmbeddingBag
rank, where = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{where}/pg", rank=rank, world_size=2)
with TieredStore.create(f"{where}/s{rank}", [TableConfig("t", dim=4, num_rows=40)],
                        TierConfig(hbm_rows=64, device="cpu"), seed=7) as s:
    before = s.peek("t", np.arange(40), with_state=True).tobytes()
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = TieredEmbeddingBag(s, "t"), torch.nn.Linear(4, 1)
        def forward(self, ids, offsets):
            return self.lin(self.emb(ids, offsets))
    ddp = torch.nn.parallel.DistributedDataParallel(Net())
    try:
        ddp(torch.tensor([1, 2, 3]), torch.tensor([0, 1])).sum().backward()
        print("trained")
    except DistributedError as err:
        same = s.peek("t", np.arange(40), with_state=True).tobytes() == before
        print("refused", "unchanged" if same else "changed", "hint:", err.hint)
dist.destroy_process_group()
"""


def test_ddp_over_two_processes_is_refused_on_every_rank(tmp_path):
    """The trial's case: two gloo ranks, a store each, the model in DDP: every rank's forward
    raises DistributedError (rows unchanged) instead of each rank training its own rows."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert out.startswith("refused unchanged"), out
        assert "one process" in out


def test_train_pipeline_with_a_scaler_trains_as_without_it(tmp_path):
    from tiered_emb.torch import TrainPipeline

    def loss_of(net, step):
        return _loss(net, step)

    with _store(tmp_path, "a", hbm_rows=8) as plain, _store(tmp_path, "b", hbm_rows=8) as scaled:
        for s, scaler in ((plain, None), (scaled, torch.amp.GradScaler("cpu", init_scale=1024.0))):
            net = Net(s)
            dense = torch.optim.SGD(net.lin.parameters(), lr=0.1)
            opt = dense if scaler is None else TieredOptimizer(net, dense)
            pipe = TrainPipeline(
                s, net, opt, lambda step: {"t": _batch(step)[0]}, loss_of, lookahead_batches=2, scaler=scaler
            )
            list(pipe.run(range(5)))
        assert _state(plain) == _state(scaled)
        with pytest.raises(ConfigError, match="TieredOptimizer"):
            TrainPipeline(plain, net, dense, lambda b: {}, loss_of, scaler=torch.amp.GradScaler("cpu"))


def test_a_later_optimizer_takes_the_modules_over_and_release_gives_them_back(tmp_path):
    with _store(tmp_path, "s", optimizer=SGD(0.5)) as s:
        bag = TieredEmbeddingBag(s, "t", mode="sum")
        first, second = TieredOptimizer(bag), TieredOptimizer(bag)
        before = _state(s)
        bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
        first.step()  # holds nothing: the second took the module over
        assert _state(s) == before
        second.step()
        after = _state(s)
        assert after != before
        second.release()
        bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()  # fused again
        assert _state(s) != after


def test_autocast_with_a_scaler_trains_as_autocast_without_it(tmp_path):
    """Mixed precision (bfloat16 autocast on the CPU): the rows stay float32 and get the
    unscaled gradient, bitwise that of the same autocast run without loss scaling."""
    with _store(tmp_path, "a") as plain, _store(tmp_path, "b") as scaled:
        for s, scaler in ((plain, None), (scaled, torch.amp.GradScaler("cpu", init_scale=1024.0))):
            net = Net(s)
            opt = TieredOptimizer(net, torch.optim.SGD(net.lin.parameters(), lr=0.1))
            for step in range(4):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = _loss(net, step)
                _backward_and_step(loss, opt, scaler)
        assert _state(plain) == _state(scaled)
        assert s.peek("t", np.arange(ROWS)).dtype == np.float32


def test_float16_autocast_without_a_tiered_optimizer_is_refused_before_any_update(tmp_path):
    """float16 training scales its loss; a backward that updated the rows itself would apply
    the scaled gradient, so such a forward is a ConfigError that says how, and changes nothing.
    With a TieredOptimizer, or under bfloat16 (no scaling needed), it trains."""
    with _store(tmp_path, "a") as s:
        net = Net(s)
        before = _state(s)
        with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ConfigError, match="TieredOptimizer"):
            _loss(net, 0)
        assert _state(s) == before
        with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
            _loss(net, 0)  # (no update planned: nothing to scale)
        net.eval()
        with torch.autocast("cpu", dtype=torch.float16):
            _loss(net, 0)
        net.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _loss(net, 0).backward()
        assert _state(s) != before
        opt = TieredOptimizer(net, torch.optim.SGD(net.lin.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        held = _state(s)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(net, 1)
        _backward_and_step(loss, opt, scaler)
        assert _state(s) != held
