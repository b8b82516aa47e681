"""The TorchRec drop-in against TorchRec's own EmbeddingBagCollection on the same weights, and
TorchRec's DLRM trained over it against the built-in DLRM job."""

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tiered_emb import (  # noqa: E402
    SGD,
    Adagrad,
    ConfigError,
    RowWiseAdagrad,
    TableConfig,
    TierConfig,
    TieredStore,
    Uniform,
    UnknownTableError,
)
from tiered_emb import torchrec as tiered_rec  # noqa: E402
from tiered_emb.apps.clicks import NUM_CATS, SyntheticClicks  # noqa: E402
from tiered_emb.apps.dlrm import build_model  # noqa: E402
from tiered_emb.cli import main  # noqa: E402
from tiered_emb.torchrec import TieredEmbeddingBagCollection, table_configs  # noqa: E402

if tiered_rec.HAS_TORCHREC:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import DataType
    from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad as TorchRecRowWiseAdagrad

    from tiered_emb.apps.torchrec_dlrm import build_torchrec_model, builtin_pairs, copy_builtin_weights

needs_torchrec = pytest.mark.skipif(not tiered_rec.HAS_TORCHREC, reason=tiered_rec.INSTALL)
ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_torchrec_tests():
    """CI installs torchrec (.ci/run): there the tests below must run, not skip."""
    if not tiered_rec.HAS_TORCHREC:
        if os.environ.get("CI"):
            pytest.fail(f"torchrec cannot be imported in CI: {tiered_rec.TORCHREC_ERROR}")
        pytest.skip(tiered_rec.INSTALL)


def test_without_torchrec_the_module_imports_and_building_says_how_to_install(tmp_path):
    code = f"""
import sys
sys.modules["torchrec"] = None  # as if not installed: importing it raises ImportError
import tiered_emb.torchrec as tr
from tiered_emb import MissingExtraError, TieredStore, TableConfig, TierConfig
from tiered_emb.cli import main
assert not tr.HAS_TORCHREC
with TieredStore.create({str(tmp_path / "s")!r}, [TableConfig("t", 4)], TierConfig(16, device="cpu")) as s:
    try:
        tr.TieredEmbeddingBagCollection(s, ["t"])
    except MissingExtraError as err:
        assert "--no-deps torchrec" in str(err), err
    else:
        raise SystemExit("no MissingExtraError")
try:
    main(["train", "--model", "torchrec", "--run-dir", {str(tmp_path / "run")!r}])
except MissingExtraError:
    pass
else:
    raise SystemExit("train --model torchrec ran without torchrec")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def _doc_blocks():
    text = (ROOT / "docs" / "torchrec.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


@needs_torchrec
@pytest.mark.parametrize("index", range(len(_doc_blocks())))
def test_the_docs_example_trains_torchrecs_dlrm(index, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    code = _doc_blocks()[index]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"docs/torchrec.md block {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"


# ---------------------------------------------------------------------------------------------------------
# the collection against TorchRec's EmbeddingBagCollection


def _configs(pooling="SUM"):
    """t1: one feature; t2: two features sharing it (one update of each row on their summed gradient)."""
    mode = PoolingType[pooling]
    return [
        EmbeddingBagConfig(num_embeddings=50, embedding_dim=8, name="t1", feature_names=["f1"], pooling=mode),
        EmbeddingBagConfig(num_embeddings=40, embedding_dim=4, name="t2", feature_names=["f2", "f3"], pooling=mode),
    ]


def _pair(tmp_path, optimizer, pooling="SUM", hbm_rows=64, is_weighted=False):
    """Ours over a new store, and TorchRec's collection holding the same rows."""
    store = TieredStore.create(
        tmp_path / "s", table_configs(_configs(pooling), optimizer), TierConfig(hbm_rows, ddr_rows=8, device="cpu")
    )
    ours = TieredEmbeddingBagCollection(store, _configs(pooling), is_weighted=is_weighted)
    ref = EmbeddingBagCollection(_configs(pooling), is_weighted=is_weighted)
    with torch.no_grad():
        for cfg in ref.embedding_bag_configs():
            rows = store.peek(cfg.name, np.arange(cfg.num_embeddings))
            ref.embedding_bags[cfg.name].weight.copy_(torch.from_numpy(rows))
    return store, ours, ref


