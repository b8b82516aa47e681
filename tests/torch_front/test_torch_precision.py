"""The torch front end over narrow rows: ``output_dtype``, and float16 training that cannot
apply a scaled gradient to the rows."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import ConfigError, RowWiseAdagrad, TableConfig, TierConfig, TieredStore  # noqa: E402
from tiered_emb.torch import TieredEmbeddingBag, TieredEmbeddingBagCollection, TieredOptimizer  # noqa: E402


def _store(tmp_path, name, dtype="float16"):
    table = TableConfig("t", dim=6, num_rows=50, dtype=dtype, optimizer=RowWiseAdagrad(lr=0.2))
    return TieredStore.create(tmp_path / name, [table], TierConfig(hbm_rows=16, ddr_rows=8, device="cpu"), seed=2)


IDS = torch.tensor([1, 2, 3, 3, 40, 7])
OFFSETS = torch.tensor([0, 2, 4])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_output_dtype_casts_the_pooled_rows_and_the_update_is_the_float32_one(tmp_path, out_dtype):
    with _store(tmp_path, "a") as s, _store(tmp_path, "b") as ref:
        bag = TieredEmbeddingBag(s, "t", mode="sum", output_dtype=out_dtype)
        want = TieredEmbeddingBag(ref, "t", mode="sum")(IDS, OFFSETS)
        out = bag(IDS, OFFSETS)
        assert out.dtype == out_dtype
        torch.testing.assert_close(out.float(), want.to(out_dtype).float(), rtol=0, atol=0)
        g = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        (out.float() * g).sum().backward()
        (want * g.to(out_dtype).float()).sum().backward()  # (the gradient the cast hands back)
        assert s.peek("t", np.arange(50), True).tobytes() == ref.peek("t", np.arange(50), True).tobytes()


def test_a_float16_output_with_a_fused_update_is_refused_and_runs_under_the_optimizer(tmp_path):
    with _store(tmp_path, "a") as s, _store(tmp_path, "b") as ref:
        bag = TieredEmbeddingBag(s, "t", mode="sum", output_dtype=torch.float16)
        before = s.peek("t", np.arange(50), True)
        with pytest.raises(ConfigError, match="GradScaler"):
            bag(IDS, OFFSETS)
        assert s.peek("t", np.arange(50), True).tobytes() == before.tobytes()
        for store, scaled in ((s, True), (ref, False)):
            torch.manual_seed(0)
            bag = TieredEmbeddingBag(store, "t", mode="sum", output_dtype=torch.float16)
            lin = torch.nn.Linear(6, 1)
            opt = TieredOptimizer(bag, torch.optim.SGD(lin.parameters(), lr=0.1))
            loss = lin(bag(IDS, OFFSETS).float()).sum()
            if scaled:  # (a power of two: unscaling is exact, so the rows match the unscaled run's)
                scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        assert s.peek("t", np.arange(50), True).tobytes() == ref.peek("t", np.arange(50), True).tobytes()
        assert s.peek("t", np.arange(50), True).tobytes() != before.tobytes()


def test_a_collection_takes_output_dtype_and_refuses_an_unknown_one(tmp_path):
    with _store(tmp_path, "a", "int8") as s:
        ebc = TieredEmbeddingBagCollection(s, ["t"], output_dtype=torch.bfloat16)
        out = ebc({"t": (IDS, torch.tensor([2, 4]))})
        assert out["t"].dtype == torch.bfloat16 and out["t"].shape == (2, 6)
        with pytest.raises(ConfigError, match="output_dtype"):
            TieredEmbeddingBag(s, "t", output_dtype=torch.float64)
