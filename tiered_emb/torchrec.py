"""TorchRec drop-in: an ``EmbeddingBagCollection`` whose rows live in a :class:`~tiered_emb.TieredStore`.

:class:`TieredEmbeddingBagCollection` goes where TorchRec's ``EmbeddingBagCollection``
goes (``torchrec.models.dlrm.DLRM(embedding_bag_collection=...)``, for one): it is built
from ``torchrec.EmbeddingBagConfig`` s over a store holding their tables, takes a
``KeyedJaggedTensor``, returns a ``KeyedTensor`` and implements TorchRec's
``EmbeddingBagCollectionInterface``.  As with every tiered module, the rows are not torch
parameters: the backward hands their gradients to the store, whose optimizer (each
table's ``TableConfig.optimizer``) updates the rows in place (fused).
:func:`table_configs` turns the ``EmbeddingBagConfig`` s into the store's tables::

    store = TieredStore.create(path, table_configs(configs, RowWiseAdagrad(lr=0.05)), tiers)
    ebc = TieredEmbeddingBagCollection(store, configs)
    model = DLRM(embedding_bag_collection=ebc, ...)

Importing this module needs torch, not torchrec: without torchrec (or with one that
cannot be imported) the module imports, and building the collection raises
:class:`~tiered_emb.errors.MissingExtraError` with the install recipe (docs/torchrec.md).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from tiered_emb.config import MAX_ID, TableConfig, Uniform
from tiered_emb.errors import ConfigError, MissingExtraError
from tiered_emb.torch import TieredEmbeddingBagCollection as _DictCollection

#: How to install torchrec for CPU beside ``fbgemm-gpu-cpu``: the hint of a :class:`MissingExtraError`.
INSTALL = (
    "install torchrec for CPU beside fbgemm-gpu-cpu: python -m pip install -e '.[torchrec]' && "
    "python -m pip install --no-deps torchrec==1.8.0 (plain `pip install torchrec` pulls the CUDA "
    "fbgemm-gpu); see docs/torchrec.md"
)

try:
    with warnings.catch_warnings():
        # fbgemm-gpu-cpu warns at import about the GPU-only SSD kernels it does not ship
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"fbgemm_gpu(\.|$)")
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import (
            EmbeddingBagCollectionInterface,
            get_embedding_names_by_table,
            process_pooled_embeddings,
            reorder_inverse_indices,
        )
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
        from torchrec.sparse.tensor_dict import maybe_td_to_kjt
    TORCHREC_ERROR: str | None = None
    _Interface: type = EmbeddingBagCollectionInterface
except (ImportError, OSError, RuntimeError) as err:  # absent, or its native libraries do not load
    TORCHREC_ERROR = f"{type(err).__name__}: {err}"
    _Interface = torch.nn.Module

#: Whether torchrec imported: without it the collection takes the ``tiered_emb.torch`` arguments only.
HAS_TORCHREC = TORCHREC_ERROR is None
_MODES = {"SUM": "sum", "MEAN": "mean"}


def _need_torchrec() -> None:
    if TORCHREC_ERROR is not None:
        raise MissingExtraError(f"torchrec cannot be imported ({TORCHREC_ERROR})", INSTALL)


def _dtypes() -> dict:
    return (
        {}
        if TORCHREC_ERROR is not None
        else {
            DataType.FP32: "float32",
            DataType.FP16: "float16",
            DataType.BF16: "bfloat16",
            DataType.INT8: "int8",
        }
    )


#: TorchRec's ``DataType`` -> the store's row precision (TableConfig.dtype)
_DTYPES = _dtypes()


def _check_config(cfg) -> None:
    """What a store-backed table can be: rows of a precision the store holds, sum or mean pooling, named."""
    if not isinstance(cfg, EmbeddingBagConfig):
        raise ConfigError(
            f"a table config of type {type(cfg).__name__} is invalid", "pass torchrec.EmbeddingBagConfig objects"
        )
    if not cfg.name:
        raise ConfigError("an EmbeddingBagConfig has name=''", "name every table: the name is the store's table")
    if cfg.data_type not in _DTYPES:
        raise ConfigError(
            f"EmbeddingBagConfig {cfg.name!r} has data_type={cfg.data_type}",
            "use DataType.FP32, FP16, BF16 or INT8: the rows' precision in the store",
        )
    if cfg.pooling.value not in _MODES:
        raise ConfigError(
            f"EmbeddingBagConfig {cfg.name!r} has pooling={cfg.pooling}", "use PoolingType.SUM or PoolingType.MEAN"
        )


def table_configs(configs, optimizer) -> list[TableConfig]:
    """The store's tables for TorchRec's ``EmbeddingBagConfig`` s, each with ``optimizer``.

    ``name``, ``embedding_dim`` and ``num_embeddings`` become the table's name, ``dim`` and
    ``num_rows``; rows start uniform in ``[weight_init_min, weight_init_max]``, by default
    ``+-sqrt(1 / num_embeddings)`` as in TorchRec (the same law, not the same values: a
    row's first value is a pure function of the store's seed, the table and the id).
    ``data_type`` FP32 / FP16 / BF16 / INT8 becomes the table's ``dtype``.  An
    ``init_fn`` other than TorchRec's uniform one cannot be honoured that way and is refused.

    Parameters
    ----------
    configs : list of torchrec.EmbeddingBagConfig
    optimizer : SGD | Adagrad | RowWiseAdagrad | Adam, applied by the store in backward

    Returns
    -------
    list of TableConfig, in the order of ``configs``
    """
    _need_torchrec()
    out = []
    for cfg in configs:
        _check_config(cfg)
        out.append(
            TableConfig(
                cfg.name,
                cfg.embedding_dim,
                cfg.num_embeddings,
                dtype=_DTYPES[cfg.data_type],
                init=_init_of(cfg),
                optimizer=optimizer,
            )
        )
    return out


def _init_of(cfg) -> Uniform:
    """The store's initialiser for a config's ``init_fn``: TorchRec's default (uniform between
    the config's bounds, ``+-sqrt(1 / num_embeddings)`` unless given) or another uniform."""
    fn = cfg.init_fn
    if isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_ and not fn.args:
        return Uniform(fn.keywords.get("a", 0.0), fn.keywords.get("b", 1.0))
    raise ConfigError(
        f"EmbeddingBagConfig {cfg.name!r} has init_fn={fn!r}; the store draws a row's first value "
        "from a uniform or normal law by (seed, table, id)",
        "leave init_fn out and give weight_init_min / weight_init_max, or write the rows with store.write",
    )


