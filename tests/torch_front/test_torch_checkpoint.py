"""Saving and copying a model whose rows live in a store: torch.save / deepcopy / pickle are
refused with a typed error, state_dict() names the rows it does not hold, and
tiered_emb.torch.save / load round-trip a whole model bitwise."""

import copy
import io
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import (  # noqa: E402
    ConfigError,
    CopyError,
    RowWiseAdagrad,
    StaleRowsWarning,
    TableConfig,
    TierConfig,
    TieredStore,
)
from tiered_emb.torch import (  # noqa: E402
    TieredEmbedding,
    TieredEmbeddingBagCollection,
    TieredOptimizer,
    load,
    save,
)

DIM = 4


def _create(path):
    tables = [TableConfig(t, dim=DIM, num_rows=50, optimizer=RowWiseAdagrad(lr=0.3)) for t in ("a", "b")]
    return TieredStore.create(path, tables, TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"), seed=2)


class Net(torch.nn.Module):
    def __init__(self, store):
        super().__init__()
        self.ebc = TieredEmbeddingBagCollection(store, ["a", "b"])
        self.item = TieredEmbedding(store, "b")
        self.lin = torch.nn.Linear(3 * DIM, 1)

    def forward(self, step):
        rng = np.random.default_rng(step)
        ids = {t: torch.from_numpy(rng.integers(0, 50, 12)) for t in ("a", "b")}
        lengths = torch.full((4,), 3)
        pooled = self.ebc({t: (ids[t], lengths) for t in ("a", "b")})
        x = torch.cat([pooled["a"], pooled["b"], self.item(ids["b"][:4])], dim=1)
        return ((self.lin(x).squeeze(1) - torch.from_numpy(rng.standard_normal(4).astype(np.float32))) ** 2).mean()


def _model(store):
    net = Net(store)
    opt = TieredOptimizer(net, torch.optim.Adagrad(net.lin.parameters(), lr=0.1))
    return net, opt


def _steps(net, opt, steps):
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = net(step)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _rows(store):
    return b"".join(store.peek(t, np.arange(50), with_state=True).tobytes() for t in ("a", "b"))


def test_save_then_load_continues_bitwise(tmp_path):
    path = tmp_path / "s"
    with _create(path) as s:
        torch.manual_seed(0)
        net, opt = _model(s)
        _steps(net, opt, range(3))
        save(net, opt, extra={"step": 3})
        expected_losses = _steps(net, opt, range(3, 6))
        expected_rows, expected_lin = _rows(s), net.lin.weight.detach().clone()
        s.close(checkpoint=False)  # the store stays at the save
    with TieredStore.open(path) as s:
        torch.manual_seed(1)  # other dense weights, and no optimizer state: load must bring both
        net, opt = _model(s)
        assert load(net, opt) == {"step": 3}
        assert _steps(net, opt, range(3, 6)) == expected_losses
        assert _rows(s) == expected_rows
        assert torch.equal(net.lin.weight, expected_lin)


@pytest.mark.parametrize(
    "how",
    [lambda m: torch.save(m, io.BytesIO()), copy.deepcopy, pickle.dumps],
    ids=["torch.save", "deepcopy", "pickle"],
)
def test_torch_save_deepcopy_and_pickle_are_refused_with_a_hint(tmp_path, how):
    with _create(tmp_path / "s") as s:
        with pytest.raises(CopyError, match="rows live in the store") as e:
            how(Net(s))
        assert "tiered_emb.torch.save" in str(e.value) and str(tmp_path / "s") in str(e.value)
        assert isinstance(e.value, TypeError)


def test_state_dict_names_the_rows_it_does_not_hold(tmp_path):
    with _create(tmp_path / "s") as s:
        net = Net(s)
        s.checkpoint()
        state = net.state_dict()
        ref = state["item._extra_state"]
        assert ref == {"rows": "in the store", "store": str(tmp_path / "s"), "table": "b", "dim": DIM, "checkpoint": 1}
        assert state["ebc.bags.a._extra_state"]["table"] == "a"
        # a state_dict saved before it held the reference still loads, strictly
        old = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
        net.load_state_dict(old)
        swapped = dict(state, **{"item._extra_state": state["ebc.bags.a._extra_state"]})
        with pytest.raises(ConfigError, match="state_dict for table/dim"):
            net.load_state_dict(swapped)
        newer = dict(state, **{"item._extra_state": dict(ref, checkpoint=5)})
        with pytest.warns(StaleRowsWarning, match="rows are older"):
            net.load_state_dict(newer)


def test_load_errors_are_typed(tmp_path):
    with _create(tmp_path / "s") as s:
        net, _ = _model(s)
        with pytest.raises(ConfigError, match="holds no saved model"):
            load(net)
        s.checkpoint(extra=b"not a model")
        with pytest.raises(ConfigError, match="not a saved model"):
            load(net)
        with pytest.raises(ConfigError, match="holds no tiered module"):
            save(torch.nn.Linear(2, 2))
        save(net)
        with pytest.raises(ConfigError, match="no optimizer state"):
            load(net, torch.optim.SGD(net.lin.parameters(), lr=0.1))
