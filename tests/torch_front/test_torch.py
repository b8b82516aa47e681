"""The torch front end against torch.nn.EmbeddingBag / torch.nn.Embedding on the same weights,
and the fused path bitwise against the store's plain lookup + apply_gradients."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import (  # noqa: E402
    SGD,
    Adagrad,
    BackwardError,
    IdRangeError,
    NonFiniteGradientError,
    RowWiseAdagrad,
    TableConfig,
    TierConfig,
    TieredStore,
)
from tiered_emb.step.plan import plan_bags  # noqa: E402
from tiered_emb.testing.reference import pool_bags as _pool_bags  # noqa: E402
from tiered_emb.testing.reference import unpool_grads as _unpool_grads  # noqa: E402
from tiered_emb.torch import TieredEmbedding, TieredEmbeddingBag, TieredEmbeddingBagCollection  # noqa: E402

ROWS, DIM, LR = 50, 8, 0.5


def _store(tmp_path, name="s", hbm_rows=64, optimizer=None, tables=("t",)):
    cfgs = [TableConfig(t, dim=DIM, num_rows=ROWS, optimizer=optimizer or SGD(LR)) for t in tables]
    return TieredStore.create(tmp_path / name, cfgs, TierConfig(hbm_rows=hbm_rows, ddr_rows=8, device="cpu"), seed=3)


def _batch(seed, bags=6, max_len=5):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, bags)
    lengths[0] = 3  # at least one duplicate-prone bag
    ids = rng.integers(0, 12, int(lengths.sum()))  # few distinct ids: many duplicates
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return torch.from_numpy(ids), torch.from_numpy(offsets), lengths


def _torch_bag(store, mode):
    w = torch.from_numpy(store.peek("t", np.arange(ROWS)).copy())
    return torch.nn.EmbeddingBag.from_pretrained(w, freeze=False, mode=mode)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_bag_forward_and_update_match_torch(tmp_path, mode, weighted):
    if weighted and mode == "mean":
        pytest.skip("torch allows per_sample_weights only with mode='sum'")
    store = _store(tmp_path)
    ref = _torch_bag(store, mode)
    ours = TieredEmbeddingBag(store, "t", mode=mode)
    ids, offsets, _ = _batch(0)
    psw = torch.linspace(0.5, 2.0, ids.shape[0]) if weighted else None
    psw_ref = psw.clone().requires_grad_() if weighted else None
    psw_ours = psw.clone().requires_grad_() if weighted else None
    out_ref = ref(ids, offsets, per_sample_weights=psw_ref)
    out = ours(ids, offsets, per_sample_weights=psw_ours)
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-7)
    grad = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
    out_ref.backward(grad)
    out.backward(grad)
    with torch.no_grad():
        expected = ref.weight - LR * ref.weight.grad
    torch.testing.assert_close(torch.from_numpy(store.peek("t", np.arange(ROWS))), expected, rtol=1e-6, atol=1e-7)
    if weighted:
        torch.testing.assert_close(psw_ours.grad, psw_ref.grad, rtol=1e-6, atol=1e-6)
    store.close()


def test_bag_2d_input_and_include_last_offset(tmp_path):
    store = _store(tmp_path)
    ref = _torch_bag(store, "sum")
    x = torch.tensor([[1, 2, 2], [4, 1, 0]])
    with torch.no_grad():
        torch.testing.assert_close(TieredEmbeddingBag(store, "t", mode="sum")(x), ref(x), rtol=1e-6, atol=1e-7)
        bag = TieredEmbeddingBag(store, "t", mode="mean", include_last_offset=True)
        ids, offs = torch.tensor([3, 4, 5, 6]), torch.tensor([0, 1, 1, 4])
        ref_m = torch.nn.EmbeddingBag.from_pretrained(ref.weight, mode="mean", include_last_offset=True)
        torch.testing.assert_close(bag(ids, offs), ref_m(ids, offs), rtol=1e-6, atol=1e-7)
    store.close()


def test_embedding_matches_torch(tmp_path):
    store = _store(tmp_path, optimizer=Adagrad(lr=0.1))
    w = torch.from_numpy(store.peek("t", np.arange(ROWS)).copy())
    ref = torch.nn.Embedding.from_pretrained(w, freeze=False)
    opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=1e-10)
    ours = TieredEmbedding(store, "t")
    x = torch.tensor([[3, 7, 3], [9, 3, 0]])
    out, out_ref = ours(x), ref(x)
    assert out.shape == (2, 3, DIM)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    g = torch.linspace(-2.0, 2.0, out.numel()).reshape(out.shape)
    out.backward(g)
    out_ref.backward(g)
    opt.step()
    torch.testing.assert_close(
        torch.from_numpy(store.peek("t", np.arange(ROWS))), ref.weight.detach(), rtol=1e-6, atol=1e-7
    )
    store.close()


# 64: the whole table (50 rows) in a direct HBM; 20: an HBM with an index and a policy;
# 3: more unique ids than HBM holds (spill path)
@pytest.mark.parametrize("hbm_rows", [64, 20, 3])
def test_fused_path_is_bitwise_the_plain_path(tmp_path, hbm_rows):
    fused = _store(tmp_path, "a", hbm_rows=hbm_rows, optimizer=RowWiseAdagrad(lr=0.3))
    plain = _store(tmp_path, "b", hbm_rows=hbm_rows, optimizer=RowWiseAdagrad(lr=0.3))
    for step in range(4):
        ids, offsets, _ = _batch(step, bags=9)
        ids = ids.numpy()
        off = np.concatenate([offsets.numpy(), [ids.shape[0]]])
        w = np.linspace(0.1, 1.0, ids.shape[0]).astype(np.float32)
        for mean, weights in ((False, w), (True, None)):
            plan = plan_bags(ids, off, weights, mean)
            out, fwd = fused.engine.lookup_pooled("t", plan)
            rows = plain.lookup("t", ids)
            ref = np.empty_like(out)
            use_w = weights is not None
            wk = weights if use_w else np.empty(0, np.float32)
            _pool_bags(rows, off, wk, use_w, mean, ref)
            assert out.tobytes() == ref.tobytes()
            grad_out = np.sin(np.arange(out.size, dtype=np.float32) + step).reshape(out.shape)
            fused.engine.apply_pooled_gradients("t", fwd, grad_out)
            unpooled = np.empty((ids.shape[0], DIM), np.float32)
            _unpool_grads(grad_out, off, wk, use_w, mean, unpooled)
            plain.apply_gradients("t", ids, unpooled)
    all_ids = np.arange(ROWS)
    assert fused.peek("t", all_ids, with_state=True).tobytes() == plain.peek("t", all_ids, with_state=True).tobytes()
    fused.close()
    plain.close()


@pytest.mark.parametrize("hbm_rows", [64, 20, 3])
def test_inference_forward_is_bitwise_the_plain_path(tmp_path, hbm_rows):
    """No-grad forward (a direct HBM reads rows by id without deduping) against lookup + pool."""
    ours = _store(tmp_path, "a", hbm_rows=hbm_rows, optimizer=RowWiseAdagrad(lr=0.3))
    plain = _store(tmp_path, "b", hbm_rows=hbm_rows, optimizer=RowWiseAdagrad(lr=0.3))
    assert getattr(ours.engine.table("t").hbm, "direct", False) == (hbm_rows >= ROWS)
    bag = TieredEmbeddingBag(ours, "t", mode="mean")
    for step in range(3):
        ids, offsets, _ = _batch(step, bags=9)
        if step == 2:
            ids[0] = ROWS - 1  # a row never read before: the direct path must bring it up first
        with torch.no_grad():
            out = bag(ids, offsets).numpy()
        off = np.concatenate([offsets.numpy(), [ids.shape[0]]])
        ref = np.empty_like(out)
        _pool_bags(plain.lookup("t", ids.numpy()), off, np.empty(0, np.float32), False, True, ref)
        assert out.tobytes() == ref.tobytes()
        ids_, offs_, _ = _batch(10 + step, bags=9)  # training between inference steps
        bag(ids_, offs_).sum().backward()
        TieredEmbeddingBag(plain, "t", mode="mean")(ids_, offs_).sum().backward()
    all_ids = np.arange(ROWS)
    assert ours.peek("t", all_ids, with_state=True).tobytes() == plain.peek("t", all_ids, with_state=True).tobytes()
    ids, offsets, _ = _batch(0, bags=9)  # all its rows in HBM by now, unless HBM holds fewer (3)
    before = ours.stats()["t"]["hbm"]
    with torch.no_grad():
        bag(ids, offsets)
    after = ours.stats()["t"]["hbm"]
    # the direct path counts every position as an HBM lookup and a hit; the others each unique id
    expected = ids.shape[0] if hbm_rows >= ROWS else np.unique(ids.numpy()).shape[0]
    assert after["lookups"] - before["lookups"] == expected
    if hbm_rows >= expected:
        assert after["hits"] - before["hits"] == expected
    with torch.no_grad(), pytest.raises(IdRangeError):
        bag(torch.tensor([1, ROWS]), torch.tensor([0]))
    ours.close()
    plain.close()


def test_direct_hbm_reads_rows_written_under_a_smaller_hbm(tmp_path):
    """Rows that went down to DDR / LMDB under a small HBM come back into a direct one on reopen."""
    path = tmp_path / "s"
    cfg = TableConfig("t", dim=DIM, num_rows=ROWS, optimizer=RowWiseAdagrad(lr=0.3))
    with TieredStore.create(path, [cfg], TierConfig(hbm_rows=4, ddr_rows=4, device="cpu"), seed=3) as s:
        bag = TieredEmbeddingBag(s, "t", mode="sum")
        for step in range(4):
            ids, offsets, _ = _batch(step, bags=9)
            bag(ids, offsets).sum().backward()
        expected = s.peek("t", np.arange(ROWS), with_state=True)
        s.checkpoint()
    with TieredStore.open(path, tiers=TierConfig(hbm_rows=ROWS, device="cpu")) as s:
        assert s.engine.table("t").hbm.direct
        ids = torch.arange(ROWS)
        with torch.no_grad():
            out = TieredEmbedding(s, "t")(ids).numpy()
        assert out.tobytes() == np.ascontiguousarray(expected[:, :DIM]).tobytes()
        assert s.peek("t", np.arange(ROWS), with_state=True).tobytes() == expected.tobytes()
        assert s.stats()["t"]["hbm"]["rows"] == ROWS


def test_collection_dict_input(tmp_path):
    store = _store(tmp_path, tables=("a", "b"))
    ebc = TieredEmbeddingBagCollection(store, {"fa": "a", "fb": "b"})
    feats = {
        "fa": (torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1])),
        "fb": (torch.tensor([4, 4]), torch.tensor([1, 0, 1])),
    }
    out = ebc(feats)
    assert list(out) == ["fa", "fb"] and out["fa"].shape == (3, DIM) and out["fb"].shape == (3, DIM)
    rows_a = store.peek("a", np.array([1, 2, 3]))
    np.testing.assert_array_equal(out["fa"].detach().numpy()[0], rows_a[0] + rows_a[1])
    assert not out["fa"].detach().numpy()[1].any()
    before = store.peek("b", np.array([4]))
    (out["fa"].sum() + out["fb"].sum()).backward()
    np.testing.assert_allclose(store.peek("b", np.array([4])), before - LR * 2, rtol=1e-6)
    with pytest.raises(ValueError):
        ebc({"fa": feats["fa"]})
    store.close()


def test_collection_keyed_jagged_tensor(tmp_path):
    kjt_mod = pytest.importorskip("torchrec.sparse.jagged_tensor")
    store = _store(tmp_path, tables=("a", "b"))
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"])
    kjt = kjt_mod.KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 1, 1])
    )
    out = ebc(kjt)
    assert out["a"].shape == (2, DIM) and out["b"].shape == (2, DIM)
    store.close()


def test_no_grad_reads_only_and_nonfinite_changes_nothing(tmp_path):
    store = _store(tmp_path)
    bag = TieredEmbeddingBag(store, "t", mode="sum")
    ids, offsets, _ = _batch(1)
    before = store.peek("t", np.arange(ROWS), with_state=True)
    with torch.no_grad():
        out = bag(ids, offsets)
    assert not out.requires_grad
    out = bag(ids, offsets)
    with pytest.raises(NonFiniteGradientError):
        (out * float("nan")).sum().backward()
    assert store.peek("t", np.arange(ROWS), with_state=True).tobytes() == before.tobytes()
    store.close()


def test_dense_parameters_keep_their_torch_optimizer(tmp_path):
    store = _store(tmp_path)
    bag = TieredEmbeddingBag(store, "t", mode="sum")
    lin = torch.nn.Linear(DIM, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    assert list(bag.parameters()) == []  # rows are not torch parameters
    ids, offsets, _ = _batch(2)
    before = lin.weight.detach().clone()
    lin(bag(ids, offsets)).sum().backward()
    opt.step()
    assert not torch.equal(before, lin.weight.detach())
    store.close()


def test_2d_input_per_sample_weights_grad_has_their_shape(tmp_path):
    # was: grad_w returned flat (n,) for (B, L) weights -> autograd error in backward
    store = _store(tmp_path)
    ref = _torch_bag(store, "sum")
    x = torch.tensor([[1, 2, 2], [3, 4, 1]])
    w = torch.linspace(0.5, 2.0, 6).reshape(2, 3).requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    grad = torch.linspace(-1.0, 1.0, 2 * DIM).reshape(2, DIM)
    TieredEmbeddingBag(store, "t", mode="sum")(x, per_sample_weights=w).backward(grad)
    ref(x, per_sample_weights=w_ref).backward(grad)
    assert w.grad.shape == (2, 3)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    store.close()


def _all_rows(store):
    return store.peek("t", np.arange(ROWS), with_state=True).tobytes()


@pytest.mark.parametrize("which", ["ids", "offsets", "weights"])
def test_meta_device_inputs_are_a_device_error(tmp_path, which):
    from tiered_emb.errors import DeviceError

    store = _store(tmp_path)
    ids, off, w = torch.tensor([1, 2, 3]), torch.tensor([0, 2]), torch.ones(3)
    if which == "ids":
        ids = ids.to("meta")
    elif which == "offsets":
        off = off.to("meta")
    else:
        w = w.to("meta")
    before = _all_rows(store)
    with pytest.raises(DeviceError, match="'meta' device"):
        TieredEmbeddingBag(store, "t", mode="sum")(ids, off, w)
    with pytest.raises(DeviceError, match="'meta' device"):
        TieredEmbedding(store, "t")(torch.tensor([1, 2], device="meta"))
    assert _all_rows(store) == before
    store.close()


@pytest.mark.parametrize("w", [np.array([1.0, 2.0, 3.0], np.float32), [1.0, 2.0, 3.0]], ids=["numpy", "list"])
def test_per_sample_weights_must_be_a_tensor(tmp_path, w):
    from tiered_emb.errors import ConfigError

    store = _store(tmp_path)
    with pytest.raises(ConfigError, match="per_sample_weights of type"):
        TieredEmbeddingBag(store, "t", mode="sum")(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), w)
    store.close()


@pytest.mark.parametrize(
    "x, w",
    [
        (torch.tensor([1, 2, 3]), torch.ones(3, 1)),
        (torch.tensor([[1, 2], [3, 4]]), torch.ones(4)),
        (torch.tensor([1, 2, 3]), torch.ones(2)),
        (torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.complex64)),
    ],
    ids=["3x1-for-3", "flat-for-2d", "too-few", "complex"],
)
def test_per_sample_weights_of_another_shape_or_dtype_are_refused(tmp_path, x, w):
    # torch.nn.EmbeddingBag wants per_sample_weights of exactly the input's shape
    from tiered_emb.errors import ConfigError

    store = _store(tmp_path)
    off = torch.tensor([0, 2]) if x.ndim == 1 else None
    with pytest.raises(ConfigError, match="per_sample_weights have"):
        TieredEmbeddingBag(store, "t", mode="sum")(x, off, w)
    store.close()


def test_collection_2d_lengths_or_values_are_an_id_type_error_and_read_nothing(tmp_path):
    from tiered_emb.errors import IdTypeError

    store = _store(tmp_path, tables=("a", "b"))
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"])
    good = (torch.tensor([1, 2]), torch.tensor([1, 1]))
    before = store.stats()
    with pytest.raises(IdTypeError, match="lengths of feature 'b' have shape"):
        ebc({"a": good, "b": (torch.tensor([1, 2, 3]), torch.tensor([[1, 2]]))})
    with pytest.raises(IdTypeError, match="values of feature 'b' have shape"):
        ebc({"a": good, "b": (torch.tensor([[1, 2]]), torch.tensor([2]))})
    assert store.stats() == before  # feature 'a' was not read either
    store.close()


@pytest.mark.parametrize("as_tensor", [False, True])
def test_uint64_ids_beyond_int64_are_reported_as_such(tmp_path, as_tensor):
    # was: cast to int64 first, so 2**64-1 arrived as -1 and was "id -1 ... is negative"
    store = _store(tmp_path)
    ids = np.array([3, 2**64 - 1], dtype=np.uint64)
    ids = torch.from_numpy(ids) if as_tensor else ids
    with pytest.raises(IdRangeError, match="18446744073709551615, beyond int64") as e:
        TieredEmbedding(store, "t")(ids)
    assert "-1" not in str(e.value)
    # uint64 ids within int64 are fine
    out = TieredEmbedding(store, "t")(np.array([3, 4], dtype=np.uint64))
    np.testing.assert_array_equal(out.detach().numpy(), store.peek("t", np.array([3, 4])))
    store.close()


def test_second_backward_through_one_output_is_a_typed_error(tmp_path):
    from tiered_emb.errors import BackwardError

    with TieredStore.create(
        tmp_path / "s",
        [TableConfig("t", dim=4, num_rows=20, optimizer=SGD(0.5))],
        TierConfig(hbm_rows=32, device="cpu"),
        seed=1,
    ) as s:
        out = TieredEmbeddingBag(s, "t", mode="sum")(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
        out.sum().backward(retain_graph=True)
        once = s.peek("t", np.arange(20))
        with pytest.raises(BackwardError, match="second backward"):
            (2 * out).sum().backward()
        np.testing.assert_array_equal(s.peek("t", np.arange(20)), once)


@pytest.mark.parametrize("what", ["per_sample_weights", "offsets", "ids"])
def test_inputs_changed_in_place_after_forward_do_not_change_the_update(tmp_path, what):
    with TieredStore.create(
        tmp_path / "s",
        [TableConfig("t", dim=4, num_rows=20, optimizer=SGD(0.5))],
        TierConfig(hbm_rows=32, device="cpu"),
        seed=1,
    ) as s:
        w0 = s.peek("t", np.arange(20)).copy()
        bag = TieredEmbeddingBag(s, "t", mode="sum", include_last_offset=True)
        ids, off, psw = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 4]), torch.ones(4)
        out = bag(ids, off, per_sample_weights=psw)
        {
            "per_sample_weights": lambda: psw.mul_(100.0),
            "offsets": lambda: off.copy_(torch.tensor([0, 0, 4])),
            "ids": lambda: ids.copy_(torch.tensor([9, 9, 9, 9])),
        }[what]()
        out.backward(torch.stack([torch.ones(4), 3 * torch.ones(4)]))
        delta = s.peek("t", np.arange(20)) - w0
    np.testing.assert_allclose(delta[[1, 2, 3, 4], 0], [-0.5, -0.5, -1.5, -1.5], rtol=1e-6)
    assert not delta[9].any()


def test_embedding_of_a_scalar_index_has_the_shape_of_torchs(tmp_path):
    with _store(tmp_path) as s:
        emb = TieredEmbedding(s, "t")
        assert emb(torch.tensor(3)).shape == torch.nn.Embedding(10, emb.embedding_dim)(torch.tensor(3)).shape
        assert emb(torch.tensor([[3]])).shape == (1, 1, emb.embedding_dim)


def test_features_sharing_a_table_get_one_update_on_their_summed_gradient(tmp_path):
    """Two features of one table: one optimizer step per row on the summed gradient (as
    torchrec), byte for byte the store's own apply_gradients of the two bags' rows."""
    tables = [TableConfig("t", dim=4, num_rows=20, optimizer=Adagrad(lr=0.1))]
    v1, l1, v2, l2 = torch.tensor([1, 2, 3]), torch.tensor([2, 1]), torch.tensor([3, 1]), torch.tensor([1, 1])
    g1 = torch.linspace(-1, 1, 8).reshape(2, 4)
    g2 = torch.linspace(0.5, 2, 8).reshape(2, 4)
    with (
        TieredStore.create(tmp_path / "a", tables, TierConfig(32, device="cpu"), seed=1) as s,
        TieredStore.create(tmp_path / "b", tables, TierConfig(32, device="cpu"), seed=1) as ref,
    ):
        out = TieredEmbeddingBagCollection(s, {"f1": "t", "f2": "t"})({"f1": (v1, l1), "f2": (v2, l2)})
        assert out["f1"].shape == (2, 4) and out["f2"].shape == (2, 4)
        ((out["f1"] * g1).sum() + (out["f2"] * g2).sum()).backward()
        # by hand: each id's gradient is its bag's; one apply over both features' ids in order
        ids = np.array([1, 2, 3, 3, 1])
        grads = np.stack([g1[0], g1[0], g1[1], g2[0], g2[1]]).astype(np.float32)
        ref.apply_gradients("t", ids, grads)
        assert (
            s.peek("t", np.arange(20), with_state=True).tobytes()
            == ref.peek("t", np.arange(20), with_state=True).tobytes()
        )


@pytest.mark.parametrize(
    "bad_b, err",
    [
        ((torch.tensor([1, 2, 3]), torch.tensor([1, 1])), "IdTypeError"),
        ((torch.tensor([1, 99]), torch.tensor([1, 1])), "IdRangeError"),
    ],
)
def test_collection_checks_every_feature_before_reading_any(tmp_path, bad_b, err):
    import tiered_emb.errors as errors

    with TieredStore.create(
        tmp_path / "s",
        [TableConfig("a", dim=4, num_rows=50), TableConfig("b", dim=4, num_rows=50)],
        TierConfig(hbm_rows=8, ddr_rows=8, device="cpu"),
    ) as s:
        ebc = TieredEmbeddingBagCollection(s, ["a", "b"])
        before = s.stats()
        with pytest.raises(getattr(errors, err)):
            ebc({"a": (torch.tensor([1, 2]), torch.tensor([1, 1])), "b": bad_b})
        assert s.stats() == before


@pytest.mark.parametrize("bad", ["a", "b"])
@pytest.mark.parametrize("module", ["bags", "rows"])
def test_nonfinite_in_one_table_updates_no_table(tmp_path, bad, module):
    """A backward whose gradient for one table holds NaN raises and updates *no* table:
    the step is all or nothing, so skipping the batch leaves every table as it was."""
    store = _store(tmp_path, tables=("a", "b"))
    ids, offsets, _ = _batch(4)
    if module == "bags":
        mods = {t: TieredEmbeddingBag(store, t, mode="sum") for t in ("a", "b")}
        outs = {t: m(ids, offsets) for t, m in mods.items()}
    else:
        mods = {t: TieredEmbedding(store, t) for t in ("a", "b")}
        outs = {t: m(ids) for t, m in mods.items()}
    before = {t: store.peek(t, np.arange(ROWS), with_state=True).tobytes() for t in ("a", "b")}
    loss = sum((outs[t] * (float("nan") if t == bad else 1.0)).sum() for t in ("a", "b"))
    with pytest.raises(NonFiniteGradientError):
        loss.backward(retain_graph=True)
    for t in ("a", "b"):
        assert store.peek(t, np.arange(ROWS), with_state=True).tobytes() == before[t], t
    # nothing was applied, so the same outputs may be backpropagated again: one update each,
    # the same bytes as a store that only ever saw the finite pass
    sum(o.sum() for o in outs.values()).backward()
    ref = _store(tmp_path, name="ref", tables=("a", "b"))
    ref_mods = {
        t: TieredEmbeddingBag(ref, t, mode="sum") if module == "bags" else TieredEmbedding(ref, t) for t in ("a", "b")
    }
    sum((m(ids, offsets) if module == "bags" else m(ids)).sum() for m in ref_mods.values()).backward()
    for t in ("a", "b"):
        got = store.peek(t, np.arange(ROWS), with_state=True).tobytes()
        assert got != before[t] and got == ref.peek(t, np.arange(ROWS), with_state=True).tobytes(), t
    with pytest.raises(BackwardError):
        outs["a"].sum().backward()
    store.close()
    ref.close()


def test_a_failed_write_back_pending_before_a_backward_stops_it_before_any_table_changes(tmp_path):
    """A forward's evictions leave a failed write-back (a full disk) pending; the backward
    through two tables raises it from its checks, so neither table changes, and the retry
    updates both once (before, the first queued update was applied, then the second raised)."""
    from tiered_emb.errors import StoreFullError
    from tiered_emb.testing import full_disk_for

    tables = [TableConfig(t, dim=2, num_rows=100, optimizer=SGD(0.5)) for t in ("a", "b")]
    s = TieredStore.create(
        tmp_path / "s", tables, TierConfig(hbm_rows=4, ddr_rows=0, device="cpu", background_writes=False), seed=1
    )
    s.engine.ssd.writeback_rows = 1
    emb_a, emb_b = TieredEmbedding(s, "a"), TieredEmbedding(s, "b")
    emb_b(torch.arange(4)).sum().backward()  # b's rows 0..3 dirty in HBM
    full_disk_for(s, writes=1)
    out_a = emb_a(torch.arange(6))  # more ids than HBM: the spill path
    out_b = emb_b(torch.tensor([4, 5]))  # evicts dirty rows of b: their write-back fails, kept
    before = {t: s.peek(t, np.arange(10), with_state=True).tobytes() for t in ("a", "b")}
    with pytest.raises(StoreFullError):
        (out_a.sum() + out_b.sum()).backward(retain_graph=True)
    for t in ("a", "b"):
        assert s.peek(t, np.arange(10), with_state=True).tobytes() == before[t], t
    (out_a.sum() + out_b.sum()).backward()
    for t in ("a", "b"):
        assert s.peek(t, np.arange(10), with_state=True).tobytes() != before[t], t
    s.close()


def test_a_weighted_bag_can_be_backpropagated_again_after_a_pass_that_raised(tmp_path):
    """The rows a weighted bag's weight gradient is made from were dropped in its backward,
    before the update ran: after a pass that raised, the retry failed inside np.einsum."""
    ids, off = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])

    def run(store, psw):
        out_b = TieredEmbeddingBag(store, "b", mode="sum")(ids, off)  # b first: autograd visits a's backward first
        out_a = TieredEmbeddingBag(store, "a", mode="sum")(ids, off, per_sample_weights=psw)
        return lambda scale: (out_a.sum() + scale * out_b.sum()).backward(retain_graph=True)

    s, ref = _store(tmp_path, tables=("a", "b")), _store(tmp_path, name="ref", tables=("a", "b"))
    psw = torch.linspace(0.5, 2.0, 4).requires_grad_()
    backward = run(s, psw)
    before = s.peek("a", np.arange(ROWS), with_state=True).tobytes()
    with pytest.raises(NonFiniteGradientError):
        backward(float("nan"))
    assert s.peek("a", np.arange(ROWS), with_state=True).tobytes() == before
    psw.grad = None
    backward(1.0)
    psw_ref = psw.detach().clone().requires_grad_()
    run(ref, psw_ref)(1.0)
    for t in ("a", "b"):
        assert (
            s.peek(t, np.arange(ROWS), with_state=True).tobytes()
            == ref.peek(t, np.arange(ROWS), with_state=True).tobytes()
        )
    torch.testing.assert_close(psw.grad, psw_ref.grad)
    s.close()
    ref.close()


def test_joined_features_make_their_weights_of_one_on_the_given_weights_device():
    """Features of one table joined, one with per-sample weights on a device (CUDA; ``meta``
    stands in for it here) and one without: its weights of 1 were made on the host, and
    torch.cat of the two raised.  They are made beside the given ones."""
    from tiered_emb.torch.modules import joined

    a = (np.array([1, 2, 3]), np.array([0, 2, 3]), torch.ones(3, device="meta"))
    b = (np.array([4, 5]), np.array([0, 1, 2]), None)
    ids, offsets, weights = joined([a, b])
    assert ids.tolist() == [1, 2, 3, 4, 5] and offsets.tolist() == [0, 2, 3, 4, 5]
    assert weights.device.type == "meta" and weights.shape == (5,)