def _configs_of(source, feature_tables, mode: str) -> list:
    """``EmbeddingBagConfig`` s of today's arguments: one per table, its features in the order given."""
    if mode not in _MODES.values():
        raise ConfigError(f"mode={mode!r} is not supported", f"use one of {sorted(_MODES.values())}")
    if not isinstance(feature_tables, dict):
        feature_tables = {f: f for f in feature_tables}
    features: dict[str, list[str]] = {}
    for f, t in feature_tables.items():
        if not isinstance(f, str) or not isinstance(t, str):
            raise ConfigError(f"feature {f!r} -> table {t!r} is invalid", "name features and tables with str")
        features.setdefault(t, []).append(f)
    out = []
    for t, feats in features.items():
        table = source(t)  # UnknownTableError with a hint
        init = table.init
        out.append(
            EmbeddingBagConfig(
                # a table of unbounded ids takes any int64 id >= 0: MAX_ID says that in TorchRec's field
                num_embeddings=MAX_ID if table.num_rows is None else table.num_rows,
                embedding_dim=table.dim,
                name=t,
                feature_names=feats,
                pooling=PoolingType.SUM if mode == "sum" else PoolingType.MEAN,
                data_type=next(k for k, v in _DTYPES.items() if v == table.dtype),
                weight_init_min=init.low if isinstance(init, Uniform) else None,
                weight_init_max=init.high if isinstance(init, Uniform) else None,
            )
        )
    return out