def _kjt(seed, weighted=False, bags=7):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, 3 * bags)
    values = rng.integers(0, 12, int(lengths.sum()))  # few distinct ids: duplicates within and across features
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, values.shape[0]).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2", "f3"], torch.from_numpy(values), torch.from_numpy(lengths), weights=weights
    )


def _bytes(t):
    return t.detach().numpy().tobytes()


def _rows(store, cfgs):
    return {c.name: store.peek(c.name, np.arange(c.num_embeddings), with_state=True).tobytes() for c in cfgs}


@needs_torchrec
@pytest.mark.parametrize("hbm_rows", [64, 20, 3])  # a table held whole; an index and a policy; spilling
def test_kjt_in_keyed_tensor_out_bitwise_torchrecs_and_so_is_the_sgd_step(tmp_path, hbm_rows):
    store, ours, ref = _pair(tmp_path, SGD(0.5), hbm_rows=hbm_rows)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    assert isinstance(ours, EmbeddingBagCollectionInterface) and not ours.is_weighted()
    for step in range(3):
        kjt = _kjt(step, bags=4)  # at most 16 ids a feature: see test_any_batch_is_torchrecs_bitwise
        out, out_ref = ours(kjt), ref(kjt)
        assert out.keys() == out_ref.keys() == ["f1", "f2", "f3"]
        assert out.length_per_key() == out_ref.length_per_key() == [8, 4, 4]
        assert out.values().dtype == torch.float32 and _bytes(out.values()) == _bytes(out_ref.values())
        grad = torch.sin(torch.arange(out.values().numel(), dtype=torch.float32) + step).reshape(out.values().shape)
        opt.zero_grad()
        out.values().backward(grad)
        out_ref.values().backward(grad)
        opt.step()
        rows = {c.name: store.peek(c.name, np.arange(c.num_embeddings)) for c in ref.embedding_bag_configs()}
        weights = {name: bag.weight.detach() for name, bag in ref.embedding_bags.items()}
        assert rows["t1"].tobytes() == weights["t1"].numpy().tobytes(), step
        # t2's two features: torch sums each feature's gradient of a row, then adds the two sums;
        # the store sums them in batch order, one feature after the other (to rounding the same)
        torch.testing.assert_close(torch.from_numpy(rows["t2"]), weights["t2"], rtol=1e-6, atol=1e-7)
        with torch.no_grad():  # the next step starts from the same rows again
            ref.embedding_bags["t2"].weight.copy_(torch.from_numpy(rows["t2"]))
    store.close()


@needs_torchrec
@given(
    hbm_rows=st.sampled_from([64, 20, 3]),
    bags=st.lists(st.lists(st.integers(0, 39), max_size=5), min_size=3, max_size=3 * 6).filter(
        lambda b: len(b) % 3 == 0
    ),
)
def test_any_batch_is_torchrecs_bitwise(hbm_rows, bags):
    """Any bags (empty ones, repeats, every tier size): the pooled rows bitwise, and the SGD step
    of a table of one feature too while its feature holds at most 16 ids (torch's CPU backward sorts
    the ids with a sort that permutes equal ones past 16, so it sums a row's gradients in another
    order; then, and for a table of two features, to rounding)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, ours, ref = _pair(Path(tmp), SGD(0.5), hbm_rows=hbm_rows)
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        values = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
        lengths = torch.tensor([len(bag) for bag in bags], dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], values, lengths)
        out, out_ref = ours(kjt), ref(kjt)
        assert _bytes(out.values()) == _bytes(out_ref.values())
        grad = torch.sin(torch.arange(out.values().numel(), dtype=torch.float32)).reshape(out.values().shape)
        out.values().backward(grad)
        out_ref.values().backward(grad)
        opt.step()
        rows, weight = store.peek("t1", np.arange(50)), ref.embedding_bags["t1"].weight.detach()
        if sum(len(bag) for bag in bags[: len(bags) // 3]) <= 16:
            assert rows.tobytes() == weight.numpy().tobytes()
        else:  # torch sorts the ids before it sums each row's gradients, unstably past 16 ids
            torch.testing.assert_close(torch.from_numpy(rows), weight, rtol=1e-6, atol=1e-7)
        store.close()


@needs_torchrec
def test_weighted_bags_are_torchrecs_to_rounding(tmp_path):
    """torch's CPU kernel (FBGEMM) adds ``w * row`` with a fused multiply-add, the store rounds
    the product first: the pooled rows agree to float32 rounding, as do the weights' gradients."""
    store, ours, ref = _pair(tmp_path, SGD(0.5), is_weighted=True)
    assert ours.is_weighted()
    kjt = _kjt(0, weighted=True)
    kjt_ref = KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), kjt.values(), kjt.lengths(), weights=kjt.weights().clone().requires_grad_()
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), kjt.values(), kjt.lengths(), weights=kjt.weights().clone().requires_grad_()
    )
    out, out_ref = ours(kjt).values(), ref(kjt_ref).values()
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-7)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(kjt.weights().grad, kjt_ref.weights().grad, rtol=1e-6, atol=1e-6)
    store.close()


