"""torch.compile(model, fullgraph=True) over tiered modules: one graph around the embedding
calls (custom ops with fake and autograd implementations), and the same outputs, rows and
dense weights as the eager model."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore  # noqa: E402
from tiered_emb.torch import TieredEmbedding, TieredEmbeddingBag, TieredOptimizer  # noqa: E402

DIM = 4


class Net(torch.nn.Module):
    def __init__(self, store):
        super().__init__()
        torch.manual_seed(0)
        self.mean = TieredEmbeddingBag(store, "a", mode="mean", padding_idx=0)
        self.weighted = TieredEmbeddingBag(store, "b", mode="sum", include_last_offset=True)
        self.item = TieredEmbedding(store, "b")
        self.lin = torch.nn.Linear(3 * DIM, 1)

    def forward(self, ids, offsets, psw):
        x = torch.cat([self.mean(ids, offsets[:-1]), self.weighted(ids, offsets, psw), self.item(ids[:4])], dim=1)
        return torch.sigmoid(self.lin(x)).sum()


def _create(path):
    tables = [TableConfig(t, dim=DIM, num_rows=30, optimizer=RowWiseAdagrad(lr=0.3)) for t in ("a", "b")]
    return TieredStore.create(path, tables, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"), seed=4)


def _batch(step):
    rng = np.random.default_rng(step)
    ids = torch.from_numpy(rng.integers(0, 30, 12))  # id 0 (padding for "a") among them
    return ids, torch.tensor([0, 3, 3, 7, 12]), torch.from_numpy(rng.random(12).astype(np.float32)).requires_grad_()


def _rows(store):
    return b"".join(store.peek(t, np.arange(30), with_state=True).tobytes() for t in ("a", "b"))


# torch's inductor itself calls torch.jit.script_method, which torch deprecates
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("held", [False, True], ids=["fused", "held"])
def test_compiled_model_is_one_graph_and_trains_as_eager(tmp_path, held):
    with _create(tmp_path / "eager") as s_eager, _create(tmp_path / "compiled") as s_comp:
        eager, net = Net(s_eager), Net(s_comp)
        compiled = torch.compile(net, fullgraph=True)  # fullgraph: a graph break would raise
        opts = [
            TieredOptimizer(m, torch.optim.SGD(m.lin.parameters(), lr=0.1))
            if held
            else torch.optim.SGD(m.lin.parameters(), lr=0.1)
            for m in (eager, net)
        ]
        for step in range(3):
            outs, grads = [], []
            for model, opt in zip((eager, compiled), opts, strict=True):
                ids, offsets, psw = _batch(step)
                opt.zero_grad()
                out = model(ids, offsets, psw)
                out.backward()
                opt.step()
                outs.append(out.detach())
                grads.append(psw.grad)
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)
        # the same rows updated with the same row gradients (the dense kernels may round apart)
        a, b = (np.frombuffer(_rows(s), np.float32) for s in (s_eager, s_comp))
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(net.lin.weight, eager.lin.weight, rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # inference compiles too, and reads without planning an update
            before = _rows(s_comp)
            compiled(*_batch(9))
            assert _rows(s_comp) == before


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_float16_autocast_refusal_is_the_typed_error(tmp_path, backend):
    """Under torch.compile(fullgraph=True) the float16-autocast refusal was raised while Dynamo
    traced, and reached the caller as Dynamo's ``Unsupported`` (it cannot trace the error's
    constructor), its message and hint lost.  The op checks when it runs, with the autocast
    read while tracing (inductor's graph runs its ops with autocast off): a ConfigError."""
    from tiered_emb import ConfigError

    class Bag(torch.nn.Module):
        def __init__(self, store):
            super().__init__()
            self.emb = TieredEmbeddingBag(store, "a", mode="sum")

        def forward(self, ids, offsets):
            return self.emb(ids, offsets).sum()

    with _create(tmp_path / "s") as s:
        compiled = torch.compile(Bag(s), backend=backend, fullgraph=True)
        ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
        compiled(ids, offsets).backward()
        before = _rows(s)
        with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ConfigError, match="TieredOptimizer"):
            compiled(ids, offsets)
        assert _rows(s) == before
        with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
            compiled(ids, offsets)  # (no update planned: nothing to refuse)