def _check_against_tables(source, configs: list) -> None:
    """Every config names a table (``source(name)``: its TableConfig) of its width and size; no table twice."""
    seen = set()
    for cfg in configs:
        _check_config(cfg)
        if cfg.name in seen:
            raise ConfigError(f"table {cfg.name!r} is configured twice", "give each EmbeddingBagConfig its own name")
        seen.add(cfg.name)
        table = source(cfg.name)  # UnknownTableError with a hint
        if cfg.embedding_dim != table.dim:
            raise ConfigError(
                f"EmbeddingBagConfig {cfg.name!r} has embedding_dim={cfg.embedding_dim}, "
                f"the store's table dim={table.dim}",
                "give the table's dim, or create the store from these configs (table_configs)",
            )
        if _DTYPES[cfg.data_type] != table.dtype:
            raise ConfigError(
                f"EmbeddingBagConfig {cfg.name!r} has data_type={cfg.data_type}, "
                f"the store's table dtype={table.dtype!r}",
                "give the table's precision, or convert the store (tiered-emb convert)",
            )
        if table.num_rows is not None and cfg.num_embeddings != table.num_rows:
            raise ConfigError(
                f"EmbeddingBagConfig {cfg.name!r} has num_embeddings={cfg.num_embeddings}, "
                f"the store's table num_rows={table.num_rows}",
                "give the table's num_rows, or create the store from these configs (table_configs)",
            )