@needs_torchrec
@pytest.mark.parametrize(
    "ours_opt, torch_opt",
    [
        (Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)),
        (RowWiseAdagrad(lr=0.1), lambda p: TorchRecRowWiseAdagrad(p, lr=0.1)),
    ],
    ids=["adagrad", "rowwise_adagrad"],
)
def test_adagrads_update_the_rows_as_torch_and_torchrec_optimizers(tmp_path, ours_opt, torch_opt):
    """The same updates to float32 rounding: the store's kernels evaluate ``lr * g / (sqrt(s) + eps)``
    in another order than torch's ``addcdiv`` (a few ulp, not bit for bit)."""
    store, ours, ref = _pair(tmp_path, ours_opt)
    opt = torch_opt(ref.parameters())
    for step in range(3):
        kjt = _kjt(step)
        out, out_ref = ours(kjt), ref(kjt)
        grad = torch.cos(torch.arange(out.values().numel(), dtype=torch.float32) * 0.3 + step)
        opt.zero_grad()
        out.values().backward(grad.reshape(out.values().shape))
        out_ref.values().backward(grad.reshape(out.values().shape))
        opt.step()
    for cfg in ref.embedding_bag_configs():
        rows = torch.from_numpy(store.peek(cfg.name, np.arange(cfg.num_embeddings)))
        torch.testing.assert_close(rows, ref.embedding_bags[cfg.name].weight.detach(), rtol=1e-6, atol=1e-7)
    store.close()


@needs_torchrec
def test_mean_pooling_is_torchrecs_to_an_ulp(tmp_path):
    """torch divides a bag's sum by its length; the store multiplies by the float32 reciprocal
    (tiered_emb/step/gather.py): an ulp apart at most, and the same rows otherwise."""
    store, ours, ref = _pair(tmp_path, SGD(0.5), pooling="MEAN")
    kjt = _kjt(0)
    out, out_ref = ours(kjt).values(), ref(kjt).values().detach()
    torch.testing.assert_close(out, out_ref, rtol=1.2e-7, atol=0)
    store.close()


@needs_torchrec
def test_a_feature_in_two_tables_is_named_as_torchrec_names_it(tmp_path):
    cfgs = [
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="a", feature_names=["f"]),
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="b", feature_names=["f", "g"]),
    ]
    with TieredStore.create(tmp_path / "s", table_configs(cfgs, SGD(0.1)), TierConfig(32, device="cpu")) as store:
        ours = TieredEmbeddingBagCollection(store, cfgs)
        ref = EmbeddingBagCollection(cfgs)
        with torch.no_grad():
            for c in cfgs:
                ref.embedding_bags[c.name].weight.copy_(torch.from_numpy(store.peek(c.name, np.arange(20))))
        kjt = KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([1, 2, 3, 4]), torch.tensor([2, 1, 0, 1]))
        out, out_ref = ours(kjt), ref(kjt)
        assert out.keys() == out_ref.keys() == ["f@a", "f@b", "g"]
        assert _bytes(out.values()) == _bytes(out_ref.values())


@needs_torchrec
def test_variable_batch_features_with_inverse_indices_are_torchrecs(tmp_path):
    """A feature of 2 bags and one of 3, each spread over a batch of 4 by its inverse indices."""
    store, ours, ref = _pair(tmp_path, SGD(0.5))
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
        lengths=torch.tensor([2, 1, 1, 2, 1, 1]),
        stride_per_key_per_rank=[[2], [3], [1]],
        inverse_indices=(["f1", "f2", "f3"], torch.tensor([[0, 1, 0, 1], [2, 1, 0, 0], [0, 0, 0, 0]])),
    )
    out, out_ref = ours(kjt), ref(kjt)
    assert tuple(out.values().shape) == (4, 16) and _bytes(out.values()) == _bytes(out_ref.values())
    store.close()


# ---------------------------------------------------------------------------------------------------------
# configs


