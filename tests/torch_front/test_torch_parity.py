"""torch.nn.EmbeddingBag / torch.nn.Embedding parity: ``mode="max"``, ``padding_idx``,
``from_pretrained``, ``num_embeddings``, ``weight`` and the default mode, each against torch's
own module on the same rows (outputs, ``per_sample_weights`` gradients, and the rows after
the same optimizer's step)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import SGD, Adagrad, ConfigError, TableConfig, TierConfig, TieredStore  # noqa: E402
from tiered_emb.torch import TieredEmbedding, TieredEmbeddingBag  # noqa: E402

ROWS, DIM, LR = 30, 6, 0.5


@pytest.fixture
def store(tmp_path):
    s = TieredStore.create(
        tmp_path / "s",
        [TableConfig("t", dim=DIM, num_rows=ROWS, optimizer=SGD(LR))],
        TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"),
        seed=5,
    )
    yield s
    s.close()


def _adagrad_store(tmp_path):
    return TieredStore.create(
        tmp_path / "a",
        [TableConfig("t", dim=DIM, num_rows=ROWS, optimizer=Adagrad(lr=0.1))],
        TierConfig(hbm_rows=64, device="cpu"),
        seed=5,
    )


def _rows(store):
    return torch.from_numpy(store.peek("t", np.arange(ROWS)).copy())


# ids with duplicates inside a bag, the padding id 4 in some bags, a bag of padding only, an empty bag
IDS = torch.tensor([1, 4, 2, 1, 7, 4, 4, 9, 3, 9, 1])
OFFSETS = torch.tensor([0, 3, 5, 7, 7])


def _check_step(store, ours, ref, ids, offsets, psw=None, pad=None):
    """Forward and one SGD step of ``ours`` against ``ref`` (torch's module on the same rows)."""
    psw_ours = None if psw is None else psw.clone().requires_grad_()
    psw_ref = None if psw is None else psw.clone().requires_grad_()
    out, out_ref = ours(ids, offsets, psw_ours), ref(ids, offsets, per_sample_weights=psw_ref)
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-7)
    g = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)
    before = _rows(store)
    out.backward(g)
    out_ref.backward(g)
    with torch.no_grad():
        expected = ref.weight - LR * ref.weight.grad
    torch.testing.assert_close(_rows(store), expected, rtol=1e-6, atol=1e-7)
    if pad is not None:
        assert torch.equal(_rows(store)[pad], before[pad])  # never updated
    if psw is not None:
        torch.testing.assert_close(psw_ours.grad, psw_ref.grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the step torch's module would take, for the next call
        ref.weight.copy_(expected)
    ref.weight.grad = None


def test_max_mode_matches_torch(store):
    ref = torch.nn.EmbeddingBag.from_pretrained(_rows(store), freeze=False, mode="max")
    _check_step(store, TieredEmbeddingBag(store, "t", mode="max"), ref, IDS, OFFSETS)


def test_max_mode_2d_input_and_include_last_offset(store):
    ref = torch.nn.EmbeddingBag.from_pretrained(_rows(store), freeze=False, mode="max", include_last_offset=True)
    ours = TieredEmbeddingBag(store, "t", mode="max", include_last_offset=True)
    _check_step(store, ours, ref, IDS, torch.cat([OFFSETS, torch.tensor([IDS.shape[0]])]))
    x = torch.tensor([[3, 3, 5], [0, 8, 2]])
    with torch.no_grad():
        torch.testing.assert_close(TieredEmbeddingBag(store, "t", mode="max")(x), _rows(store)[x].amax(dim=1))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padding_idx_matches_torch(store, mode):
    """The padding id is left out of each bag (the mean's count too), gets no gradient, and
    its row never changes."""
    ref = torch.nn.EmbeddingBag.from_pretrained(_rows(store), freeze=False, mode=mode, padding_idx=4)
    ours = TieredEmbeddingBag(store, "t", mode=mode, padding_idx=4)
    _check_step(store, ours, ref, IDS, OFFSETS, pad=4)


def test_padding_idx_with_per_sample_weights_and_2d_input(store):
    ref = torch.nn.EmbeddingBag.from_pretrained(_rows(store), freeze=False, mode="sum", padding_idx=4)
    ours = TieredEmbeddingBag(store, "t", mode="sum", padding_idx=-26)  # -26 is id 4 of 30, as in torch
    assert ours.padding_idx == 4
    _check_step(store, ours, ref, IDS, OFFSETS, psw=torch.linspace(0.5, 1.5, IDS.shape[0]), pad=4)
    x = torch.tensor([[4, 2, 4], [4, 4, 4], [6, 1, 6]])
    _check_step(store, ours, ref, x, None, psw=torch.linspace(-1.0, 1.0, 9).reshape(3, 3), pad=4)


@pytest.mark.parametrize("padding_idx", [30, -31, 1.5, True])
def test_padding_idx_out_of_range_is_a_config_error(store, padding_idx):
    with pytest.raises(ConfigError, match="padding_idx"):
        TieredEmbeddingBag(store, "t", padding_idx=padding_idx)


def test_embedding_padding_idx_matches_torch(tmp_path):
    """nn.Embedding's padding row is read as it is and never updated (here by Adagrad)."""
    with _adagrad_store(tmp_path) as s:
        ref = torch.nn.Embedding.from_pretrained(_rows(s), freeze=False, padding_idx=3)
        opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=1e-10)
        ours = TieredEmbedding(s, "t", padding_idx=3)
        x = torch.tensor([[3, 7, 3], [9, 3, 0]])
        out, out_ref = ours(x), ref(x)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        g = torch.linspace(-2.0, 2.0, out.numel()).reshape(out.shape)
        out.backward(g)
        out_ref.backward(g)
        opt.step()
        torch.testing.assert_close(_rows(s), ref.weight.detach(), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(s.peek("t", np.array([3]), with_state=True)[0, DIM:], 0.0)  # no state either


@pytest.mark.parametrize("freeze", [True, False])
def test_from_pretrained_writes_the_rows_and_freezes_as_torch(store, freeze):
    w = torch.linspace(-1.0, 1.0, 12 * DIM).reshape(12, DIM)
    ours = TieredEmbeddingBag.from_pretrained(w, store, "t", freeze=freeze)
    ref = torch.nn.EmbeddingBag.from_pretrained(w, freeze=freeze)  # mode "mean", as ours
    assert ours.mode == ref.mode == "mean" and ours.freeze == freeze
    np.testing.assert_array_equal(store.peek("t", np.arange(12)), w.numpy())
    ids, offsets = torch.tensor([1, 2, 11, 5]), torch.tensor([0, 2])
    out = ours(ids, offsets)
    torch.testing.assert_close(out, ref(ids, offsets), rtol=0, atol=0)
    assert out.requires_grad != freeze  # as torch's: a frozen table's output needs no backward
    if not freeze:
        out.sum().backward()
    changed = not np.array_equal(store.peek("t", np.arange(12)), w.numpy())
    assert changed != freeze
    with pytest.raises(ConfigError, match="embeddings of shape"):
        TieredEmbeddingBag.from_pretrained(torch.ones(DIM), store, "t")


def test_embedding_from_pretrained(store):
    w = torch.arange(5 * DIM, dtype=torch.float32).reshape(5, DIM)
    emb = TieredEmbedding.from_pretrained(w, store, "t")
    torch.testing.assert_close(emb(torch.tensor([4, 0])), w[[4, 0]], rtol=0, atol=0)


def test_num_embeddings_weight_and_default_mode_as_torch(store, tmp_path):
    bag = TieredEmbeddingBag(store, "t")
    assert bag.mode == torch.nn.EmbeddingBag(3, 2).mode == "mean"
    assert bag.num_embeddings == ROWS and bag.embedding_dim == DIM
    w = bag.weight
    assert w.shape == (ROWS, DIM) and torch.equal(w, _rows(store))
    with pytest.raises(RuntimeError, match="inference tensor"):
        torch.nn.init.zeros_(w)  # a copy: writing into it must not pass for writing the table
    with TieredStore.create(tmp_path / "u", [TableConfig("u", dim=4)], TierConfig(8, device="cpu")) as s:
        big = TieredEmbeddingBag(s, "u")
        assert big.num_embeddings is None
        with pytest.raises(ConfigError, match="too large to read whole"):
            _ = big.weight


def test_embedding_padding_row_goes_to_the_device_of_the_rows(store, monkeypatch):
    """With a GPU store the looked-up rows are a CUDA tensor; the padding row was read to the
    host and joined to them as it was (torch.cat of a CUDA and a CPU tensor raises).  Rows on
    another device (``meta`` standing in for CUDA) must get the padding row there too."""
    from tiered_emb.torch import _base

    monkeypatch.setattr(_base, "as_tensor", lambda a: torch.from_numpy(a).to("meta"))
    emb = TieredEmbedding(store, "t", padding_idx=3).eval()
    with torch.no_grad():
        out = emb(torch.tensor([[1, 3], [3, 7]]))
    assert out.device.type == "meta" and out.shape == (2, 2, DIM)