class TieredEmbeddingBagCollection(_Interface):
    """TorchRec's ``EmbeddingBagCollection`` over the tables of a :class:`~tiered_emb.TieredStore`.

    Parameters
    ----------
    store : TieredStore, holding a table per config (:func:`table_configs` makes them)
    tables : list of torchrec.EmbeddingBagConfig, as TorchRec's ``EmbeddingBagCollection``
        (each config's ``name`` is a table of ``store``, with its ``embedding_dim`` and, for a
        table of bounded ids, its ``num_embeddings``; ``pooling`` SUM or MEAN); or, as
        :class:`tiered_emb.torch.TieredEmbeddingBagCollection`, a dict feature -> table (a
        list: feature == table), whose configs are then made from the store's tables
    is_weighted : bool, pool with the ``KeyedJaggedTensor`` 's weights (as TorchRec)
    device : None, or the store's device (``cpu``, or ``cuda`` with a CuPy HBM tier)
    mode : ``"sum"`` or ``"mean"``, only with a dict / list of features (configs say their pooling)
    nonfinite : ``"raise"`` (default), ``"skip"`` or ``"zero"``: NaN/inf gradients, as
        :meth:`TieredStore.apply_gradients`
    sharded : None, or a :class:`tiered_emb.distributed.Shards` (a job's plan, tables and
        this rank's store, then ``store``): the collection is sharded over the job's ranks,
        each rank giving its own samples' features (docs/distributed.md)
    optimizer : with ``store=None`` only: a collection that TorchRec's
        ``DistributedModelParallel`` shards (:func:`dmp_sharder`), whose tables are
        ``table_configs(tables, optimizer)``

    ``forward`` takes a ``KeyedJaggedTensor`` (or a ``TensorDict``, as TorchRec) and returns a
    ``KeyedTensor`` of float32 values (B, sum of dims), keys in the order of the configs'
    features.  Features of one table are pooled as one batch: one optimizer step per row on
    their summed gradient, as a torch optimizer over TorchRec's collection takes.

    Examples
    --------
    >>> import tempfile, torch
    >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    >>> from tiered_emb import TieredStore, TierConfig, SGD
    >>> configs = [EmbeddingBagConfig(num_embeddings=100, embedding_dim=4, name="t", feature_names=["f", "g"])]
    >>> store = TieredStore.create(tempfile.mkdtemp() + "/s", table_configs(configs, SGD(lr=0.1)),
    ...                            TierConfig(hbm_rows=16, device="cpu"))
    >>> ebc = TieredEmbeddingBagCollection(store, configs)
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1, 0]))
    >>> kt = ebc(kjt)
    >>> kt.keys(), tuple(kt.values().shape)
    (['f', 'g'], (2, 8))
    >>> kt.values().sum().backward()  # rows 1, 2, 3 updated by the store's SGD
    >>> store.close()
    """

    def __init__(
        self,
        store,
        tables,
        is_weighted: bool = False,
        device=None,
        *,
        mode=None,
        nonfinite: str = "raise",
        sharded=None,
        optimizer=None,
    ):
        _need_torchrec()
        super().__init__()
        if not isinstance(tables, (dict, list)):  # a list is kept as given: embedding_bag_configs() returns it
            tables = list(tables)
        if not tables:
            raise ConfigError("no tables were given", "give one EmbeddingBagConfig (or feature) per table at least")
        if store is None and sharded is None:  # to be sharded by DistributedModelParallel (dmp_sharder)
            if optimizer is None or isinstance(tables, dict) or any(isinstance(t, str) for t in tables):
                raise ConfigError(
                    "a collection without a store takes EmbeddingBagConfigs and an optimizer",
                    "give store=None, the configs and optimizer=..., and shard it with "
                    "DistributedModelParallel(model, sharders=[dmp_sharder(...)]); or give a store",
                )
            job = {t.name: t for t in table_configs(tables, optimizer)}
            source = job.__getitem__
        else:
            source = sharded.table_config if sharded is not None else store.engine.table_config
        if isinstance(tables, dict) or all(isinstance(t, str) for t in tables):
            configs = _configs_of(source, tables, "sum" if mode is None else mode)
        else:
            if mode is not None:
                raise ConfigError(f"mode={mode!r} with EmbeddingBagConfigs", "set each config's pooling instead")
            configs = tables
            for cfg in configs:
                _check_config(cfg)
                if not cfg.feature_names:  # as TorchRec: a table without features is its own feature
                    cfg.feature_names = [cfg.name]
        _check_against_tables(source, configs)
        self.store, self.sharded, self.nonfinite = store, sharded, nonfinite
        self.job_tables = [source(cfg.name) for cfg in configs]
        self.weighted = bool(is_weighted)
        self.configs = configs
        names = get_embedding_names_by_table(configs)
        self.embedding_names = [n for per_table in names for n in per_table]
        self.feature_names = [f for cfg in configs for f in cfg.feature_names]
        self.dims = [cfg.embedding_dim for cfg in configs for _ in cfg.feature_names]
        if device is not None and torch.device(device).type != self.device.type:
            raise ConfigError(f"device={device!r}, the store's is {self.device}", "leave device=None")
        # One dict collection per pooling mode, keyed by embedding name (a feature of two
        # tables is "feature@table" in both, as TorchRec names them).  Each checks its own
        # features before it reads a row; with both modes, bad input to the second raises
        # after the first has read rows (no row changes: nothing is updated without a backward).
        groups: dict[str, dict[str, str]] = {}
        for cfg, per_table in zip(configs, names, strict=True):
            groups.setdefault(_MODES[cfg.pooling.value], {}).update(dict.fromkeys(per_table, cfg.name))
        if sharded is not None:
            made = {m: sharded.collection(tabs, mode=m, nonfinite=nonfinite) for m, tabs in groups.items()}
        elif store is None:
            made = {}  # (the sharder gives it its collections)
        else:
            made = {m: _DictCollection(store, tabs, mode=m, nonfinite=nonfinite) for m, tabs in groups.items()}
        self.collections = torch.nn.ModuleDict(made)

    @property
    def device(self) -> torch.device:
        """Where the pooled rows are: the CPU, or the GPU of a CuPy HBM tier."""
        if self.sharded is not None or self.store is None:  # the sharded collection's rows cross ranks on the host
            return torch.device("cpu")
        return torch.device("cpu" if self.store.engine.xp is np else "cuda")

    def embedding_bag_configs(self) -> list:
        """The ``EmbeddingBagConfig`` s, one per table (as given, or made from the store's tables)."""
        return self.configs

    def is_weighted(self) -> bool:
        """Whether the bags are pooled with the ``KeyedJaggedTensor`` 's weights."""
        return self.weighted

    def forward(self, features):
        """Pooled rows per feature, a ``KeyedTensor``; see the class docstring."""
        if not self.collections:
            raise ConfigError(
                "this collection has no store: it runs once DistributedModelParallel has sharded it",
                "wrap the model: DistributedModelParallel(model, sharders=[dmp_sharder(root, tiers)])",
            )
        features = maybe_td_to_kjt(features, None)
        if not isinstance(features, KeyedJaggedTensor):
            raise ConfigError(
                f"features of type {type(features).__name__} are not supported", "pass a torchrec KeyedJaggedTensor"
            )
        keys = set(features.keys())  # a KeyedJaggedTensor has no `in`
        missing = [f for f in dict.fromkeys(self.feature_names) if f not in keys]
        if missing:
            raise ConfigError(
                f"features {missing} are missing from the batch", f"give every one of {self.feature_names}"
            )
        if self.weighted and features.weights_or_none() is None:
            raise ConfigError("is_weighted=True and the batch has no weights", "pass a KeyedJaggedTensor with weights")
        jagged = features.to_dict()
        by_name = dict(zip(self.embedding_names, self.feature_names, strict=True))
        pooled: dict[str, torch.Tensor] = {}
        for collection in self.collections.values():
            batch = {}
            for name in collection.feature_tables:
                jt = jagged[by_name[name]]
                batch[name] = (jt.values(), jt.lengths(), jt.weights() if self.weighted else None)
            pooled.update(collection(batch))
        inverse = reorder_inverse_indices(features.inverse_indices_or_none(), self.feature_names)
        values = process_pooled_embeddings([pooled[n] for n in self.embedding_names], inverse)
        return KeyedTensor(keys=list(self.embedding_names), length_per_key=list(self.dims), values=values)

    def extra_repr(self) -> str:
        return f"tables={[c.name for c in self.configs]}, is_weighted={self.weighted}"