def _fields(cfg):
    """A config's fields but ``init_fn`` (a functools.partial, equal only to itself)."""
    return {k: v for k, v in vars(cfg).items() if k != "init_fn"}


@needs_torchrec
def test_configs_round_trip(tmp_path):
    bound = float(np.sqrt(1 / 40))  # TorchRec's default bounds for t2: +-sqrt(1 / num_embeddings)
    assert table_configs(_configs(), SGD(0.1))[1].init == Uniform(-bound, bound)
    cfgs = _configs()
    cfgs[0] = dataclasses.replace(cfgs[0], weight_init_min=-0.25, weight_init_max=0.5, init_fn=None)
    cfgs[1] = dataclasses.replace(cfgs[1], weight_init_min=-bound, weight_init_max=bound, init_fn=None)
    tables = table_configs(cfgs, RowWiseAdagrad(lr=0.1))
    assert tables[0] == TableConfig("t1", 8, 50, init=Uniform(-0.25, 0.5), optimizer=RowWiseAdagrad(lr=0.1))
    assert tables[1] == TableConfig("t2", 4, 40, init=Uniform(-bound, bound), optimizer=RowWiseAdagrad(lr=0.1))
    with TieredStore.create(tmp_path / "s", tables, TierConfig(64, device="cpu")) as store:
        given = TieredEmbeddingBagCollection(store, cfgs)
        assert given.embedding_bag_configs() is cfgs  # as TorchRec's: the list it was built from
        # today's arguments: configs made from the store's tables, which build the same collection again
        legacy = TieredEmbeddingBagCollection(store, {"f1": "t1", "f2": "t2", "f3": "t2"})
        made = legacy.embedding_bag_configs()
        assert [_fields(c) for c in made] == [_fields(c) for c in cfgs]
        again = TieredEmbeddingBagCollection(store, made)
        assert [_fields(c) for c in again.embedding_bag_configs()] == [_fields(c) for c in made]
        assert table_configs(made, RowWiseAdagrad(lr=0.1)) == tables
        with torch.no_grad():
            outs = [m(_kjt(5)).values().numpy().tobytes() for m in (given, legacy, again)]
        assert outs[0] == outs[1] == outs[2]
        # a table of unbounded ids says so with the largest int64
        cfg = TieredEmbeddingBagCollection(store, ["t1"]).embedding_bag_configs()[0]
        assert (cfg.name, cfg.feature_names, cfg.num_embeddings, cfg.pooling) == ("t1", ["t1"], 50, PoolingType.SUM)
    with TieredStore.create(tmp_path / "u", [TableConfig("u", 4)], TierConfig(8, device="cpu")) as store:
        assert TieredEmbeddingBagCollection(store, ["u"], mode="mean").embedding_bag_configs()[0].num_embeddings == (
            2**63 - 1
        )


@needs_torchrec
@pytest.mark.parametrize(
    "change, error",
    [
        ({"embedding_dim": 5}, ConfigError),
        ({"num_embeddings": 51}, ConfigError),
        ({"name": "nope"}, UnknownTableError),
        ({"data_type": "FP16"}, ConfigError),
        ({"pooling": "NONE"}, ConfigError),
    ],
)
def test_a_config_that_does_not_fit_the_store_is_a_typed_error(tmp_path, change, error):
    with TieredStore.create(tmp_path / "s", table_configs(_configs(), SGD(0.1)), TierConfig(8, device="cpu")) as s:
        cfgs = _configs()
        for k, v in change.items():
            v = DataType[v] if k == "data_type" else PoolingType[v] if k == "pooling" else v
            setattr(cfgs[0], k, v)
        with pytest.raises(error) as info:
            TieredEmbeddingBagCollection(s, cfgs)
        assert "Hint:" in str(info.value)


@needs_torchrec
def test_bad_input_is_a_typed_error_that_changes_nothing(tmp_path):
    cfgs = _configs()
    with pytest.raises(ConfigError, match="init_fn"):
        table_configs([EmbeddingBagConfig(10, 4, "x", init_fn=torch.nn.init.zeros_)], SGD(0.1))
    store, ours, _ = _pair(tmp_path, SGD(0.5))
    with pytest.raises(ConfigError, match="pooling"):
        TieredEmbeddingBagCollection(store, cfgs, mode="mean")
    with pytest.raises(ConfigError, match="no tables"):
        TieredEmbeddingBagCollection(store, [])
    before = _rows(store, cfgs)
    with pytest.raises(ConfigError, match="missing"):
        ours(KeyedJaggedTensor.from_lengths_sync(["f1"], torch.tensor([1]), torch.tensor([1])))
    with pytest.raises(ConfigError, match="KeyedJaggedTensor"):
        ours({"f1": (torch.tensor([1]), torch.tensor([1]))})
    weighted = TieredEmbeddingBagCollection(store, cfgs, is_weighted=True)
    with pytest.raises(ConfigError, match="weights"):
        weighted(_kjt(0))
    assert _rows(store, cfgs) == before
    store.close()


