"""What the tests of TieredStore (tests/store/test_store_*.py) share: two tables and a CPU tier config."""

from tiered_emb import SGD, Normal, RowWiseAdagrad, TableConfig, TierConfig

TABLES = [
    TableConfig("a", dim=8, optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig("b", dim=3, num_rows=100, init=Normal(std=0.1), optimizer=SGD(lr=0.5)),
]


def cpu(hbm, ddr=0, **kw):
    return TierConfig(hbm_rows=hbm, ddr_rows=ddr, device="cpu", **kw)