def sharding_plan(plan, world_size: int, module_path: str = ""):
    """A :class:`tiered_emb.distributed.ShardingPlan` from TorchRec's planner's plan (an
    ``EmbeddingShardingPlanner().plan(...)`` result) for the collection at ``module_path``.

    Each table keeps its sharding type and ranks; a column-wise table its column cuts (in
    column order).  One difference: TorchRec's row-wise shards hold blocks of consecutive
    ids, where tiered_emb's hash each id to its rank (``row_owner``), so that a table of
    unbounded ids splits evenly too.  Check the result against the tables
    (:meth:`~tiered_emb.distributed.ShardingPlan.check`).
    """
    _need_torchrec()
    if module_path not in plan.plan:
        raise ConfigError(f"the plan has no module {module_path!r}", f"use one of {sorted(plan.plan)}")
    return _plan_of(plan.plan[module_path], world_size)


def _plan_of(params: dict, world_size: int):
    """Our plan of TorchRec's ``ParameterSharding`` s, by table."""
    from tiered_emb.distributed import ShardingPlan, ShardingType, TablePlan

    everyone = tuple(range(world_size))
    tables = []
    for name, ps in params.items():
        kind = ps.sharding_type
        if kind in ("column_wise", "table_column_wise"):
            shards = sorted(ps.sharding_spec.shards, key=lambda sh: sh.shard_offsets[1])
            last = shards[-1].shard_offsets[1] + shards[-1].shard_sizes[1]
            cuts = (*(sh.shard_offsets[1] for sh in shards), last)
            ranks = tuple(sh.placement.rank() for sh in shards)
            tables.append(TablePlan(name, ShardingType.COLUMN_WISE, ranks, cuts))
        elif kind == "table_row_wise":
            tables.append(TablePlan(name, ShardingType.TABLE_ROW_WISE, tuple(sorted(set(ps.ranks)))))
        elif kind in ("row_wise", "data_parallel"):
            tables.append(TablePlan(name, ShardingType(kind), everyone))
        elif kind == "table_wise":
            tables.append(TablePlan(name, ShardingType.TABLE_WISE, (ps.ranks[0],)))
        else:
            raise ConfigError(f"TorchRec's plan shards table {name!r} {kind}", "plan it table-, row- or column-wise")
    return ShardingPlan(world_size, tuple(tables))