# ---------------------------------------------------------------------------------------------------------
# TorchRec's DLRM over the collection


@needs_torchrec
@pytest.mark.parametrize("arch", ["DLRM", "DLRM_DCN"])
def test_torchrecs_dlrm_trains_with_the_rows_updated_in_the_store(tmp_path, arch):
    cfgs = [EmbeddingBagConfig(100, 4, f"t{i}", feature_names=[f"f{i}"]) for i in range(3)]
    with TieredStore.create(
        tmp_path / "s", table_configs(cfgs, RowWiseAdagrad(0.1)), TierConfig(64, device="cpu")
    ) as s:
        torch.manual_seed(0)
        ebc = TieredEmbeddingBagCollection(s, cfgs)
        sizes = {"dense_in_features": 5, "dense_arch_layer_sizes": [8, 4], "over_arch_layer_sizes": [8, 1]}
        if arch == "DLRM":
            model = DLRM(embedding_bag_collection=ebc, **sizes)
        else:
            model = DLRM_DCN(embedding_bag_collection=ebc, dcn_num_layers=2, dcn_low_rank_dim=2, **sizes)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dense = torch.linspace(-1, 1, 40).reshape(8, 5)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            [f"f{i}" for i in range(3)], torch.arange(24) % 7, torch.ones(24, dtype=torch.int64)
        )
        labels = (torch.arange(8) % 2).float()
        before = {c.name: s.peek(c.name, np.arange(7)) for c in cfgs}
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), labels)
            loss.backward()  # the rows: updated in the store here
            opt.step()
            losses.append(float(loss.detach()))
        assert losses[-1] < losses[0]
        assert all(not np.array_equal(s.peek(n, np.arange(7)), rows) for n, rows in before.items())
        assert list(model.sparse_arch.parameters()) == []  # the rows are not torch parameters


SIZES = {"rows": 500, "dim": 4, "bottom": [8], "top": [8], "batch": 32}


def _dlrm_losses(store_dir, build, steps=8, pair_order=None):
    """Losses of ``steps`` train steps of a DLRM over a new store, as the job trains it (but its pipeline)."""
    features = [f"C{i + 1}" for i in range(NUM_CATS)]
    tables = [TableConfig(f, SIZES["dim"], SIZES["rows"], optimizer=RowWiseAdagrad(lr=0.05)) for f in features]
    data = SyntheticClicks(SIZES["rows"], SIZES["batch"], seed=0)
    losses = []
    with TieredStore.create(store_dir, tables, TierConfig(64, ddr_rows=64, device="cpu"), seed=0) as store:
        torch.manual_seed(0)
        model = build(store, features, SIZES["dim"], SIZES["bottom"], SIZES["top"])
        if pair_order is not None:  # the built-in's pairs: the built-in's weights copied as they are
            model.dlrm.inter_arch.triu_indices = pair_order
            torch.manual_seed(0)
            copy_builtin_weights(build_model(store, features, SIZES["dim"], SIZES["bottom"], SIZES["top"]), model)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        for step in range(steps):
            dense, cats, labels = data.batch(step)
            lengths = torch.ones(cats.shape[0], dtype=torch.int64)
            feats = {f: (torch.from_numpy(np.ascontiguousarray(cats[:, i])), lengths) for i, f in enumerate(features)}
            opt.zero_grad()
            loss = torch.nn.BCEWithLogitsLoss()(model(torch.from_numpy(dense), feats), torch.from_numpy(labels))
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        rows = {f: store.peek(f, np.arange(SIZES["rows"]), with_state=True).tobytes() for f in features}
    return losses, rows


@needs_torchrec
def test_torchrecs_dlrm_in_the_builtins_pair_order_trains_bitwise_as_the_builtin(tmp_path):
    """Same weights, same batches: TorchRec's DLRM over the collection, with its interaction in the
    built-in model's pair order, gives the built-in DLRM's losses and rows bit for bit."""
    ours, rows = _dlrm_losses(tmp_path / "a", build_model)
    theirs, their_rows = _dlrm_losses(tmp_path / "b", build_torchrec_model, pair_order=builtin_pairs(NUM_CATS + 1))
    assert ours == theirs
    assert rows == their_rows


@needs_torchrec
def test_torchrecs_dlrm_as_shipped_trains_as_the_builtin_to_rounding(tmp_path):
    """TorchRec's own pair order (upper triangle): the top MLP's first layer sums the same
    products in another order, so the losses agree to float32 rounding, which Adagrad's
    steps carry on (measured: a relative difference of ~1e-7 over 8 steps)."""
    ours, _ = _dlrm_losses(tmp_path / "a", build_model)
    theirs, _ = _dlrm_losses(tmp_path / "b", build_torchrec_model)
    np.testing.assert_allclose(theirs, ours, rtol=1e-5)


@needs_torchrec
def test_train_model_torchrec_runs_resumes_and_keeps_its_model(tmp_path):
    tiny = ["--batch", "32", "--rows", "500", "--dim", "4", "--hbm-rows", "64", "--ddr-rows", "64"]
    tiny += ["--bottom", "8", "--top", "8", "--eval-batches", "1", "--quiet", "--lookahead", "2"]
    reports = {}
    for model in ("dlrm", "torchrec"):
        run = tmp_path / model
        assert main(["train", "--run-dir", str(run), "--model", model, "--steps", "6", *tiny]) == 0
        reports[model] = json.loads((run / "report.json").read_text())
    for key in ("train_logloss", "test_logloss"):
        assert reports["torchrec"][key] == pytest.approx(reports["dlrm"][key], rel=1e-5)
    run = tmp_path / "torchrec"
    assert json.loads((run / "config.json").read_text())["model"] == "torchrec"
    with pytest.raises(ConfigError, match="--model"):
        main(["train", "--run-dir", str(run), "--resume", "--model", "dlrm", "--steps", "8", *tiny])
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(dict(config, model="other")))
    with pytest.raises(ConfigError, match="--model 'other' is unknown"):
        main(["train", "--run-dir", str(run), "--resume", "--steps", "8", *tiny])
    (run / "config.json").write_text(json.dumps(config))
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "8", *tiny]) == 0
    assert json.loads((run / "report.json").read_text())["steps"] == 8
    # the resumed run is bitwise one of 8 steps: rows, optimizer state, dense weights
    whole = tmp_path / "whole"
    assert main(["train", "--run-dir", str(whole), "--model", "torchrec", "--steps", "8", *tiny]) == 0
    assert _saved(run) == _saved(whole)


def _saved(run):
    """Every row with its state, and the dense weights and their optimizer's state, of a finished run."""
    with TieredStore.open(run / "store", restore="checkpoint") as store:
        rows = {t: store.peek(t, np.arange(500), with_state=True).tobytes() for t in store.tables}
        state = torch.load(io.BytesIO(store.extra), weights_only=True)
    # (a tiered module's entry is a reference to its rows: store path, table, checkpoint)
    dense = {k: v["table"] if k.endswith("_extra_state") else _bytes(v) for k, v in state["model"].items()}
    adagrad = {(k, n): _bytes(t) for k, v in state["opt"]["state"].items() for n, t in v.items()}
    return state["step"], rows, dense, adagrad


@needs_torchrec
@pytest.mark.parametrize("data_type, dtype", [("FP16", "float16"), ("BF16", "bfloat16"), ("INT8", "int8")])
def test_a_narrow_data_type_becomes_the_tables_dtype_and_trains(tmp_path, data_type, dtype):
    cfgs = _configs()
    for c in cfgs:
        c.data_type = DataType[data_type]
    tables = table_configs(cfgs, SGD(0.5))
    assert [t.dtype for t in tables] == [dtype, dtype]
    with TieredStore.create(tmp_path / "s", tables, TierConfig(16, ddr_rows=8, device="cpu")) as s:
        ebc = TieredEmbeddingBagCollection(s, cfgs)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([1, 1, 1, 1, 1, 1])
        )
        before = s.peek("t1", [1, 2])
        ebc(kjt).values().sum().backward()
        assert (s.peek("t1", [1, 2]) != before).any()
    cfgs[0].data_type = DataType.INT4
    with pytest.raises(ConfigError, match="INT4"):
        table_configs(cfgs, SGD(0.5))