def dmp_sharder(root, tiers, seed: int = 0, comm_dtype: str = "fp32", column_wise: bool = True):
    """A TorchRec ``ModuleSharder`` for :class:`TieredEmbeddingBagCollection`, so that
    ``DistributedModelParallel(model, sharders=[dmp_sharder(root, tiers)])`` shards a model's
    tiered collection (made with ``store=None``, its configs and ``optimizer``) as it shards
    its own: TorchRec's planner places the tables (table-, row-, column-, table-row-wise or
    data-parallel), each rank opens its shards under ``root``
    (:func:`tiered_emb.distributed.open_shards`, ``tiers``, ``seed``) and the module
    becomes the sharded collection (:class:`tiered_emb.distributed.ShardedEmbeddingBagCollection`
    in TorchRec's form), its update fused into the backward as in one process.

    Each rank gives its own samples' ``KeyedJaggedTensor``; the forward returns the
    ``KeyedTensor`` itself (no awaitable: the exchange runs in the forward).
    ``column_wise=False`` keeps TorchRec's planner from cutting tables by columns.
    """
    _need_torchrec()
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.types import ModuleSharder, ShardedModule, ShardingType

    from tiered_emb.distributed import Shards, open_shards

    class ShardedTieredCollection(ShardedModule):
        """The sharded form DistributedModelParallel puts in place of the collection."""

        def __init__(self, inner: TieredEmbeddingBagCollection):
            super().__init__()
            self.inner = inner

        def forward(self, features):
            return self.inner(features)

        def create_context(self):
            return None

        def input_dist(self, ctx, *input, **kwargs):
            raise NotImplementedError("the tiered collection exchanges ids and rows in its forward")

        compute = output_dist = input_dist

        @property
        def unsharded_module_type(self):
            return TieredEmbeddingBagCollection

    class TieredSharder(ModuleSharder):
        @property
        def module_type(self):
            return TieredEmbeddingBagCollection

        def sharding_types(self, compute_device_type: str) -> list[str]:
            kinds = ("TABLE_WISE", "ROW_WISE", "COLUMN_WISE", "TABLE_ROW_WISE", "DATA_PARALLEL")
            return [ShardingType[k].value for k in kinds if column_wise or k != "COLUMN_WISE"]

        def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
            return [EmbeddingComputeKernel.FUSED.value]

        def shardable_parameters(self, module) -> dict:
            # the rows are in the stores: shapes for the planner, on the meta device
            return {
                c.name: torch.nn.Parameter(torch.empty(c.num_embeddings, c.embedding_dim, device="meta"))
                for c in module.configs
            }

        def shard(self, module, params, env, device=None, module_fqn=None):
            plan = _plan_of(params, env.world_size)
            plan.check(module.job_tables)
            store = open_shards(root, plan, module.job_tables, tiers, env.rank, seed=seed)
            shards = Shards(store, plan, module.job_tables, comm_dtype=comm_dtype, group=env.process_group)
            inner = TieredEmbeddingBagCollection(
                store, module.configs, is_weighted=module.weighted, nonfinite=module.nonfinite, sharded=shards
            )
            return ShardedTieredCollection(inner)

    return TieredSharder()


__all__ = [
    "HAS_TORCHREC",
    "INSTALL",
    "TieredEmbeddingBagCollection",
    "dmp_sharder",
    "sharding_plan",
    "table_configs",
]
